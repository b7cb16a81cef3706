"""Grazzi et al.'s Table 3 beside che-bench's cells (``table --metric scaled --compare
grazzi``), and how a run's protocol differs from theirs (preset ``state_tracking``).

The published table (arXiv 2411.12537, ICLR 2025 version, Table 3: scaled accuracy, best of
3 seeds, as printed) is shipped inside the package (a copy of results/reference/, which the
tests keep identical). Its rows are an architecture with or without negative eigenvalues
(``--arch-option negative_eigenvalues=true``); its columns, parity and modular arithmetic
without and with brackets, are set beside CHE's ``parity_check``, ``modular_arithmetic`` and
``modular_arithmetic_brackets`` (CHE's generators, not the harness's: the same problems, other
data).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench import protocol
from che_bench.config import TRANSFORMER
from che_bench.reports.paper import read_published_table
from che_bench.settings import BY_NAME, stored_value

#: The comparison's name (``--compare grazzi``) and the metric its table holds.
COMPARISON, METRIC = "grazzi", "scaled"
#: ``METRIC`` under the name every comparison of ``reports.published.COMPARISONS`` gives it.
metric = METRIC
TABLE_RESOURCE = ("data", "grazzi_iclr2025_table3.csv")
TABLE_FILE = Path("results") / "reference" / "grazzi_iclr2025_table3.csv"
#: The che-bench tasks that the table's columns are set beside.
TASKS = ("parity_check", "modular_arithmetic", "modular_arithmetic_brackets")
#: Task parameters that lay a task out as their harness does (docs/protocol.md): the same
#: problem, so such runs go beside the table's column too.
HARNESS_LAYOUT = {"layout": "harness"}
#: The preset that follows their protocol, and the one that follows their harness's pipeline
#: too (mixed batches, bf16, its read-out): a run of either follows the protocol.
PRESET = "state_tracking"
PRESETS = (PRESET, "state_tracking_harness")
#: The option that selects a row's eigenvalue range.
NEGATIVE_EIGENVALUES = "negative_eigenvalues"
#: The settings of their protocol a run must have (the preset's), as cells name a difference.
PROTOCOL_SETTINGS = {
    "steps": "{} steps",
    "batch_size": "batch {}",
    "optimizer": "{}",
    "weight_decay": "weight decay {}",
    "grad_clip_norm": "clipping at {}",
    "lr_schedule": "{} schedule",
    "warmup_steps": "{} warm-up steps",
    "min_lr_ratio": "lr floor {}",
    "train_max_length": "training lengths up to {}",
}
#: Where Grazzi et al.'s own files (their code release's ``xlstm/experiments/*.yaml``) differ
#: from the preset, per task and architecture: a run with these settings follows their
#: protocol too (docs/protocol.md).
_MODULAR = {"steps": 100_000, "warmup_steps": 10_000}  # mod_arithmetic*_{model}.yaml
THEIR_FILES: dict[tuple[str, str], dict[str, Any]] = {
    ("parity_check", "mlstm"): {"warmup_steps": 0},  # parity_xlstm10.yaml
    ("parity_check", "mamba"): {"weight_decay": 0.0},  # parity_mamba{,_2}.yaml
    ("parity_check", "deltanet"): {"weight_decay": 0.0},  # parity_delta_net{,_2}.yaml
    **{
        (task, arch): _MODULAR
        for task in ("modular_arithmetic", "modular_arithmetic_brackets")
        for arch in ("mlstm", "slstm", "mamba", "deltanet")
    },
}
#: The transformer's settings of the preset (their Transformer's are not published).
MODEL_SETTINGS = ("layers", "dim", "heads", "ffn", "dropout")

NOTE = (
    "Grazzi et al. (arXiv 2411.12537, ICLR 2025) Table 3: scaled accuracy, best of 3 seeds, "
    "shown x 100; trained on 3..40 tokens (answer included), tested on 8,192 sequences of "
    "40..256 tokens pooled, with their harness's generators; in brackets: ours (max) "
    "minus theirs where the runs followed preset state_tracking or state_tracking_harness "
    "(or their own file's weight decay, warm-up and steps), otherwise what differs"
)


def load_table() -> pd.DataFrame:
    """The published table (shipped with the package), as printed (fractions)."""
    return read_published_table(TABLE_RESOURCE, COMPARISON)


def published_value(table: pd.DataFrame, task: str, arch: str, negative: bool) -> float:
    """The published scaled accuracy in percent of ``task`` for ``arch`` with or without
    negative eigenvalues; NaN where the table has none."""
    if task not in TASKS:
        return math.nan
    rows = table[(table["arch"] == arch) & (table["negative_eigenvalues"] == negative)]
    return float(rows[task].iloc[0]) * 100 if len(rows) else math.nan


def published_task(settings: dict[str, Any]) -> str | None:
    """The column of the table a run (``run_settings``) goes beside: its task, where that is
    one of ``TASKS`` at its default parameters or laid out as their harness
    (``HARNESS_LAYOUT``) and tested under its own; None otherwise."""
    from che_bench.tasks import get_task

    task = settings["task"]
    if task not in TASKS or settings.get("eval_task_params"):
        return None
    default = get_task(task).params()
    changed = {k: v for k, v in settings["task_params"].items() if default.get(k) != v}
    return task if changed.items() <= HARNESS_LAYOUT.items() else None


def row_key(config: dict[str, Any]) -> tuple[str, bool]:
    """A stored run's (architecture, negative eigenvalues) (false where not given)."""
    options = config.get("arch_options", {})
    return str(config.get("arch", TRANSFORMER)), bool(options.get(NEGATIVE_EIGENVALUES, False))


def protocol_differences(settings: dict[str, Any]) -> list[str]:
    """How a run's settings (``run_settings``) differ from Grazzi et al.'s protocol as the
    ``state_tracking`` preset translates it, or as their own file for the run's task and
    model sets it (``THEIR_FILES``; the fewer differences), most telling first; empty when
    the run followed either. Seeds, learning rates and the number of test sequences may
    differ (they chose a rate from a grid; che-bench's evaluation is per length): the model's
    options (besides the eigenvalue range, which picks the row), the training and the test
    lengths may not."""
    preset = protocol.preset_settings(PRESET)
    differences = [] if settings["preset"] in PRESETS else [f"preset {settings['preset']}"]
    file = THEIR_FILES.get((settings["task"], settings.get("arch", TRANSFORMER)))
    protocols = [preset] if file is None else [preset, {**preset, **file}]
    fewest: list[str] = min((_training_differences(settings, p) for p in protocols), key=len)
    differences += fewest
    if settings.get("arch", TRANSFORMER) == TRANSFORMER:
        model = settings["model_options"]
        differences += [f"{n} {model[n]}" for n in MODEL_SETTINGS if model.get(n) != preset[n]]
    else:
        options = settings.get("arch_options", {})
        differences += [f"{k}={v}" for k, v in sorted(options.items()) if k != NEGATIVE_EIGENVALUES]
    if tuple(settings["test_lengths"]) != protocol.parse_lengths(preset["test_lengths"]):
        differences.append(f"test lengths {protocol.format_lengths(settings['test_lengths'])}")
    if settings["score_from_42"]:
        differences.append("score from 42")
    return differences


def _training_differences(settings: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The ``PROTOCOL_SETTINGS`` in which a run's ``settings`` differ from ``reference``."""
    differences = []
    for name, text in PROTOCOL_SETTINGS.items():
        value = stored_value(settings, BY_NAME[name])
        if value != reference[name]:
            differences.append(text.format(value))
    return differences


def with_protocol_differences(runs: pd.DataFrame) -> pd.DataFrame:
    """Labelled runs (``labelled_runs``) whose ``paper_differences`` are those from Grazzi et
    al.'s protocol, with each run's table row (``grazzi_row``: ``row_key``) and column
    (``grazzi_task``: ``published_task``)."""
    return runs.assign(
        paper_differences=[tuple(protocol_differences(s)) for s in runs["settings"]],
        grazzi_row=[row_key(s) for s in runs["settings"]],
        grazzi_task=[published_task(s) for s in runs["settings"]],
    )


def add_published(cells: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """``cells`` (one per task and column) with ``paper`` (the published value in percent,
    NaN where there is none), ``comparable``, ``diff`` and ``differences``, as ``--compare
    paper`` gives them."""
    table = load_table()
    rows = {
        (label, column): (key, task)
        for label, column, key, task in zip(
            runs["task_label"], runs["column"], runs["grazzi_row"], runs["grazzi_task"], strict=True
        )
    }
    cell_rows = [
        rows[(label, column)]
        for label, column in zip(cells["task_label"], cells["column"], strict=True)
    ]
    published = [
        published_value(table, task, *key) if column_task == task else math.nan
        for task, (key, column_task) in zip(cells["task"], cell_rows, strict=True)
    ]
    cells = cells.assign(paper=published)
    cells["comparable"] = [not differences for differences in cells["paper_differences"]]
    cells["diff"] = (cells["max"] - cells["paper"]).where(cells["comparable"])
    cells["differences"] = cells["paper_differences"]
    return cells


def notes(runs: pd.DataFrame) -> list[str]:
    """The comparison's notes (``runs``: ``ResultStore.runs()`` rows): the source, and which
    runs have no published row."""
    stored = {row_key(json.loads(config)) for config in runs["config"]}
    table = load_table()
    published = set(zip(table["arch"], table["negative_eigenvalues"], strict=True))
    lines = [NOTE]
    if any(arch == TRANSFORMER for arch, _ in stored):
        lines.append(
            "their Transformer's configuration is not published; its row is set beside every "
            "transformer column"
        )
    missing = sorted(
        arch + (" with negative eigenvalues" if negative else "")
        for arch, negative in stored - published
    )
    if missing:
        lines.append(f"no published row for: {', '.join(missing)}")
    return lines
