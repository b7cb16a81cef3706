"""Scaled accuracy (``--metric scaled``), the measure of Grazzi et al. (arXiv 2411.12537,
ICLR 2025, Table 3 and App. E.1.2): ``(accuracy - chance) / (1 - chance)`` with chance
= 1 / number of output classes (``task.chance``, with the run's task parameters). 0 is a
uniform guesser, 1 a perfect model; below 0, worse than guessing. It rescales token accuracy
(for the single-answer tasks the same as a sequence's accuracy), a run's score and each
length's accuracy alike (the mean over lengths of a linear map is the map of the mean).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import pandas as pd

from che_bench.reports import unregistered

#: The accuracy columns of ``ResultStore.runs()`` and ``per_length()`` frames it rescales.
ACCURACY_COLUMNS = ("score", "train_accuracy", "accuracy")


def scaled_accuracy(accuracy: float, chance: float) -> float:
    """``(accuracy - chance) / (1 - chance)``."""
    return (accuracy - chance) / (1 - chance)


def config_chance(config: str | dict) -> float:
    """1 / output classes of a stored run's task (its config, JSON or a dict); NaN when the
    task's plugin is not loaded."""
    from che_bench.tasks import get_task

    fields = json.loads(config) if isinstance(config, str) else config
    if not unregistered.task_known(fields["task"]):
        return math.nan
    return float(get_task(fields["task"], **fields["task_params"]).chance)


def with_scaled_accuracy(
    frame: pd.DataFrame, chances: Iterable[float] | None = None
) -> pd.DataFrame:
    """``frame`` (runs or per-length accuracies) with its accuracy columns scaled: by
    ``chances`` (one per row), else its ``chance`` column, else the chance of each row's
    ``config``. Rows whose chance is not known (a plugin's task not loaded) are left out."""
    if chances is not None:
        chance = pd.Series(list(chances), index=frame.index, dtype=float)
    elif "chance" in frame:
        chance = frame["chance"].astype(float)
    else:
        chance = pd.Series([config_chance(c) for c in frame["config"]], index=frame.index)
    frame = frame.assign(
        **{
            column: scaled_accuracy(frame[column].astype(float), chance)
            for column in ACCURACY_COLUMNS
            if column in frame
        }
    )
    return frame[chance.notna().to_numpy()].reset_index(drop=True)
