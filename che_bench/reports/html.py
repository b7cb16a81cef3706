"""``che-bench report``: one self-contained, static HTML page about a selection of runs.

The page holds the CHE table (``tables.display_table``), whether the runs learned (training
lengths, and runs whose training accuracy ended at an input-blind guess's:
``stuck.stuck_runs``), one accuracy-versus-length figure per task (``plots.task_panel_png``)
and one training-curves figure per table cell (``plots.curves_png``), embedded as base64 PNG
data URIs, what ran (presets, steps, versions, devices, CPUs, statuses, failures:
``what_ran``) and the commands that reproduce it (``reproduce``). It loads nothing: no
external CSS, scripts, fonts or images, and its Content-Security-Policy forbids every fetch
but its own inline style, its one tiny script and data: images. Every string taken from the
store is HTML-escaped.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.reports.export import curves_frame
from che_bench.reports.labels import labelled_runs, run_encoding_label
from che_bench.reports.metrics import METRIC_NOTES
from che_bench.reports.page import escaped, page_html
from che_bench.reports.paper import paper_table_or_none
from che_bench.reports.reproduce import CommandLine, page_command, reproduce_html
from che_bench.reports.selection import select_runs, suite_best_over
from che_bench.reports.stuck import STUCK_TEXT, stuck_runs
from che_bench.reports.tables import display_table
from che_bench.reports.what_ran import what_ran_html
from che_bench.store import ORIGINAL, ResultStore, describe_protocol

#: At most this many table cells get a training-curves figure (the page stays a few MB).
MAX_CURVE_FIGURES = 48


def render_report(
    store: ResultStore,
    *,
    suite: str | None = None,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    archs: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    metric: str = "token",
    out: str | Path = "report.html",
    command_line: CommandLine | None = None,
) -> str:
    """The report page (HTML text), for file ``out``, of a selection (see ``select_runs``)
    under ``evaluation``, scores in ``metric`` (``reports.METRICS``). ``command_line(config,
    run_id)`` gives the ``che-bench run`` arguments that recreate a run (None: no such
    command); the command line provides it (``che_bench.commands.command_lines``), since
    only it knows its own flags. Without it the page lists no per-run commands."""
    runs, title = select_runs(store, suite=suite, tasks=tasks, run_ids=run_ids, archs=archs)
    ids = list(runs["run_id"])
    evaluated = store.runs(ids, evaluation)
    if evaluation != ORIGINAL and not (evaluated["status"] == "complete").any():
        raise CheBenchError(f"no complete run of {title} has evaluation {evaluation}")
    compare = "paper" if paper_table_or_none() is not None and metric == "token" else "none"
    best = suite_best_over(suite)
    table, notes = display_table(
        store, run_ids=ids, compare=compare, evaluation=evaluation, metric=metric, best_over=best
    )
    figures = _length_figures(store, table, ids, evaluation, metric)
    shown = _shown_evaluation(evaluated, evaluation)
    sections = [
        f"<h1>che-bench report: {escaped(title)}</h1>",
        f"<p>Store <code>{escaped(store.path)}</code>, generated "
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. Scores: "
        f"{escaped(shown)}; "
        f"{escaped(METRIC_NOTES[metric])}.</p>",
        "<h2>Table</h2>",
        _table_html(table, notes),
        "<h2>Did the models learn the training lengths?</h2>",
        _learning_html(evaluated),
        _stuck_html(store, runs),
        "<h2>Accuracy against length</h2>",
        "".join(_figure_html(label, png, "accuracy against length") for label, png in figures)
        or "<p>No complete runs.</p>",
        "<h2>Training curves</h2>",
        _curves_html(store, runs),
        "<h2>What ran</h2>",
        what_ran_html(store, runs, evaluation),
        "<h2>Reproduce</h2>",
        reproduce_html(
            store,
            runs,
            suite,
            shown,
            command_line,
            page_command(store, suite, tasks, run_ids, archs, evaluation, metric, out),
        ),
    ]
    return page_html(f"che-bench report: {title}", sections)


def _length_figures(
    store: ResultStore, table: pd.DataFrame, ids: list[str], evaluation: str, metric: str
) -> list[tuple[str, bytes]]:
    """One accuracy-against-length figure per task of ``table``, in its row order (by level,
    then the paper's task order)."""
    from che_bench.reports.plots import plot_data, task_labels, task_panel_png

    if table.empty:
        return []
    plotted, curves = plot_data(store, run_ids=ids, evaluation=evaluation, metric=metric)
    panels = set(task_labels(plotted))
    labels = [task for _, task, _ in table.index if task in panels]
    return [(label, task_panel_png(plotted, curves, label)) for label in labels]


def write_report(store: ResultStore, out: str | Path, **selection: Any) -> Path:
    """Render the report (``render_report`` keywords) into file ``out``; returns its path."""
    out = Path(out)
    page = render_report(store, **selection, out=out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise CheBenchError(f"cannot write report {out}: {exc.strerror or exc}") from None
    return out


def _shown_evaluation(evaluated: pd.DataFrame, evaluation: str) -> str:
    if evaluation == ORIGINAL:
        return "each run's original evaluation"
    summary = describe_protocol(json.loads(evaluated["protocol"].iloc[0]))
    return f"evaluation {evaluation} ({summary}), a re-evaluation of the kept models"


def _table_html(table: pd.DataFrame, notes: list[str]) -> str:
    if table.empty:
        return "<p>No complete runs.</p>"
    frame = table.reset_index().rename(columns={"chance": "chance %"})
    text_columns = {"level", "task"}
    header = "".join(
        f'<th class="{"text" if column in text_columns else "num"}">{escaped(column)}</th>'
        for column in frame.columns
    )
    rows = [
        "<tr>"
        + "".join(
            f'<td class="{"text" if column in text_columns else "num"}">{escaped(value)}</td>'
            for column, value in zip(frame.columns, row, strict=False)
        )
        + "</tr>"
        for row in frame.itertuples(index=False)
    ]
    notes_html = "".join(f"<li>{escaped(note)}</li>" for note in notes)
    return (
        f'<div class="wide"><table id="che-table"><thead><tr>{header}</tr></thead>'
        f'<tbody>{"".join(rows)}</tbody></table></div>\n<ul class="notes">{notes_html}</ul>'
    )


def _figure_html(label: str, png: bytes, what: str, size: tuple[int, int] = (600, 400)) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img src="data:image/png;base64,{data}" width="{size[0]}" '
        f'height="{size[1]}" alt="{escaped(what)}, {escaped(label)}"></figure>'
    )


def _stuck_html(store: ResultStore, runs: pd.DataFrame) -> str:
    """The runs whose training accuracy ended no better than a guess blind to the input's
    content (``stuck.STUCK_TEXT``): they learned nothing, whatever their scores."""
    stuck = stuck_runs(store, runs["run_id"])
    if stuck.empty:
        return (
            '<p id="stuck">No run has a training history (runs made before che-bench kept one).</p>'
        )
    flagged = stuck[stuck["stuck"]].merge(runs, on="run_id")
    if flagged.empty:
        return (
            f'<p id="stuck">None of the {len(stuck)} runs with a training history is stuck '
            f"({escaped(STUCK_TEXT)}).</p>"
        )
    rows = "".join(
        f'<tr><td class="text">{escaped(run.run_id)}</td><td class="text">{escaped(run.task)}</td>'
        f'<td class="text">{escaped(run_encoding_label(run.config))}</td>'
        f'<td class="num">{escaped(run.seed)}</td><td class="num">{run.lr:g}</td>'
        + "".join(
            f'<td class="num">{100 * value:.2f}</td>'
            for value in (run.final_accuracy, run.baseline_accuracy, run.margin)
        )
        + "</tr>"
        for run in flagged.itertuples(index=False)
    )
    return (
        f'<p id="stuck">Stuck: {len(flagged)} of {len(stuck)} runs: {escaped(STUCK_TEXT)}.</p>\n'
        '<div class="wide"><table id="stuck-runs"><thead><tr><th class="text">run id</th>'
        '<th class="text">task</th><th class="text">encoding</th><th>seed</th><th>lr</th>'
        "<th>final training accuracy %</th><th>input-blind guess %</th><th>margin %</th></tr>"
        f"</thead><tbody>{rows}</tbody></table></div>"
    )


def _curves_html(store: ResultStore, runs: pd.DataFrame) -> str:
    """One figure per table cell (the first ``MAX_CURVE_FIGURES`` with a history): its runs'
    training loss and accuracy against step."""
    from che_bench.reports.plots import curves_png

    with_history = set(store.lowest_losses(runs["run_id"]).index)
    if not with_history:
        return "<p>No run has a training history (runs made before che-bench kept one).</p>"
    cells = labelled_runs(runs[runs["run_id"].isin(with_history)].reset_index(drop=True))
    groups = list(cells.groupby(["task_label", "column"], sort=False)["run_id"])
    shown = groups[:MAX_CURVE_FIGURES]
    curves = curves_frame(store, [run_id for _, ids in shown for run_id in ids])
    figures = [
        _figure_html(
            f"{task} / {column}",
            curves_png(curves[curves["run_id"].isin(set(ids))], f"{task} / {column}"),
            "training curves",
            (960, 320),
        )
        for (task, column), ids in shown
    ]
    more = len(groups) - len(shown)
    note = (
        f"<p>{more} more cells are not drawn: see <code>che-bench curves RUN_ID...</code> "
        "and <code>che-bench export --curves</code>.</p>"
        if more > 0
        else ""
    )
    return "".join(figures) + note


#: Below this mean in-distribution accuracy a cell's runs count as not having learned the task.
LEARNED_IN_DISTRIBUTION = 0.9


def _learning_html(evaluated: pd.DataFrame) -> str:
    """Each cell's in-distribution accuracy, and which cells did not learn the training
    lengths: their scores beyond them say little about the encoding."""
    complete = evaluated[evaluated["status"] == "complete"].reset_index(drop=True)
    if complete.empty:
        return "<p>No complete runs.</p>"
    cells = (
        labelled_runs(complete)
        .groupby(["task_label", "column"], sort=False)["train_accuracy"]
        .agg(["mean", "min", "size"])
        .reset_index()
    )
    rows = "".join(
        f'<tr><td class="text">{escaped(cell.task_label)}</td><td '
        f'class="text">{escaped(cell.column)}</td>'
        f'<td class="num">{100 * cell.mean:.2f}</td><td class="num">{100 * cell.min:.2f}</td>'
        f'<td class="num">{cell.size}</td></tr>'
        for cell in cells.itertuples(index=False)
    )
    unlearned = cells[cells["mean"] < LEARNED_IN_DISTRIBUTION]
    threshold = f"{LEARNED_IN_DISTRIBUTION:.0%}"
    if unlearned.empty:
        verdict = (
            f"Every cell learned the training lengths (mean in-distribution accuracy at "
            f"least {threshold})."
        )
    else:
        names = "; ".join(
            f"{cell.task_label} / {cell.column} ({100 * cell.mean:.1f}%)"
            for cell in unlearned.itertuples(index=False)
        )
        verdict = (
            f"Not learned in this budget (mean in-distribution accuracy below {threshold}): "
            f"{names}. Their scores beyond the training lengths measure no extrapolation of "
            "a learned solution (a recall probe's figure draws the ceiling of a "
            "position-blind model where the task defines one)."
        )
    return (
        f'<p id="learning">{escaped(verdict)}</p>\n<div class="wide"><table id="in-distribution">'
        '<thead><tr><th class="text">task</th><th class="text">column</th>'
        "<th>in-distribution % (mean)</th><th>min</th><th>runs</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></div>"
    )
