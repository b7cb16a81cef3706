"""Complete runs whose plugin changed since: the plugin behind a run's task, encoding or model
installed now at another version or with other source code than the run recorded
(``che_bench.plugins.provenance_of``). ``run`` and ``sweep`` name each such run instead of
reusing it silently, and rerun it with ``--rerun-stale``."""

from __future__ import annotations

from collections.abc import Iterable

from che_bench import plugins
from che_bench.config import RunConfig
from che_bench.run.runner import plugin_origins


def stale_runs(configs: Iterable[RunConfig], store, complete: set[str]) -> dict[str, str]:
    """Run id -> how its plugins differ (``plugins.provenance_changes``, joined by "; "), for
    each config among the ``complete`` run ids of ``store`` whose recorded plugins differ from
    those installed here; runs that recorded no plugins (stored before che-bench recorded
    them) are not judged."""
    by_id = {config.run_id(): config for config in configs}
    recorded = store.run_plugins([run_id for run_id in by_id if run_id in complete])
    stale = {}
    for run_id, used in recorded.items():
        if used is None:
            continue
        installed = plugins.provenance_of(*plugin_origins(by_id[run_id]))
        changes = plugins.provenance_changes(used, installed)
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
