"""The report's Reproduce section: the commands that rerun its runs and rebuild the page."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench.reports.page import escaped
from che_bench.store import ORIGINAL, ResultStore

#: Up to this many runs, the page lists one ``che-bench run`` command per run.
MAX_RUN_COMMANDS = 10


#: ``che-bench run`` arguments that recreate a run from its stored config and id, or None.
CommandLine = Callable[[dict[str, Any], str], "list[str] | None"]


def reproduce_html(
    store: ResultStore,
    runs: pd.DataFrame,
    suite: str | None,
    shown: str,
    command_line: CommandLine | None,
    page_command: list[str],
) -> str:
    """The commands that rerun the selection, and ``page_command``, which rebuilds this page
    (its scores are those of ``shown``)."""
    store_args = ["--store", str(store.path)]
    parts = []
    if suite is not None:
        from che_bench.run.suites import resolve_suite_path

        parts.append(
            _pre([shlex.join(["che-bench", "sweep", str(resolve_suite_path(suite)), *store_args])])
        )
    elif command_line is not None and len(runs) <= MAX_RUN_COMMANDS:
        commands, inexpressible = [], []
        for run in runs.itertuples(index=False):
            argv = command_line(json.loads(run.config), run.run_id)
            if argv is None:
                inexpressible.append(run.run_id)
            else:
                commands.append(shlex.join(["che-bench", *argv, *store_args]))
        parts.append(_pre(commands) if commands else "")
        if inexpressible:
            parts.append(
                f"<p>Runs {escaped(', '.join(inexpressible))} use settings that "
                "<code>che-bench run</code> has no flag for; their full configurations "
                "are in the store (<code>che-bench export</code>, column "
                "<code>run_id</code>).</p>"
            )
    else:
        parts.append(
            f"<p>{len(runs)} runs: too many to list one <code>che-bench run</code> "
            "command each. Their full configurations are in the store; a suite file "
            "(see <code>tasks/</code>) with <code>che-bench sweep</code> reruns such "
            "a grid.</p>"
        )
    if "--evaluation" in page_command:
        parts.append(
            f"<p>The scores are those of {escaped(shown)}: re-evaluate the kept models under "
            "that protocol before rebuilding this page.</p>"
        )
    parts.append("<p>This page:</p>" + _pre([shlex.join(page_command)]))
    return "\n".join(part for part in parts if part)


def page_command(
    store: ResultStore,
    suite: str | None,
    tasks: Iterable[str] | None,
    run_ids: Iterable[str] | None,
    archs: Iterable[str] | None,
    evaluation: str,
    metric: str,
    out: str | Path,
) -> list[str]:
    """The ``che-bench report`` command line that rebuilds this page into ``out``."""
    report = ["che-bench", "report"]
    if suite is not None:
        report += ["--suite", str(suite)]
    for task in tasks or ():
        report += ["--task", str(task)]
    if run_ids is not None:
        report += ["--run", *map(str, run_ids)]
    for arch in archs or ():
        report += ["--arch", str(arch)]
    if evaluation != ORIGINAL:
        report += ["--evaluation", evaluation]
    if metric != "token":
        report += ["--metric", metric]
    return [*report, "--store", str(store.path), "--out", str(out)]


def _pre(lines: list[str]) -> str:
    return "<pre>" + "\n".join(escaped(line) for line in lines) + "</pre>"
