"""Exports of the result store as data frames: one row per run, per length, or per history
row (``che-bench export``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pandas as pd

from che_bench.config import TRANSFORMER
from che_bench.cpu import UNKNOWN
from che_bench.model.option_text import options_text
from che_bench.plugins import describe_plugins
from che_bench.reports.labels import (
    run_architecture,
    run_encoding_label,
    run_parameters,
    run_settings,
    short_value,
)
from che_bench.reports.metrics import check_metric, with_metric
from che_bench.store import ORIGINAL, ResultStore

_EXPORT_KEYS = [
    "task",
    "architecture",
    "pe",
    "kernel",
    "encoding",
    "seed",
    "lr",
    "steps",
    "preset",
]


_EXPORT_PER_LENGTH = [
    *_EXPORT_KEYS,
    "split",
    "length",
    "accuracy",
    "exact_accuracy",
    "correct",
    "scored",
    "pooled_accuracy",
    "run_id",
    "evaluation",
]


_EXPORT_RUNS = [
    *_EXPORT_KEYS,
    "encoding_options",
    "parameters",
    "plugins",
    "score",
    "train_accuracy",
    "exact_score",
    "train_exact_accuracy",
    "pooled_score",
    "train_pooled_accuracy",
    "status",
    "run_id",
    "evaluation",
    "test_lengths",
    "device",
    "eval_device",
    "cpu",
    "cpu_capability",
    "train_s",
    "eval_s",
    "total_s",
    "attempts",
    "created_at",
    "finished_at",
    "error",
]


def export_frame(
    store: ResultStore,
    *,
    per_length: bool = False,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    metric: str = "token",
) -> pd.DataFrame:
    """One row per run (every status; with a protocol id as ``evaluation``, the runs evaluated
    under it) or, with ``per_length``, per complete run, split and length. Scores and
    accuracies (fractions in [0, 1]), test lengths and ``eval_*`` come from ``evaluation``;
    ``train_s``, ``total_s``, ``cpu`` and ``cpu_capability`` ("unknown" where not
    recorded) are the run's, and so are ``encoding_options`` (those not at their defaults,
    ``key=value, ...``), ``parameters`` (one member's, blank where not recorded) and
    ``plugins`` (each with its version and source hash, ``plugins.describe_plugins``). ``pe``
    is blank for an architecture other than the transformer (it has no positional
    encoding). The exact-match columns are always there; with ``metric="exact"`` (or
    ``"sequence"``) or ``"pooled"``, ``score`` / ``train_accuracy`` / ``accuracy`` hold exact
    match or the pooled accuracy too, and only runs that have it are exported
    (``with_metric``); with ``"scaled"``, scaled accuracy (``reports.scaled``)."""
    check_metric(metric)
    runs = store.runs(run_ids, evaluation)
    if metric != "token":
        runs = with_metric(runs, metric)
    if runs.empty:
        return pd.DataFrame(columns=_EXPORT_PER_LENGTH if per_length else _EXPORT_RUNS)
    runs["encoding"] = [run_encoding_label(config) for config in runs["config"]]
    runs["architecture"] = [run_architecture(json.loads(config)) for config in runs["config"]]
    # An architecture without a positional encoding has no pe: blank, not "none" (NoPE's name).
    runs["pe"] = runs["pe"].where(runs["architecture"] == TRANSFORMER, None)
    if per_length:
        # (each run's config gives the chance a scaled metric needs)
        curves = store.per_length(run_ids, evaluation).merge(
            runs[["run_id", "config"]], on="run_id"
        )
        curves = with_metric(curves, metric)
        labels = runs[["run_id", "architecture", "encoding", "pe"]]
        return curves.drop(columns=["pe"]).merge(labels, on="run_id")[_EXPORT_PER_LENGTH]
    _add_model_columns(store, runs)
    run_timings = [_json_or_empty(text) for text in runs["timings"]]
    runs["train_s"] = [timing.get("train_s") for timing in run_timings]
    runs["total_s"] = [timing.get("total_s") for timing in run_timings]
    run_versions = [_json_or_empty(text) for text in runs["versions"]]
    for key in ("cpu", "cpu_capability"):  # "unknown" for runs stored before they were recorded
        runs[key] = [recorded.get(key, UNKNOWN) for recorded in run_versions]
    runs["eval_s"] = [_json_or_empty(text).get("eval_s") for text in runs["eval_timings"]]
    runs["test_lengths"] = [
        short_value(run_settings(config, protocol)["test_lengths"])
        for config, protocol in zip(runs["config"], runs["protocol"], strict=False)
    ]
    return runs[_EXPORT_RUNS]


def _add_model_columns(store: ResultStore, runs: pd.DataFrame) -> None:
    """``encoding_options``, ``parameters`` and ``plugins`` of ``export_frame``'s runs."""
    runs["encoding_options"] = [
        options_text(json.loads(config).get("pe_options") or {}) for config in runs["config"]
    ]
    details = store.run_details(runs["run_id"])
    runs["parameters"] = pd.array(
        [run_parameters(details[run_id]) for run_id in runs["run_id"]], dtype="Int64"
    )
    used = store.run_plugins(runs["run_id"])
    runs["plugins"] = [describe_plugins(used[run_id]) for run_id in runs["run_id"]]


_EXPORT_CURVES = [
    "task",
    "encoding",
    "seed",
    "lr",
    "steps",
    "preset",
    "status",
    "step",
    "loss",
    "accuracy",
    "grad_norm",
    "elapsed_s",
    "run_id",
]


def curves_frame(store: ResultStore, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
    """The training histories (``ResultStore.history``) of every run or of ``run_ids``, one row
    per run and logged step, with the run's task, encoding, seed, steps, preset and status."""
    runs = store.runs(run_ids)
    runs["encoding"] = [run_encoding_label(config) for config in runs["config"]]
    identity = runs[["run_id", "task", "encoding", "seed", "steps", "preset", "status"]]
    return identity.merge(store.history(run_ids), on="run_id")[_EXPORT_CURVES]


def _json_or_empty(text: str | None) -> dict[str, Any]:
    """A stored JSON object, or {} where none is stored (NULL)."""
    return json.loads(text) if isinstance(text, str) else {}
