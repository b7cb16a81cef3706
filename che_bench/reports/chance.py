"""What a uniform guesser scores, per metric.

Token accuracy: ``task.chance`` (1 / number of classes) at every position. Exact match: a
sequence counts only when all of its L scored positions are right, which a uniform guesser
manages with probability c^L (c = ``task.chance``); averaged over the sequences that have a
scored position (as exact match counts them) at a length, and over the score's test lengths
for a run's score. L is read from the masks of sampled sequences, so tasks whose number of
scored positions varies between sequences (e.g. ``binary_addition``) are covered.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import numpy as np

from che_bench import protocol
from che_bench.reports import unregistered

#: Sequences sampled per length to count their scored positions (numpy seed 0).
EXACT_CHANCE_SEQUENCES = 32


def exact_match_chance(task: Any, length: int) -> float:
    """A uniform guesser's exact match at ``length`` of ``task`` (a ``Task``)."""
    return _exact_match_chance(task.name, json.dumps(task.params(), sort_keys=True), length)


@functools.lru_cache(maxsize=4096)
def _exact_match_chance(task_name: str, task_params_json: str, length: int) -> float:
    from che_bench.tasks import get_task

    task = get_task(task_name, **json.loads(task_params_json))
    scored = task.sample(length, EXACT_CHANCE_SEQUENCES, np.random.default_rng(0)).mask.sum(1)
    scored = scored[scored > 0]
    return float(np.mean(task.chance**scored)) if scored.size else math.nan


def run_exact_chance(settings: dict[str, Any]) -> float:
    """A uniform guesser's exact-match score under a run's settings (``reports.run_settings``):
    the mean of ``exact_match_chance`` over the test lengths its score averages (of the task it
    was evaluated on: ``eval_task_params`` over its own); NaN when the
    task's plugin is not loaded."""
    from che_bench.tasks import get_task

    if not unregistered.task_known(settings["task"]):
        return math.nan
    task = get_task(
        settings["task"], **{**settings["task_params"], **settings.get("eval_task_params", {})}
    )
    lengths = protocol.score_lengths(
        settings["test_lengths"], settings["train_max_length"], settings["score_from_42"]
    )
    return float(np.mean([exact_match_chance(task, n) for n in lengths]))
