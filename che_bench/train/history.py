"""A run's training history: per member, one row every ``log_every`` steps and at the last step.

A row is ``{"step", "loss", "accuracy", "grad_norm", "lr", "elapsed_s"}``: the window's last
step, the mean training loss over the window's steps, the masked token accuracy pooled over
the window's batches, the mean global gradient norm before clipping, the learning rate of the
step (its schedule's) and the training seconds up to that step (across resumes). Example
with ``log_every=100`` and 250 steps: rows at steps 100, 200 and 250, the last one over steps
201..250.

The training loop feeds it the values it already reads from the device (``add``), so it adds
no synchronisation; its state, an open window included, travels in checkpoints, so a resumed
run continues its history without gaps or duplicates.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from che_bench.settings import BY_NAME

if TYPE_CHECKING:
    from che_bench.tasks import Batch

DEFAULT_LOG_EVERY = BY_NAME["log_every"].default
HISTORY_FIELDS = ("step", "loss", "accuracy", "grad_norm", "lr", "elapsed_s")


@dataclass
class _Window:
    """Sums over the steps since the last row."""

    steps: int = 0
    loss: float = 0.0
    correct: float = 0.0
    counted: float = 0.0
    grad_norm: float = 0.0


class TrainingHistory:
    """The history rows of a pack's members (see the module docstring). ``on_row(member, row)``
    is called for every new row (trackers)."""

    def __init__(
        self,
        lrs: Sequence[float],
        log_every: int,
        last_step: int,
        on_row: Callable[[int, dict[str, Any]], None] | None = None,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        self.log_every = check_log_every(log_every)
        #: The schedule's factor of update k (0-based; ``LrSchedule.factor``): a row's lr is
        #: that of its last update.
        self._lr_factor = lr_factor or (lambda update: 1.0)
        self.last_step = last_step
        self.lrs = [float(lr) for lr in lrs]
        self.rows: list[list[dict[str, Any]]] = [[] for _ in self.lrs]
        self._windows = [_Window() for _ in self.lrs]
        self._on_row = on_row

    def add(
        self,
        step: int,
        losses: Sequence[float],
        correct: Sequence[float],
        counted: Sequence[float],
        grad_norms: Sequence[float],
        elapsed_s: float,
    ) -> None:
        """One step's values per member; closes the window at a logging step."""
        for member, window in enumerate(self._windows):
            window.steps += 1
            window.loss += losses[member]
            window.correct += correct[member]
            window.counted += counted[member]
            window.grad_norm += grad_norms[member]
        if step % self.log_every == 0 or step == self.last_step:
            for member, window in enumerate(self._windows):
                row = {
                    "step": step,
                    "loss": window.loss / window.steps,
                    "accuracy": window.correct / window.counted if window.counted else math.nan,
                    "grad_norm": window.grad_norm / window.steps,
                    "lr": self.lrs[member] * self._lr_factor(step - 1),
                    "elapsed_s": elapsed_s,
                }
                self.rows[member].append(row)
                self._windows[member] = _Window()
                if self._on_row is not None:
                    self._on_row(member, row)

    def state(self, member: int) -> dict[str, Any]:
        """What a member's checkpoint keeps: its rows and its open window."""
        return {
            "rows": [dict(row) for row in self.rows[member]],
            "window": asdict(self._windows[member]),
        }

    def restore(self, member: int, state: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's ``state`` (None: a checkpoint written before histories
        were kept; the history then starts at the resumed step). Another ``log_every`` than
        before is fine: the open window closes at the next multiple of the new one."""
        if state is None:
            return
        self.rows[member] = [dict(row) for row in state["rows"]]
        self._windows[member] = _Window(**state["window"])


def check_log_every(log_every: Any) -> int:
    """``log_every`` if it is an integer >= 1, else the setting's one-line error."""
    return BY_NAME["log_every"].validate(log_every)


#: Sequences drawn per training length to choose the input-blind guess, and as many again to
#: score it: scoring fresh sequences keeps the estimate from favouring the sample's own noise.
BASELINE_SEQUENCES = 512


@functools.lru_cache(maxsize=256)
def input_blind_accuracy(task_name: str, task_params_json: str, train_max_length: int) -> float:
    """The training accuracy (scored positions only, pooled over the training lengths, drawn
    uniformly as training draws them) of the best guess blind to the input's content: at each
    length and output position, the most frequent target class there. A model that learned only
    the class frequencies (even per length and position) scores this, and at least the chance
    1/classes on balanced targets. The guess is chosen on ``BASELINE_SEQUENCES`` sequences per
    length and scored on as many others (numpy seed 0)."""
    from che_bench.tasks import get_task

    task = get_task(task_name, **json.loads(task_params_json))
    rng = np.random.default_rng(0)
    correct = scored = 0
    for length in range(task.min_length, train_max_length + 1):
        guess = _most_frequent_class_per_position(
            task.sample(length, BASELINE_SEQUENCES, rng), task.output_size
        )
        scoring = task.sample(length, BASELINE_SEQUENCES, rng)
        correct += int(((scoring.targets == guess) & scoring.mask).sum())
        scored += int(scoring.mask.sum())
    return correct / scored


def _most_frequent_class_per_position(batch: Batch, classes: int) -> np.ndarray:
    """``[output positions]``: the most frequent scored target class at each position (class 0
    where no position was scored)."""
    positions = np.broadcast_to(np.arange(batch.targets.shape[1]), batch.targets.shape)
    counts = np.zeros((batch.targets.shape[1], classes), dtype=np.int64)
    np.add.at(counts, (positions[batch.mask], batch.targets[batch.mask]), 1)
    return counts.argmax(1)
