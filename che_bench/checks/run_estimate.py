"""What a run will take, estimated before it trains (``che-bench run`` prints it, as
``evaluate`` states what a long evaluation will cost): a few training steps and one evaluation
length of the run's own model are timed here, on its device, threads and numerics, and scaled
to the run.

* Training: the steps left times a step at the *representative* training length, the
  curriculum's length whose model input, squared, is nearest the mean of the squares. A step's
  cost grows with its tokens no faster than their square, so this is exact for the quadratic
  part of the cost and a little above the mean for the linear part. A run of mixed-length
  batches (``batch_lengths = "mixed"``) times a step of one such batch, its lengths drawn from
  the curriculum: each sequence is computed to the batch's longest. Either step runs in the
  run's training precision.
* Evaluation: evaluate's cost model (``che_bench.eval.reevaluation.evaluation_cost``:
  sequences x model tokens squared, over the lengths) times the seconds per unit of it timed at
  the representative evaluation length, chosen the same way.

Each pack of a table cell costs what the first costs. The timing runs on models of its own
under a forked random state, so the run's numbers do not change; a machine busier (or
quieter) than while it was timed makes the run slower (or faster).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from che_bench import curricula
from che_bench.checks.speed import step_seconds, synchronize
from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.eval.evaluation import length_scores, use_evaluation_budget
from che_bench.eval.reevaluation import evaluation_cost
from che_bench.run.runner import build_pack_model, checkpoint_path
from che_bench.settings import MIXED
from che_bench.tasks.base import Task
from che_bench.train.checkpoints import checkpoint_step
from che_bench.train.progress import duration_text

#: Training lengths drawn from the curriculum to find the representative one.
CURRICULUM_DRAWS = 1000
#: Timed training steps (their median), after one untimed.
TIMED_STEPS = 2


@dataclass(frozen=True)
class RunEstimate:
    """The expected seconds of the runs still to do, and what they were scaled from."""

    packs: int
    #: Training steps left, over every pack.
    steps: int
    step_s: float
    #: The timed step's length (a mixed batch: its longest).
    train_length: int
    #: Seconds of every pack's evaluation.
    eval_s: float
    eval_length: int
    #: Whether the timed step was a mixed-length batch.
    mixed: bool = False

    @property
    def train_s(self) -> float:
        return self.steps * self.step_s

    def line(self) -> str:
        packs = f" in {self.packs} packs, one after another" if self.packs > 1 else ""
        train_s, eval_s = round(self.train_s), round(self.eval_s)  # the total: their sum
        return (
            f"expected: about {duration_text(train_s + eval_s)}{packs} at this "
            f"machine's present speed (training {duration_text(train_s)}: "
            f"{self.steps:,} steps at {1e3 * self.step_s:,.0f} ms, timed "
            f"{'on a mixed-length batch up to' if self.mixed else 'at'} n = "
            f"{self.train_length}; evaluation {duration_text(eval_s)}, timed at n = "
            f"{self.eval_length})"
        )


def representative_length(task: Task, lengths: Iterable[int]) -> int:
    """The length of ``lengths`` whose model input, squared, is nearest the mean square of
    theirs (the first such length)."""
    lengths = list(lengths)
    squares = [task.model_length(n) ** 2 for n in lengths]
    mean = sum(squares) / len(squares)
    return min(sorted(set(lengths)), key=lambda n: abs(task.model_length(n) ** 2 - mean))


def curriculum_lengths(config: RunConfig, task: Task) -> list[int]:
    """``CURRICULUM_DRAWS`` training lengths of ``config``'s curriculum, spread over its steps
    (from a generator of their own: the run's draws are untouched)."""
    curriculum = curricula.build(
        config.curriculum,
        config.curriculum_options,
        range(task.min_length, config.train_max_length + 1),
        config.steps,
    )
    rng = np.random.default_rng(0)
    stride = max(1, config.steps // CURRICULUM_DRAWS)
    return [curriculum.length(step, rng) for step in range(0, config.steps, stride)]


def estimate_runs(
    packs: Sequence[Sequence[RunConfig]], device: torch.device, checkpoint_dir: str | Path | None
) -> RunEstimate:
    """The time ``packs`` will take on ``device`` (one after another), from the first pack's
    timed step and evaluation length; a pack resuming from a checkpoint has fewer steps."""
    first = list(packs[0])
    config, task = first[0], first[0].build_task()
    drawn = curriculum_lengths(config, task)
    # A mixed step: one batch's lengths, drawn from the curriculum's (a generator of its own).
    mixed = mixed_lengths(config, drawn) if config.batch_lengths == MIXED else None
    train_length = representative_length(task, drawn) if mixed is None else max(mixed)
    eval_length = representative_length(task, [*config.train_eval_lengths, *config.test_lengths])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        step_s = step_seconds(first, device, TIMED_STEPS, length=train_length, mixed_lengths=mixed)
        unit_s = _evaluation_unit_seconds(first, task, device, eval_length)
    return RunEstimate(
        packs=len(packs),
        steps=sum(pack[0].steps - _steps_done(pack[0], checkpoint_dir) for pack in packs),
        step_s=step_s,
        train_length=train_length,
        eval_s=unit_s * sum(evaluation_cost(pack[0]) for pack in packs),
        eval_length=eval_length,
        mixed=mixed is not None,
    )


def mixed_lengths(config: RunConfig, drawn: Sequence[int]) -> list[int]:
    """One mixed-length batch's lengths: ``config.batch_size`` of the curriculum's ``drawn``."""
    rng = np.random.default_rng(0)
    return [int(n) for n in rng.choice(np.asarray(drawn), size=config.batch_size)]


def _evaluation_unit_seconds(
    configs: list[RunConfig], task: Task, device: torch.device, length: int
) -> float:
    """Seconds per unit of ``evaluation_cost`` of the pack ``configs``'s model, timed at
    ``length`` (after an untimed evaluation of its shortest training length)."""
    config = configs[0]
    model = build_pack_model(task, configs).to(device)
    model.train(config.dropout_at_eval)
    use_evaluation_budget(model, device)
    length_scores(model, task, config, min(config.train_eval_lengths), device)
    synchronize(device)
    started = time.perf_counter()
    length_scores(model, task, config, length, device)
    synchronize(device)
    seconds = time.perf_counter() - started
    return seconds / (config.eval_samples * task.model_length(length) ** 2)


def _steps_done(config: RunConfig, checkpoint_dir: str | Path | None) -> int:
    """The step ``config``'s checkpoint resumes from (0: none, or one the run will refuse)."""
    if checkpoint_dir is None:
        return 0
    try:
        return checkpoint_step(checkpoint_path(checkpoint_dir, config.run_id()), config)
    except CheBenchError:
        return 0
