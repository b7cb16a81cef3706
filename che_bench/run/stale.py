"""Complete runs whose plugin changed since: the plugin behind a run's task, encoding or model
installed now at another version or with other source code than the run recorded
(``che_bench.plugins.provenance_of``). ``run`` and ``sweep`` name each such run instead of
reusing it silently, and rerun it with ``--rerun-stale``."""

from __future__ import annotations

from collections.abc import Mapping

from che_bench import plugins
from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.run.provenance import plugin_origins


def stale_runs(complete: Mapping[str, RunConfig], store) -> dict[str, str]:
    """Run id -> how its plugins differ (``plugins.provenance_changes``, joined by "; "), for
    each of the ``complete`` runs of ``store`` (run id -> config) whose recorded plugins
    differ from those installed here; runs that recorded no plugins (stored before che-bench
    recorded them) and runs whose plugin is not loaded here at all are not judged."""
    stale = {}
    for run_id, used in store.run_plugins(list(complete)).items():
        try:
            origins = plugin_origins(complete[run_id])
        except CheBenchError:  # a name no plugin loaded here registers: nothing to compare
            continue
        changes = (
            []
            if used is None
            else plugins.provenance_changes(used, plugins.provenance_of(*origins))
        )
        if changes:
            stale[run_id] = "; ".join(changes)
    return stale


def stale_notice(run_id: str, changes: str, rerun: bool) -> str:
    """The one line that names a stale run and what happens to it."""
    action = (
        "rerunning it (--rerun-stale)"
        if rerun
        else "kept, not rerun: --rerun-stale reruns it (its stored result is replaced)"
    )
    return f"run {run_id} is stale: {changes}; {action}"
