"""Accuracy-versus-length plots of the result store (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.reports import labelled_runs
from che_bench.store import ResultStore


def plot_accuracy(
    store: ResultStore,
    out: str | Path,
    *,
    tasks: Iterable[str] | None = None,
    run_ids: Iterable[str] | None = None,
) -> Path:
    """One panel per task: accuracy (%) against length, one line per configuration (mean over
    seeds and learning rates), the chance level, for recall tasks the ceiling of a model blind
    to positions (``task.ceiling(n)``), and the training range shaded. Writes ``out`` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from che_bench.tasks import get_task

    out = Path(out)
    runs = store.runs(run_ids)
    runs = runs[runs["status"] == "complete"].reset_index(drop=True)
    if tasks is not None:
        wanted = {get_task(name).name for name in tasks}
        runs = runs[runs["task"].isin(wanted)].reset_index(drop=True)
    if runs.empty:
        raise CheBenchError("no complete runs to plot" + (" for the given task(s)" if tasks else ""))
    runs = labelled_runs(runs)
    curves = store.per_length(runs["run_id"]).merge(
        runs[["run_id", "task_label", "column"]], on="run_id"
    )

    panels = list(dict.fromkeys(runs["task_label"]))
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, panels):
        task_runs = runs[runs["task_label"] == label]
        config = json.loads(task_runs["config"].iloc[0])
        task = get_task(config["task"], **config["task_params"])
        train_max = max(json.loads(c)["train_max_length"] for c in task_runs["config"])
        task_curves = curves[curves["task_label"] == label]
        for column, curve in task_curves.groupby("column", sort=False):
            mean = curve.groupby("length")["accuracy"].mean() * 100
            seeds = curve["run_id"].nunique()
            ax.plot(mean.index, mean.values, marker="." if len(mean) < 60 else None,
                    label=f"{column} (n={seeds})")
        lengths = np.arange(task.min_length, int(task_curves["length"].max()) + 1)
        ax.axvspan(task.min_length, train_max, color="0.9", zorder=0, label="training lengths")
        ax.axhline(task.chance * 100, color="0.4", linestyle=":", label="chance")
        if task.level == "recall":
            ceiling = [task.ceiling(int(n)) for n in lengths]
            if None not in ceiling:
                ax.plot(lengths, [100 * c for c in ceiling], color="0.2", linestyle="--",
                        label="ceiling without positions")
        ax.set_title(label)
        ax.set_xlabel("length n")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 101)
        ax.legend(fontsize="small")
    figure.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=120)
    except OSError as exc:
        raise CheBenchError(f"cannot write plot {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
    return out
