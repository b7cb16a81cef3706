"""Tables and exports of the result store.

The table mirrors the CHE table of the DAPE papers: one row per task (grouped by level R, DCF,
CS, recall), one column per encoding x DAPE kernel ("Kerple", "DAPE_k3_Kerple", ...) and per
other architecture ("LSTM", ...), cells = the maximum score over seeds and learning rates with
mean +- std and the number of runs, in percent. Only complete runs count. Runs that differ in
anything else (preset, steps, model size, options, ...) get separate, labelled columns.

Scores are token accuracies (the default, as in the paper) or, with ``metric="exact"`` (or
``"sequence"``, its name in the word-problem papers), exact match: the share of sequences whose
every scored position is right (runs evaluated before exact match was recorded are left out),
with ``metric="scaled"`` Grazzi et al.'s scaled accuracy (``reports.scaled``), or with
``metric="pooled"`` the pooled accuracy: correct / scored positions of all test sequences
together (1 - it: flip-flop's read error; runs evaluated before it was recorded are left out).
Scores come from one evaluation of each run: its original one (the default) or a
re-evaluation under another protocol, chosen by protocol id
(see ``che_bench.store.result_store``). Published values are set beside a cell always, but
subtracted only where its runs followed the published protocol (``paper_protocol_differences``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from che_bench.config import TRANSFORMER
from che_bench.errors import CheBenchError
from che_bench.reports import FORMATS, best_of, table_formats, unregistered
from che_bench.reports.chance import run_exact_chance
from che_bench.reports.labels import (
    CHE_BASELINES,
    LEVEL_LABELS,
    PAPER_ENCODING_LABELS,
    architecture_label,
    architecture_order,
    run_architecture,
)
from che_bench.reports.metrics import (
    CHANCE_NOTES,
    METRIC_COLUMNS,
    METRIC_NOTES,
    SEQUENCE_METRICS,
    check_metric,
    with_metric,
)
from che_bench.reports.paper import (
    PAPER_NOTE,
    load_paper_table,
    paper_protocol_text,
    paper_table_or_none,
)
from che_bench.reports.preset_changes import preset_changes
from che_bench.reports.published import COMPARISONS, PUBLISHED, split_evaluations_note
from che_bench.reports.table_formats import PAPER_SUFFIX, cell_text, chance_text, paper_text
from che_bench.store import ORIGINAL, ResultStore, describe_protocol

#: The tables of ``reports.published`` (every comparison but ``paper`` and ``grazzi``).
PUBLISHED_NAMES = {comparison.name for comparison in PUBLISHED}


def summarize(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    compare: str = "none",
    evaluation: str = ORIGINAL,
    metric: str = "token",
    best_over: Sequence[str] = (),
) -> pd.DataFrame:
    """Long table, one row per (task, column): level, chance, max, mean, std, n (percent) of
    the ``metric`` scores of ``evaluation`` (see ``ResultStore.runs``); with ``best_over``
    (option names, ``reports.best_of``) runs differing in those share a column and ``best``
    names each cell's best configuration. With
    ``compare="paper"`` (or another published table, ``reports.published.COMPARISONS``) also
    ``paper``, ``comparable`` (the cell's runs followed the published
    protocol), ``diff`` (max - paper, NaN unless comparable), ``differences`` (a tuple: what
    differs from the published protocol, empty when comparable) and ``dropout_at_eval`` (every
    run kept dropout on at evaluation, as the reference code does)."""
    _check_compare(compare, metric)
    return _summarize_runs(
        complete_runs(store, tasks, run_ids, evaluation, metric), compare, metric, best_over
    )


def _check_compare(compare: str, metric: str = "token") -> None:
    valid = ("none", "paper", *COMPARISONS)
    if compare not in valid:
        raise CheBenchError(f"unknown comparison {compare!r}; valid: {', '.join(valid)}")
    check_metric(metric)
    needed = COMPARISONS[compare].metric if compare in COMPARISONS else metric
    if metric != needed:
        raise CheBenchError(
            f"the {compare} table is set beside {needed} scores: --compare {compare} needs "
            f"--metric {needed}"
        )
    if compare == "paper" and metric != "token":
        raise CheBenchError(
            "the published table holds token accuracies: --compare paper needs --metric token"
        )


def _summarize_runs(
    runs: pd.DataFrame, compare: str, metric: str, best_over: Sequence[str] = ()
) -> pd.DataFrame:
    """``summarize`` of a frame of complete runs, scored in ``metric``."""
    columns = ["level", "task", "column", "chance", "max", "mean", "std", "n"]
    columns += [best_of.BEST] if best_over else []
    if compare != "none":
        columns += ["paper", "diff", "comparable", "differences", "dropout_at_eval"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    runs = best_of.labelled(runs, best_over)
    if compare in COMPARISONS:
        runs = COMPARISONS[compare].with_protocol_differences(runs)
    if metric in SEQUENCE_METRICS:
        runs["chance"] = [run_exact_chance(settings) for settings in runs["settings"]]
    elif metric == "scaled":
        runs["chance"] = 0.0
    runs["score_pct"] = runs["score"] * 100
    runs["kernel_order"] = [-1 if k is None else int(k) for k in runs["kernel"]]
    runs["arch_order"] = [architecture_order(arch) for arch in runs["architecture"]]
    runs["dropout_at_eval"] = [settings["dropout_at_eval"] for settings in runs["settings"]]
    cells = (
        runs.groupby(["level", "task_label", "column"], sort=False)
        .agg(
            task=("task", "first"),
            pe=("pe", "first"),
            encoding=("encoding", "first"),
            kernel_order=("kernel_order", "first"),
            arch_order=("arch_order", "first"),
            chance=("chance", "first"),
            max=("score_pct", "max"),
            mean=("score_pct", "mean"),
            std=("score_pct", "std"),
            n=("score_pct", "size"),
            paper_differences=("paper_differences", _union),
            dropout_at_eval=("dropout_at_eval", "all"),
        )
        .reset_index()
    )
    if best_over:
        cells[best_of.BEST] = best_of.winners(cells, runs, ["level", "task_label", "column"])
    paper = load_paper_table() if compare == "paper" else paper_table_or_none()
    if compare == "paper" and paper is not None:
        cells["paper"] = [
            float(paper.at[task, encoding])
            if task in paper.index and encoding in paper.columns and label == task
            else math.nan
            for task, encoding, label in zip(
                cells["task"], cells["encoding"], cells["task_label"], strict=False
            )
        ]
        cells["comparable"] = [not differences for differences in cells["paper_differences"]]
        cells["diff"] = (cells["max"] - cells["paper"]).where(cells["comparable"])
        cells["differences"] = cells["paper_differences"]
    if compare in COMPARISONS:
        cells = COMPARISONS[compare].add_published(cells, runs)
    cells["chance"] = cells["chance"] * 100
    paper_tasks = list(paper.index) if paper is not None else []
    cells = cells.iloc[_cell_order(cells, paper_tasks)].reset_index(drop=True)
    return cells.drop(columns=["task"]).rename(columns={"task_label": "task"})[columns]


def complete_runs(
    store: ResultStore,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    metric: str = "token",
) -> pd.DataFrame:
    """``store.runs(run_ids, evaluation)`` restricted to complete runs (of ``tasks``), scores
    in ``metric`` (``with_metric``)."""
    runs = store.runs(run_ids, evaluation)
    runs = with_metric(runs[runs["status"] == "complete"], metric)
    if tasks is not None:
        runs = runs[runs["task"].isin(unregistered.task_names(tasks, runs["task"]))]
    return runs.reset_index(drop=True)


def _union(groups: pd.Series) -> tuple:
    """The distinct items of a column of tuples, in order of appearance."""
    return tuple(dict.fromkeys(item for group in groups for item in group))


def _cell_order(cells: pd.DataFrame, paper_tasks: list[str]) -> list[int]:
    """Rows by level (R, DCF, CS, recall), then in the paper's task order; columns by
    architecture (the transformer's first), its plain encodings first, then by kernel, each
    in the paper's encoding order."""
    levels = list(LEVEL_LABELS.values())
    encodings = list(PAPER_ENCODING_LABELS)

    def position(item: str, order: list[str], missing: int) -> int:
        return order.index(item) if item in order else missing

    def key(i: int) -> tuple:
        row = cells.iloc[i]
        return (
            position(row["level"], levels, len(levels)),
            position(row["task"], paper_tasks, len(paper_tasks)),
            row["task_label"],
            row["arch_order"],
            row["kernel_order"],
            position(row["pe"], encodings, -1),
            _natural_key(row["column"]),
        )

    return sorted(range(len(cells)), key=key)


def _natural_key(text: str) -> tuple:
    """``text`` split into words and numbers, numbers compared as such (``steps=6000`` before
    ``steps=12000``)."""
    # (re.split with a group: the words at even places, the numbers at odd ones)
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text)))


def format_table(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    compare: str = "none",
    fmt: str = "text",
    evaluation: str = ORIGINAL,
    metric: str = "token",
    best_over: Sequence[str] = (),
) -> str:
    """The CHE table of the store's complete runs (``metric`` scores of ``evaluation``, cells
    the best over ``best_over`` options too) as text, CSV, Markdown or LaTeX."""
    if fmt not in FORMATS:
        raise CheBenchError(f"unknown table format {fmt!r}; valid: {', '.join(FORMATS)}")
    selection: dict[str, Any] = {
        "tasks": tasks,
        "run_ids": run_ids,
        "compare": compare,
        "evaluation": evaluation,
        "metric": metric,
        "best_over": best_over,
    }
    if fmt == "csv":
        cells = summarize(store, **selection)
        return "" if cells.empty else _numeric_pivot(cells, compare).to_csv(float_format="%.4f")
    table, notes = display_table(store, **selection)
    if table.empty:
        if metric in METRIC_COLUMNS:  # evaluations stored before che-bench recorded it lack it
            return f"(no complete runs with {metric} scores recorded)\n"
        return "(no complete runs)\n"
    if fmt == "text":
        return table_formats.as_text(table, notes)
    if fmt == "markdown":
        return table_formats.as_markdown(table, notes)
    return table_formats.as_latex(table, notes)


def display_table(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    compare: str = "none",
    evaluation: str = ORIGINAL,
    metric: str = "token",
    best_over: Sequence[str] = (),
) -> tuple[pd.DataFrame, list[str]]:
    """The table as display strings (one row per task, indexed by level, task and chance %)
    and its notes; an empty frame when there is no complete run."""
    _check_compare(compare, metric)
    runs = complete_runs(store, tasks, run_ids, evaluation, metric)
    cells = _summarize_runs(runs, compare, metric, best_over)
    if cells.empty:
        return pd.DataFrame(), []
    notes = _notes(runs, cells, compare, evaluation, metric) + best_of.notes(best_over)
    if compare in PUBLISHED_NAMES and evaluation == ORIGINAL:
        notes += split_evaluations_note(store, runs["run_id"])
    return _text_pivot(cells, compare), notes


def _wide(cells: pd.DataFrame, values: dict[str, list]) -> pd.DataFrame:
    """One row per task, columns ``"<column><suffix>"`` for each (suffix, per-cell values)."""
    index = ["level", "task", "chance"]
    table = pd.DataFrame(index=pd.MultiIndex.from_frame(cells[index].drop_duplicates()))
    keyed = cells.assign(**{f"value{suffix}": v for suffix, v in values.items()}).set_index(index)
    for column in dict.fromkeys(cells["column"]):
        part = keyed[keyed["column"] == column]
        for suffix in values:
            table[f"{column}{suffix}"] = part[f"value{suffix}"]
    return table


def _numeric_pivot(cells: pd.DataFrame, compare: str) -> pd.DataFrame:
    stats = ["max", "mean", "std", "n"] + (
        ["paper", "diff", "comparable"] if compare != "none" else []
    )
    stats += [best_of.BEST] if best_of.BEST in cells else []
    table = _wide(cells, {f" {stat}": list(cells[stat]) for stat in stats})
    counts = [column for column in table.columns if column.endswith(" n")]
    return table.astype({column: "Int64" for column in counts})


def _text_pivot(cells: pd.DataFrame, compare: str) -> pd.DataFrame:
    cells = cells.assign(chance=[chance_text(c) for c in cells["chance"]])
    values = {"": [cell_text(row) for _, row in cells.iterrows()]}
    if compare != "none":
        values[PAPER_SUFFIX] = [paper_text(row) for _, row in cells.iterrows()]
    table = _wide(cells, values).fillna("")
    # Drop comparison columns with no published value at all (e.g. encodings not in the paper).
    return table[
        [c for c in table.columns if not (c.endswith(PAPER_SUFFIX) and (table[c] == "").all())]
    ]


def _notes(
    runs: pd.DataFrame, cells: pd.DataFrame, compare: str, evaluation: str, metric: str
) -> list[str]:
    """What the table shows: cells, presets, the evaluation (when not the original one) and
    the comparison with the paper."""
    presets = ", ".join(sorted(set(runs["preset"])))
    notes = [
        f"cells: {METRIC_NOTES[metric]}, max over seeds/learning rates (mean±std over runs, n "
        f"runs); complete runs only; preset(s): {presets}{preset_changes(runs['config'])}; "
        f"{CHANCE_NOTES[metric]}",
    ]
    if metric in METRIC_COLUMNS:
        notes.append(f"{metric}: runs evaluated before it was recorded are left out")
    if evaluation != ORIGINAL:
        summary = describe_protocol(json.loads(runs["protocol"].iloc[0]))
        notes.append(f"scores of evaluation {evaluation} ({summary}); runs without it are left out")
    unknown = unregistered.note(runs)
    if unknown:
        notes.append(unknown)
    if compare in COMPARISONS:
        notes += COMPARISONS[compare].notes(runs)
    if compare == "paper":
        # Only the runs of the paper's tasks: a flip-flop or word-problem table has nothing
        # of DAPE V2's or CHE's to set beside it.
        paper_runs = runs[runs["task"].isin(load_paper_table().index)]
        stored = {run_architecture(json.loads(config)) for config in paper_runs["config"]}
        if TRANSFORMER in stored:
            notes.append(
                f"{PAPER_NOTE}; in brackets: ours (max) minus paper where the runs followed the "
                f"published protocol ({paper_protocol_text()}), otherwise what differs"
            )
        # Only CHE's own baselines have a published table that could not be read.
        baselines = sorted(stored & set(CHE_BASELINES), key=architecture_order)
        if baselines:
            notes.append(
                f"{', '.join(architecture_label(arch) for arch in baselines)}: no published "
                "reference (the CHE paper's table, arXiv 2207.02098, could not be read here)"
            )
        shown = cells[~cells["paper"].isna()]
        if (shown["comparable"] & ~shown["dropout_at_eval"].astype(bool)).any():
            notes.append(
                "compared runs were evaluated with dropout off; the reference code keeps dropout "
                "on at evaluation (--dropout-at-eval)"
            )
    return notes
