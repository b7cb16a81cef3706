"""What the step loop measured, kept on the device until read: losses, accuracy counts and
gradient norms per member, the running values shown while training, divergence, and the
training history's rows."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from che_bench.config import RunConfig
from che_bench.train.history import TrainingHistory
from che_bench.train.progress import StepProgress


class Diverged(RuntimeError):
    """The loss became NaN or infinite (of every member); ``history`` holds their training
    history up to then."""

    def __init__(self, message: str, history: list[list[dict[str, Any]]] | None = None) -> None:
        super().__init__(message)
        self.history = history or []


class Readings:
    """What each step measured, kept on the device until read: losses, correct and counted
    positions and gradient norms per member (a ``[4, M]`` tensor per step), with the training
    seconds after the step (host time). ``read`` takes them off in one transfer and feeds
    the divergence watch, the running values and the history."""

    def __init__(self, members: int, first_step: int, history: TrainingHistory) -> None:
        self.values: list[torch.Tensor] = []
        self.seconds: list[float] = []
        self.first_step = first_step  # the step of the oldest pending reading
        self.history = history
        self.diverged_at: list[int | None] = [None] * members
        self.running_losses = [math.nan] * members
        self.running_accuracy = math.nan

    def add(
        self,
        losses: torch.Tensor,
        correct: torch.Tensor,
        counted: torch.Tensor,
        grad_norms: torch.Tensor,
        seconds: float,
    ) -> None:
        self.values.append(
            torch.stack(
                [
                    losses,
                    correct.to(losses.dtype),
                    counted.to(losses.dtype),
                    grad_norms.to(losses.dtype),
                ]
            )
        )
        self.seconds.append(seconds)

    def read(self) -> list[float]:
        """Pull the pending readings off the device; note divergences, running values and
        history. Returns the last read step's losses ([] when none was pending)."""
        if not self.values:
            return []
        values = torch.stack(self.values).tolist()  # [steps][4][M]
        seconds, first_step = list(self.seconds), self.first_step
        # Taken off before use: an interruption below never feeds a step to the history twice.
        self.values.clear()
        self.seconds.clear()
        self.first_step += len(values)
        for offset, ((losses, correct, counted, norms), elapsed) in enumerate(
            zip(values, seconds, strict=False)
        ):
            note_divergence(first_step + offset, losses, self.diverged_at, self.running_losses)
            self.history.add(first_step + offset, losses, correct, counted, norms, elapsed)
        correct, counted = (
            np.sum([step_values[i] for step_values in values], axis=0) for i in (1, 2)
        )
        accuracy = float(np.mean(correct / np.maximum(counted, 1)))
        self.running_accuracy = smooth(self.running_accuracy, accuracy)
        return values[-1][0]

    def all_diverged(self) -> bool:
        return all(at is not None for at in self.diverged_at)


def check_in(
    readings: Readings,
    step: int,
    configs: Sequence[RunConfig],
    on_step: Callable[[int, list[float]], None] | None,
    bar: StepProgress | None,
) -> None:
    """Read the pending readings: report the step, stop when every member has diverged,
    show progress."""
    step_losses = readings.read()
    if on_step is not None:
        on_step(step, step_losses)
    if readings.all_diverged():
        raise Diverged(
            f"diverged at step {min(at for at in readings.diverged_at if at is not None)}: "
            "loss is not finite "
            f"(lr {', '.join(f'{c.lr:g}' for c in configs)})",
            readings.history.rows,
        )
    if bar is not None:
        bar.update(step, float(np.nanmean(readings.running_losses)), readings.running_accuracy)


def note_divergence(
    step: int, losses: Sequence[float], diverged_at: list[int | None], running_losses: list[float]
) -> None:
    """Mark members whose loss at ``step`` is not finite; smooth the others' running loss."""
    for member, loss in enumerate(losses):
        if diverged_at[member] is not None:
            continue
        if not math.isfinite(loss):
            diverged_at[member] = step
        else:
            running_losses[member] = smooth(running_losses[member], loss)


def smooth(previous: float, value: float, weight: float = 0.95) -> float:
    return value if math.isnan(previous) else weight * previous + (1 - weight) * value
