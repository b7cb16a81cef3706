"""Plots of the result store (matplotlib, without pyplot's global state).

Accuracy against length: ``plot_accuracy`` writes one image with a panel per task;
``task_panel_png`` renders one task's panel to PNG bytes (for the HTML report). Both draw the
panel with ``_draw_panel``. Training curves (loss and training accuracy against step, runs
overlaid): ``plot_curves`` writes them, ``curves_png`` renders them for the report.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.reports.chance import exact_match_chance
from che_bench.reports.export import curves_frame
from che_bench.reports.labels import labelled_runs
from che_bench.reports.tables import (
    METRIC_COLUMNS,
    SEQUENCE_METRICS,
    complete_runs,
    with_metric,
)
from che_bench.reports.unregistered import task_known
from che_bench.store import ORIGINAL, ResultStore
from che_bench.tasks import Task, get_task

PANEL_SIZE = (6, 4)  # inches
#: The most configurations a panel's legend lists inside its axes (``_place_legend``).
LEGEND_INSIDE_MAX = 4


def plot_data(
    store: ResultStore,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    metric: str = "token",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The labelled complete runs (``labelled_runs``) and their per-length ``metric`` curves
    under ``evaluation``, with each run's ``task_label`` and ``column``; a CheBenchError when
    there is no complete run to plot."""
    runs = complete_runs(store, tasks, run_ids, evaluation, metric)
    if runs.empty:
        raise CheBenchError(
            "no complete runs to plot"
            + (" for the given task(s)" if tasks else "")
            + (f" with {metric} recorded" if metric in METRIC_COLUMNS else "")
        )
    runs = labelled_runs(runs)
    per_length = store.per_length(runs["run_id"], evaluation).merge(
        runs[["run_id", "task_label", "column", "chance"]], on="run_id"
    )  # (the chance scales a scaled metric's curves)
    curves = with_metric(per_length, metric)
    curves.attrs["metric"] = metric
    return runs, curves


def task_labels(runs: pd.DataFrame) -> list[str]:
    """The panels of ``plot_data``'s runs, in order of appearance."""
    return list(dict.fromkeys(runs["task_label"]))


def plot_accuracy(
    store: ResultStore,
    out: str | Path,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
    evaluation: str = ORIGINAL,
    metric: str = "token",
) -> Path:
    """One panel per task (see ``_draw_panel``), three to a row. Writes ``out`` and returns its
    path."""
    from matplotlib.figure import Figure

    out = Path(out)
    runs, curves = plot_data(
        store, tasks=tasks, run_ids=run_ids, evaluation=evaluation, metric=metric
    )
    panels = task_labels(runs)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, runs, curves, label)
    if evaluation != ORIGINAL:
        figure.suptitle(f"evaluation {evaluation}")
    figure.tight_layout()
    return save_figure(figure, out)


def save_figure(figure, out: Path) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=120)
    except OSError as exc:
        raise CheBenchError(f"cannot write plot {out}: {exc.strerror or exc}") from None
    return out


def task_panel_png(
    runs: pd.DataFrame, curves: pd.DataFrame, label: str, *, dpi: int = 100
) -> bytes:
    """The panel of task ``label`` (from ``plot_data``) as PNG bytes; nothing is written."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=PANEL_SIZE)
    _draw_panel(figure.subplots(), runs, curves, label)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _draw_panel(ax, runs: pd.DataFrame, curves: pd.DataFrame, label: str) -> None:
    """Accuracy (%) against length for one task: one line per configuration (mean over seeds and
    learning rates; a line hidden under a later one says so in the legend), the training range
    shaded and the task's guides (``_draw_task_guides``)."""
    task_runs = runs[runs["task_label"] == label]
    task_curves = curves[curves["task_label"] == label]
    groups = task_curves.groupby("column", sort=False)
    means = {column: curve.groupby("length")["accuracy"].mean() * 100 for column, curve in groups}
    for column, curve in groups:
        mean = means[column]
        seeds = curve["run_id"].nunique()
        ax.plot(
            mean.index,
            mean.values,
            marker="." if len(mean) < 60 else None,
            label=f"{column} (n={seeds}{hidden_under(column, means)})",
        )
    settings = task_runs["settings"].iloc[0]
    task = (
        get_task(settings["task"], **settings["task_params"])
        if task_known(settings["task"])
        else None
    )
    train_max = max(s["train_max_length"] for s in task_runs["settings"])
    # Without the task class (its plugin not loaded), the shortest length it trained on.
    min_length = (
        task.min_length
        if task
        else min(min(s["train_eval_lengths"]) for s in task_runs["settings"])
    )
    ax.axvspan(min_length, train_max, color="0.9", zorder=0, label="training lengths")
    if task is not None:
        _draw_task_guides(
            ax, task, int(task_curves["length"].max()), curves.attrs.get("metric", "token")
        )
    ax.set_title(label)
    ax.set_xlabel(task.length_label if task else "length")
    metric = curves.attrs.get("metric", "token")
    ax.set_ylabel(
        {
            "exact": "exact match (%)",
            "sequence": "sequence accuracy (%)",
            "scaled": "scaled accuracy (%)",
            "pooled": "pooled accuracy (%)",
        }.get(metric, "accuracy (%)")
    )
    # Scaled accuracy falls below 0 where a model does worse than chance.
    ax.set_ylim(min(0, 100 * task_curves["accuracy"].min()) - 1 if metric == "scaled" else 0, 101)
    _place_legend(ax, task_curves["column"].nunique())


def hidden_under(column: str, means: dict[str, pd.Series]) -> str:
    """``; under X`` when the line of ``column`` is drawn over by that of a later column X
    (``means``: each column's curve, in drawing order) with the same values at the same
    lengths, so that it cannot be seen; else nothing."""
    later = list(means)[list(means).index(column) + 1 :]
    covering = [other for other in later if means[other].equals(means[column])]
    return f"; under {covering[-1]}" if covering else ""


def _place_legend(ax, configurations: int) -> None:
    """Matplotlib's best spot inside the axes for a few configurations; below the axes, in
    two columns, for more, where any spot inside covers curves (seven architectures)."""
    if configurations <= LEGEND_INSIDE_MAX:
        ax.legend(fontsize="small")
        return
    from matplotlib.transforms import ScaledTranslation

    # Under the tick labels and the x-axis label, at a fixed distance in inches: an anchor in
    # axes fractions moved up into the label when the layout shrank the axes.
    figure = ax.get_figure()
    below = ax.get_window_extent().y0 - ax.xaxis.get_tightbbox().y0  # pixels
    offset = ScaledTranslation(0, -(below + 4) / figure.dpi, figure.dpi_scale_trans)
    ax.legend(
        fontsize="small",
        loc="upper center",
        bbox_to_anchor=(0.5, 0),
        bbox_transform=ax.transAxes + offset,
        ncols=2,
        frameon=False,
    )


def _draw_task_guides(ax, task: Task, max_length: int, metric: str) -> None:
    """The chance level and, for recall tasks, the ceiling of a model blind to positions
    (``task.ceiling(n)``, where the task defines one). For exact match the chance is that of a
    sequence at each length (``chance.exact_match_chance``) and the ceiling, a token accuracy,
    is left out. Scaled accuracy puts chance at 0 (no ceiling either)."""
    lengths = np.arange(task.min_length, max_length + 1)
    if metric == "scaled":
        ax.axhline(0, color="0.4", linestyle=":", label="chance")
        return
    if metric in SEQUENCE_METRICS:
        ax.plot(
            lengths,
            [100 * exact_match_chance(task, int(n)) for n in lengths],
            color="0.4",
            linestyle=":",
            label="chance",
        )
        return
    ax.axhline(task.chance * 100, color="0.4", linestyle=":", label="chance")
    if task.level == "recall":
        ceiling = [task.ceiling(int(n)) for n in lengths]
        if None not in ceiling:
            ax.plot(
                lengths,
                [100 * c for c in ceiling if c is not None],
                color="0.2",
                linestyle="--",
                label="ceiling without positions",
            )


def run_labels(curves: pd.DataFrame) -> dict[str, str]:
    """A legend label per run of a ``curves_frame``: ``task / encoding, seed S, lr L``, cut
    down to what differs between the runs shown (plus the run id when that is all)."""
    runs = curves.drop_duplicates("run_id")
    parts = {"task": "{}", "encoding": "{}", "seed": "seed {}", "lr": "lr {:g}"}
    varying = [name for name in parts if runs[name].nunique() > 1] or ["task", "encoding"]
    return {
        run.run_id: ", ".join(parts[name].format(getattr(run, name)) for name in varying)
        + ("" if runs[varying].duplicated().sum() == 0 else f" ({run.run_id})")
        for run in runs.itertuples(index=False)
    }


def _draw_curves(loss_ax, accuracy_ax, curves: pd.DataFrame) -> None:
    """Loss and training accuracy (%) against step, one line per run."""
    labels = run_labels(curves)
    for run_id, run in curves.groupby("run_id", sort=False):
        loss_ax.plot(run["step"], run["loss"], label=labels[run_id])
        accuracy_ax.plot(run["step"], 100 * run["accuracy"], label=labels[run_id])
    loss_ax.set_ylabel("training loss")
    accuracy_ax.set_ylabel("training accuracy (%)")
    accuracy_ax.set_ylim(0, 101)
    for ax in (loss_ax, accuracy_ax):
        ax.set_xlabel("step")
    accuracy_ax.legend(fontsize="small")


def plot_curves(store: ResultStore, run_ids: Iterable[str], out: str | Path) -> Path:
    """Loss and training accuracy against step of ``run_ids``, overlaid (e.g. the seeds of one
    cell). Writes ``out``; a CheBenchError when a run is unknown or none has a history."""
    from matplotlib.figure import Figure

    run_ids = list(dict.fromkeys(run_ids))
    known = set(store.runs(run_ids)["run_id"])
    unknown = [run_id for run_id in run_ids if run_id not in known]
    if unknown:
        raise CheBenchError(f"no run {', '.join(unknown)} in {store.path} (see `che-bench runs`)")
    curves = curves_frame(store, run_ids)
    if curves.empty:
        raise CheBenchError(
            "no training history for these runs (runs made before che-bench "
            "kept histories have none)"
        )
    figure = Figure(figsize=(2 * PANEL_SIZE[0], PANEL_SIZE[1]))
    loss_ax, accuracy_ax = figure.subplots(1, 2)
    _draw_curves(loss_ax, accuracy_ax, curves)
    figure.tight_layout()
    return save_figure(figure, Path(out))


def curves_png(curves: pd.DataFrame, title: str, *, dpi: int = 100) -> bytes:
    """The training curves of a ``curves_frame`` selection as PNG bytes; nothing is written."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2 * PANEL_SIZE[0], PANEL_SIZE[1] * 0.8))
    loss_ax, accuracy_ax = figure.subplots(1, 2)
    _draw_curves(loss_ax, accuracy_ax, curves)
    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
