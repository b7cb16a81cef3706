"""Runs that learned nothing: their training accuracy ended where a guess blind to the input's
content lands (``history.input_blind_accuracy``), whatever their scores.

The verdict reads the mean accuracy of the last ``STUCK_WINDOWS`` history rows, not one window,
so that a run at chance is not let off by one lucky window, and compares it with the baseline
plus a margin of ``STUCK_STANDARD_ERRORS`` standard errors of a guesser's accuracy over those
windows (at least ``STUCK_MIN_MARGIN``). Both sides count the scored positions only, as the
accuracy does, so in-place tasks (mqar), whose loss and accuracy skip the unscored positions,
are judged like the others.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import pandas as pd

from che_bench.reports import unregistered
from che_bench.store import ResultStore

#: History rows (``log_every`` steps each) whose mean training accuracy is judged.
STUCK_WINDOWS = 3
#: The margin above the baseline, in standard errors of a guesser's pooled accuracy over the
#: judged windows (counting one scored position per sequence, the fewest any task has).
STUCK_STANDARD_ERRORS = 3
#: The smallest margin (an accuracy, 1 point): it covers the baseline's own sampling error.
STUCK_MIN_MARGIN = 0.01
#: What "stuck" means, for the listings.
STUCK_TEXT = (
    f"training accuracy (mean of the last {STUCK_WINDOWS} logged windows) no better "
    "than guessing the most frequent class at each length and output position (scored "
    "positions only) plus a margin for noise, i.e. learned nothing"
)


def stuck_runs(store: ResultStore, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
    """Runs with a training history: ``run_id``, ``final_accuracy`` (mean training accuracy of
    the last ``STUCK_WINDOWS`` rows), ``baseline_accuracy`` (``history.input_blind_accuracy``
    of its task and training lengths; NaN when the task's plugin is not loaded), ``margin`` and
    ``stuck``: the final accuracy is not above baseline + margin (never said without a
    baseline or an accuracy)."""
    history = store.history(run_ids)
    columns = ["run_id", "final_accuracy", "baseline_accuracy", "margin", "stuck"]
    if history.empty:
        return pd.DataFrame(columns=columns)
    configs = store.runs(list(dict.fromkeys(history["run_id"]))).set_index("run_id")["config"]
    rows = []
    for run_id, run_history in history.groupby("run_id", sort=False):
        config = json.loads(configs[run_id])
        final_accuracy, judged_steps = _final_accuracy(run_history)
        baseline = _baseline_accuracy(config)
        margin = _margin(baseline, judged_steps * config["batch_size"])
        rows.append(
            (run_id, final_accuracy, baseline, margin, bool(final_accuracy <= baseline + margin))
        )  # False when either is NaN
    return pd.DataFrame(rows, columns=columns)


def _final_accuracy(history: pd.DataFrame) -> tuple[float, int]:
    """The mean training accuracy of a run's last ``STUCK_WINDOWS`` rows and the training
    steps they cover."""
    judged = history.tail(STUCK_WINDOWS)
    before = history["step"].iloc[-STUCK_WINDOWS - 1] if len(history) > STUCK_WINDOWS else 0
    return float(judged["accuracy"].mean()), int(judged["step"].iloc[-1] - before)


def _margin(baseline: float, sequences: int) -> float:
    """How far above ``baseline`` a guesser's accuracy over ``sequences`` may land by chance."""
    standard_error = math.sqrt(baseline * (1 - baseline) / max(sequences, 1))
    return max(STUCK_MIN_MARGIN, STUCK_STANDARD_ERRORS * standard_error)


def _baseline_accuracy(config: dict[str, Any]) -> float:
    from che_bench.train.history import input_blind_accuracy

    if not unregistered.task_known(config["task"]):
        return math.nan  # the task class that samples its targets is not loaded
    return input_blind_accuracy(
        config["task"],
        json.dumps(config["task_params"], sort_keys=True),
        config["train_max_length"],
    )
