"""DeltaProduct's cumulative sequence accuracy by prefix length (``ResultStore.prefix_curves``):
the share of test sequences whose every scored position 0..t is right, against the prefix
length t + 1 (output positions), measured at each evaluation's longest test length. Exported
one row per run and position (``prefix_frame``), plotted one panel per task (``plot_prefix``)
with the trained length marked, as in DeltaProduct's Figure 1."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.reports.labels import labelled_runs
from che_bench.reports.tables import complete_runs
from che_bench.reports.unregistered import task_known
from che_bench.store import ORIGINAL, ResultStore

#: Columns of ``prefix_frame``.
PREFIX_COLUMNS = [
    "task",
    "task_label",
    "column",
    "seed",
    "lr",
    "length",
    "position",
    "accuracy",
    "trained_positions",
    "run_id",
    "evaluation",
]


def prefix_frame(
    store: ResultStore, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL
) -> pd.DataFrame:
    """One row per complete run with a recorded prefix curve and per output position t:
    ``length`` (the test length it was measured at), ``position`` (t), ``accuracy`` (in
    [0, 1]), with the run's task, table label and column (``labelled_runs``) and the output
    positions of its longest training length (``trained_positions``; NaN for a task whose
    plugin is not loaded)."""
    curves = store.prefix_curves(run_ids, evaluation)
    runs = complete_runs(store, run_ids=run_ids, evaluation=evaluation)
    runs = runs[runs["run_id"].isin(set(curves["run_id"]))]
    if runs.empty:
        return pd.DataFrame(columns=PREFIX_COLUMNS)
    labels = labelled_runs(runs)
    labels["trained_positions"] = [_trained_positions(settings) for settings in labels["settings"]]
    identity = ["run_id", "task", "task_label", "column", "seed", "lr", "trained_positions"]
    return curves.merge(labels[identity], on="run_id")[PREFIX_COLUMNS]


def plot_prefix(
    store: ResultStore,
    out: str | Path,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
) -> Path:
    """One panel per task (of ``tasks``; default all): the mean prefix curve of each
    configuration (in %) against the prefix length t + 1, the trained length (in output
    positions) dashed. Writes ``out``."""
    from matplotlib.figure import Figure

    from che_bench.reports.plots import PANEL_SIZE, save_figure

    frame = prefix_frame(store, run_ids, evaluation)
    if tasks is not None:
        frame = frame[frame["task"].isin(set(tasks))]
    if frame.empty:
        raise CheBenchError("no complete runs with a recorded prefix curve to plot")
    panels = list(dict.fromkeys(frame["task_label"]))
    figure = Figure(figsize=(PANEL_SIZE[0] * len(panels), PANEL_SIZE[1]))
    for ax, label in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        panel = frame[frame["task_label"] == label]
        for column, curve in panel.groupby("column", sort=False):
            mean = curve.groupby("position")["accuracy"].mean() * 100
            ax.plot(mean.index + 1, mean.values, label=f"{column} (n={curve['run_id'].nunique()})")
        trained = panel["trained_positions"].max()
        if trained == trained:  # (NaN: the task's plugin is not loaded)
            ax.axvline(trained, color="0.4", linestyle="--", label="training length")
        ax.set_title(label)
        ax.set_xlabel("prefix length t + 1 (output positions)")
        ax.set_ylabel("cumulative sequence accuracy (%)")
        ax.set_ylim(0, 101)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return save_figure(figure, Path(out))


def _trained_positions(settings: dict) -> float:
    """The output positions of a run's longest training length (``reports.run_settings``)."""
    from che_bench.tasks import get_task

    if not task_known(settings["task"]):
        return math.nan
    task = get_task(settings["task"], **settings["task_params"])
    return float(task.output_length(settings["train_max_length"]))
