"""Merrill, Petty & Sabharwal's report ("The Illusion of State", ICML 2024, Fig. 3): the
minimum number of layers whose sequence accuracy (exact match) reaches 90% at each length k,
over runs that differ in their number of layers (a sweep of depths) and in k.

Runs are grouped by task and configuration with the depth and the lengths set aside (the
transformer's ``layers``, another architecture's ``layers`` option, 1 where it has none;
``train_max_length``, its curriculum options and the evaluation's lengths); k is the longest
test length of the evaluation shown (the ``merrill`` preset trains on lengths up to k and
tests at k). A depth reaches the threshold when its best run (over seeds and learning rates,
as the CHE table's cells) does; a cell holds the smallest such depth, or ``>D`` when none of
the depths tried (at most D) does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pandas as pd

from che_bench.reports.labels import labelled_runs
from che_bench.reports.table_formats import as_text
from che_bench.reports.tables import complete_runs
from che_bench.store import ORIGINAL, ResultStore

#: Merrill et al.'s threshold of full-sequence accuracy.
THRESHOLD = 0.9
#: Config and protocol fields set aside when grouping (the table's axes), with the one value
#: they all take then.
_LENGTH_FIELDS = {
    "train_max_length": 1,
    "curriculum_options": {},
    "test_lengths": [1],
    "train_eval_lengths": [1],
}


def min_depth_cells(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    threshold: float = THRESHOLD,
) -> pd.DataFrame:
    """One row per task, configuration and k: ``task``, ``column``, ``k``, ``depths`` (those
    tried, sorted), ``best`` (each depth's best sequence accuracy) and ``min_depth`` (None
    when no depth reaches ``threshold``)."""
    runs = complete_runs(store, tasks, run_ids, evaluation, metric="exact")
    columns = ["task", "column", "k", "depths", "best", "min_depth"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    axes = [
        _depth_and_k(config, protocol)
        for config, protocol in zip(runs["config"], runs["protocol"], strict=True)
    ]
    neutral = runs.assign(
        config=[_set_aside(json.loads(config), protocol=False) for config in runs["config"]],
        protocol=[_set_aside(json.loads(text), protocol=True) for text in runs["protocol"]],
    )
    labelled = labelled_runs(neutral).assign(
        depth=[depth for depth, _ in axes], k=[k for _, k in axes]
    )
    rows = []
    for (task, column, k), group in labelled.groupby(["task_label", "column", "k"], sort=False):
        best = group.groupby("depth")["score"].max().sort_index()
        reached = [int(depth) for depth, score in best.items() if score >= threshold]
        rows.append(
            [
                task,
                column,
                int(k),
                [int(d) for d in best.index],
                best.tolist(),
                min(reached, default=None),
            ]
        )
    return pd.DataFrame(rows, columns=columns, dtype=object)


def format_min_depth(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    threshold: float = THRESHOLD,
) -> str:
    """``min_depth_cells`` as a text table: one row per task and configuration, one column
    per k."""
    cells = min_depth_cells(
        store, tasks=tasks, run_ids=run_ids, evaluation=evaluation, threshold=threshold
    )
    if cells.empty:
        return "(no complete runs with sequence accuracy recorded)\n"
    cells["text"] = [
        str(depth) if depth is not None else f">{max(depths)}"
        for depth, depths in zip(cells["min_depth"], cells["depths"], strict=True)
    ]
    table = cells.pivot_table(
        index=["task", "column"], columns="k", values="text", aggfunc="first", sort=False
    ).fillna("")
    table.columns = [f"k={k}" for k in table.columns]
    tried = sorted({depth for depths in cells["depths"] for depth in depths})
    notes = [
        f"cells: the fewest layers whose best run (over seeds and learning rates) reaches "
        f"{threshold:.0%} sequence accuracy (exact match) at test length k; >D: none of the "
        f"depths tried does (depths in the store: {', '.join(map(str, tried))})"
    ]
    return as_text(table, notes)


def _depth_and_k(config_json: str, protocol_json: Any) -> tuple[int, int]:
    """A run's number of layers and the longest test length of the evaluation shown."""
    from che_bench.model.architectures import get_architecture
    from che_bench.reports.labels import run_settings

    settings = run_settings(config_json, protocol_json)
    if settings.get("arch", "transformer") == "transformer":
        depth = settings["model_options"]["layers"]
    else:
        defaults = get_architecture(settings["arch"]).defaults
        depth = settings.get("arch_options", {}).get("layers", defaults.get("layers", 1))
    return int(depth), max(settings["test_lengths"])


def _set_aside(fields: dict[str, Any], *, protocol: bool) -> str:
    """A config or protocol (JSON) without its depth and lengths, so that runs differing only
    in those share a column."""
    fields = {key: _LENGTH_FIELDS.get(key, value) for key, value in fields.items()}
    if not protocol:
        fields["model_options"] = {
            k: v for k, v in fields.get("model_options", {}).items() if k != "layers"
        }
        fields["arch_options"] = {
            k: v for k, v in fields.get("arch_options", {}).items() if k != "layers"
        }
    return json.dumps(fields)
