"""Tables and exports of the result store.

The table mirrors the CHE table of the DAPE papers: one row per task (grouped by level R, DCF,
CS, recall), one column per encoding x DAPE kernel ("Kerple", "DAPE_k1_Kerple",
"DAPE_k3_Kerple", ...), cells = the maximum score over seeds and learning rates (the published
protocol) with mean +- std and the number of runs, in percent. Only complete runs count. Runs
that differ in anything else (preset, steps, model size, encoding options, ...) get separate
columns, labelled with the settings that differ.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.store import ResultStore

LEVEL_LABELS = {"regular": "R", "dcf": "DCF", "cs": "CS", "recall": "recall"}
#: Display names of the encodings in the published table (others keep their canonical name).
PAPER_ENCODING_LABELS = {
    "rope": "RoPE",
    "relative": "Relative",
    "alibi": "ALiBi",
    "kerple": "Kerple",
    "fire": "FIRE",
}
PAPER_TABLE_FILE = Path("results") / "reference" / "dape_v2_table6.csv"
PAPER_NOTE = (
    "paper: DAPE V2 (arXiv 2410.04798) Table 6: 200k steps, trained on lengths 1..40, "
    "score = mean accuracy over 41..500, max over runs"
)
#: Config fields that identify a cell's row and column, or vary within a cell (seeds, lrs).
_CELL_FIELDS = {"task", "task_params", "pe", "kernel", "seed", "data_seed", "lr",
                "train_eval_lengths"}
FORMATS = ("text", "csv", "markdown", "latex")


def encoding_label(pe: str, kernel: int | None) -> str:
    """Column name as in the paper: ``Kerple``, ``DAPE_k1_Kerple``, ``DAPE_k3_Kerple``."""
    base = PAPER_ENCODING_LABELS.get(pe, pe)
    return base if kernel is None else f"DAPE_k{kernel}_{base}"


@cache
def _task_facts(name: str) -> tuple[str, float, str]:
    """(level label, chance, JSON of the default parameters) of a task."""
    from che_bench.tasks import get_task

    task = get_task(name)
    return LEVEL_LABELS.get(task.level, task.level), task.chance, json.dumps(task.params(), sort_keys=True)


def labelled_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``level``, ``chance``, ``task_label``, ``encoding`` (paper-style label) and
    ``column`` to a ``ResultStore.runs()`` frame. ``column`` is the encoding label plus, when
    runs of that encoding differ in other settings (preset, steps, options...), those settings,
    so that different protocols never share a cell."""
    frame = frame.copy()
    configs = [json.loads(text) for text in frame["config"]]
    facts = [_task_facts(config["task"]) for config in configs]
    frame["level"] = [level for level, _, _ in facts]
    frame["chance"] = [chance for _, chance, _ in facts]
    frame["task_label"] = [
        _task_label(config["task"], config["task_params"], defaults)
        for config, (_, _, defaults) in zip(configs, facts)
    ]
    frame["encoding"] = [encoding_label(c["pe"], c["kernel"]) for c in configs]
    variants = [
        {key: json.dumps(value, sort_keys=True) for key, value in config.items() if key not in _CELL_FIELDS}
        for config in configs
    ]
    varying: dict[str, list[str]] = {}
    for encoding in set(frame["encoding"]):
        group = [v for v, e in zip(variants, frame["encoding"]) if e == encoding]
        keys = set().union(*group)
        varying[encoding] = sorted(k for k in keys if len({v.get(k) for v in group}) > 1)
    frame["column"] = [
        encoding + _settings_suffix(config, varying[encoding])
        for encoding, config in zip(frame["encoding"], configs)
    ]
    return frame


def _task_label(task: str, params: dict[str, Any], default_params_json: str) -> str:
    if json.dumps(params, sort_keys=True) == default_params_json:
        return task
    return f"{task}({', '.join(f'{k}={v}' for k, v in sorted(params.items()))})"


def _settings_suffix(config: dict[str, Any], keys: list[str]) -> str:
    if not keys:
        return ""
    return " [" + ", ".join(f"{key}={_short(config.get(key))}" for key in keys) + "]"


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 3 and all(isinstance(v, int) for v in value):
        from che_bench.protocol import format_lengths

        return format_lengths(value)
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def load_paper_table() -> pd.DataFrame:
    """The published table, indexed by task id, values in percent."""
    candidates = [Path(__file__).resolve().parent.parent / PAPER_TABLE_FILE, PAPER_TABLE_FILE]
    for path in candidates:
        if path.is_file():
            return pd.read_csv(path).set_index("task_id")
    raise CheBenchError(f"published table {PAPER_TABLE_FILE} not found (needed for --compare paper)")


def summarize(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    compare: str = "none",
) -> pd.DataFrame:
    """Long table, one row per (task, column): level, chance, max, mean, std, n (percent);
    with ``compare="paper"`` also ``paper`` and ``diff`` (max - paper)."""
    if compare not in ("none", "paper"):
        raise CheBenchError(f"unknown comparison {compare!r}; valid: none, paper")
    runs = store.runs(run_ids)
    runs = runs[runs["status"] == "complete"]
    if tasks is not None:
        wanted = _canonical_tasks(tasks)
        runs = runs[runs["task"].isin(wanted)]
    columns = ["level", "task", "column", "chance", "max", "mean", "std", "n"]
    if compare == "paper":
        columns += ["paper", "diff"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    runs = labelled_runs(runs.reset_index(drop=True))
    runs["score_pct"] = runs["score"] * 100
    runs["kernel_order"] = [-1 if k is None else int(k) for k in runs["kernel"]]
    cells = (
        runs.groupby(["level", "task_label", "column"], sort=False)
        .agg(
            task=("task", "first"),
            pe=("pe", "first"),
            encoding=("encoding", "first"),
            kernel_order=("kernel_order", "first"),
            chance=("chance", "first"),
            max=("score_pct", "max"),
            mean=("score_pct", "mean"),
            std=("score_pct", "std"),
            n=("score_pct", "size"),
        )
        .reset_index()
    )
    paper = load_paper_table() if compare == "paper" else paper_table_or_none()
    if compare == "paper":
        cells["paper"] = [
            float(paper.at[task, encoding])
            if task in paper.index and encoding in paper.columns and label == task
            else math.nan
            for task, encoding, label in zip(cells["task"], cells["encoding"], cells["task_label"])
        ]
        cells["diff"] = cells["max"] - cells["paper"]
    cells["chance"] = cells["chance"] * 100
    paper_tasks = list(paper.index) if paper is not None else []
    cells = cells.iloc[_cell_order(cells, paper_tasks)].reset_index(drop=True)
    return cells.drop(columns=["task"]).rename(columns={"task_label": "task"})[columns]


def _canonical_tasks(tasks: Iterable[str]) -> set[str]:
    from che_bench.tasks import get_task

    return {get_task(name).name for name in tasks}


def paper_table_or_none() -> pd.DataFrame | None:
    """The published table, or None when its file is not available."""
    try:
        return load_paper_table()
    except CheBenchError:
        return None


def _cell_order(cells: pd.DataFrame, paper_tasks: list[str]) -> list[int]:
    """Rows by level (R, DCF, CS, recall), then in the paper's task order; columns plain
    encodings first, then by kernel, each in the paper's encoding order."""
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
            row["kernel_order"],
            position(row["pe"], encodings, -1),
            row["column"],
        )

    return sorted(range(len(cells)), key=key)


def format_table(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    compare: str = "none",
    fmt: str = "text",
) -> str:
    """The CHE table of the store's complete runs as text, CSV, Markdown or LaTeX."""
    if fmt not in FORMATS:
        raise CheBenchError(f"unknown table format {fmt!r}; valid: {', '.join(FORMATS)}")
    cells = summarize(store, tasks=tasks, run_ids=run_ids, compare=compare)
    if cells.empty:
        return "" if fmt == "csv" else "(no complete runs)\n"
    if fmt == "csv":
        return _numeric_pivot(cells, compare).to_csv(float_format="%.4f")
    table = _text_pivot(cells, compare)
    notes = _notes(store, run_ids, cells, compare)
    if fmt == "text":
        return table.to_string() + "\n\n" + "\n".join(notes) + "\n"
    if fmt == "markdown":
        return _markdown(table) + "\n" + "".join(f"\n{note}  " for note in notes).rstrip() + "\n"
    return _latex(table, notes)


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
    stats = ["max", "mean", "std", "n"] + (["paper", "diff"] if compare == "paper" else [])
    table = _wide(cells, {f" {stat}": list(cells[stat]) for stat in stats})
    counts = [column for column in table.columns if column.endswith(" n")]
    return table.astype({column: "Int64" for column in counts})


def _text_pivot(cells: pd.DataFrame, compare: str) -> pd.DataFrame:
    cells = cells.assign(chance=[f"{c:.0f}" for c in cells["chance"]])
    values = {"": [_cell_text(row) for _, row in cells.iterrows()]}
    if compare == "paper":
        values[" paper (diff)"] = [
            "" if math.isnan(row["paper"]) else f"{row['paper']:.2f} ({row['diff']:+.2f})"
            for _, row in cells.iterrows()
        ]
    table = _wide(cells, values).fillna("")
    # Drop comparison columns with no published value at all (e.g. encodings not in the paper).
    return table[[c for c in table.columns if not (c.endswith(" paper (diff)") and (table[c] == "").all())]]


def _cell_text(row: pd.Series) -> str:
    if row["n"] == 1:
        return f"{row['max']:.2f} (n=1)"
    return f"{row['max']:.2f} ({row['mean']:.2f}±{row['std']:.2f}, n={row['n']})"


def _notes(store: ResultStore, run_ids, cells: pd.DataFrame, compare: str) -> list[str]:
    runs = store.runs(run_ids)
    runs = runs[runs["status"] == "complete"]
    presets = ", ".join(sorted(set(runs["preset"])))
    notes = [
        "cells: accuracy % = max over seeds/learning rates (mean±std over runs, n runs); "
        f"complete runs only; preset(s): {presets}",
    ]
    if compare == "paper":
        notes.append(PAPER_NOTE + "; in brackets: ours (max) minus paper")
    return notes


def _markdown(table: pd.DataFrame) -> str:
    frame = table.reset_index()
    header = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _latex(table: pd.DataFrame, notes: list[str]) -> str:
    frame = table.reset_index()

    def escape(value: object) -> str:
        text = str(value)
        for char, replacement in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"),
                                  ("_", r"\_"), ("#", r"\#"), ("±", r"$\pm$")):
            text = text.replace(char, replacement)
        return text

    lines = [f"% {note}" for note in notes]
    lines.append(r"\begin{tabular}{" + "ll" + "r" * (len(frame.columns) - 2) + "}")
    lines.append(r"\hline")
    lines.append(" & ".join(escape(c) for c in frame.columns) + r" \\")
    lines.append(r"\hline")
    lines += [" & ".join(escape(v) for v in row) + r" \\" for row in frame.itertuples(index=False)]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def export_frame(store: ResultStore, *, per_length: bool = False) -> pd.DataFrame:
    """One row per run (every status) or, with ``per_length``, per complete run, split and
    length. Scores and accuracies are fractions in [0, 1]."""
    runs = store.runs()
    if runs.empty:
        columns = ["task", "pe", "kernel", "encoding", "seed", "lr", "steps", "preset"]
        return pd.DataFrame(columns=columns + (["split", "length", "accuracy", "run_id"] if per_length
                                               else ["score", "train_accuracy", "status", "run_id"]))
    runs = runs.copy()
    runs["encoding"] = [encoding_label(pe, k) for pe, k in zip(runs["pe"], runs["kernel"])]
    if per_length:
        curves = store.per_length().merge(runs[["run_id", "encoding"]], on="run_id")
        return curves[["task", "pe", "kernel", "encoding", "seed", "lr", "steps", "preset",
                       "split", "length", "accuracy", "run_id"]]
    timings = [json.loads(text) if isinstance(text, str) else {} for text in runs["timings"]]
    for name in ("train_s", "eval_s", "total_s"):
        runs[name] = [timing.get(name) for timing in timings]
    runs["test_lengths"] = [
        _short(json.loads(config)["test_lengths"]) for config in runs["config"]
    ]
    return runs[["task", "pe", "kernel", "encoding", "seed", "lr", "steps", "preset", "score",
                 "train_accuracy", "status", "run_id", "test_lengths", "device", "train_s",
                 "eval_s", "total_s", "attempts", "created_at", "finished_at", "error"]]
