"""Range evaluation of a trained model (CHE protocol, spec section 4).

For every length, ``eval_samples`` sequences are drawn in sub-batches of ``eval_batch_size``
from a numpy Generator seeded with (eval_seed, length), so every model sees the same test
sequences whatever lengths are evaluated. A sub-batch's accuracy is the masked token accuracy
pooled over its sequences; a length's accuracy is the mean over its sub-batches; the run's score
is the mean over the test lengths (``RunConfig.score_lengths``). Dropout is off unless
``dropout_at_eval`` (the reference keeps it on); randomized encodings keep drawing from torch's
RNG, seeded per length.

On CUDA out-of-memory the forward pass of a sub-batch is split into smaller chunks; the
accounting stays per logical sub-batch, so the numbers do not depend on the split.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from che_bench.training import batch_to_device, masked_correct

if TYPE_CHECKING:
    from che_bench.config import RunConfig
    from che_bench.tasks.base import Task


@dataclass
class Evaluation:
    per_length: dict[int, float]
    train_per_length: dict[int, float]
    score: float
    train_accuracy: float
    seconds: float


def evaluate(
    model: torch.nn.Module,
    task: Task,
    config: RunConfig,
    device: torch.device,
    *,
    progress: bool = True,
) -> Evaluation:
    """Per-length accuracies on the test and in-distribution lengths, score and timing."""
    started = time.perf_counter()
    model.train(config.dropout_at_eval)
    lengths = [*config.train_eval_lengths, *config.test_lengths]
    accuracies: dict[int, float] = {}
    with _progress_bar(progress, len(lengths)) as bar:
        for length in dict.fromkeys(lengths):  # in order, each once
            accuracies[length] = length_accuracy(model, task, config, length, device)
            if bar is not None:
                bar.update(bar.task_ids[0], advance=1, description=f"eval n={length}")
    per_length = {n: accuracies[n] for n in config.test_lengths}
    train_per_length = {n: accuracies[n] for n in config.train_eval_lengths}
    return Evaluation(
        per_length=per_length,
        train_per_length=train_per_length,
        score=float(np.mean([per_length[n] for n in config.score_lengths])),
        train_accuracy=float(np.mean(list(train_per_length.values()))),
        seconds=time.perf_counter() - started,
    )


def length_accuracy(
    model: torch.nn.Module, task: Task, config: RunConfig, length: int, device: torch.device
) -> float:
    """Mean over sub-batches of the pooled masked token accuracy at one length."""
    data_rng = np.random.default_rng([config.eval_seed, length])
    sub_batches = _sub_batch_sizes(config.eval_samples, config.eval_batch_size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.eval_seed * 1_000_003 + length)
        sub_batch_accuracies = []
        for size in sub_batches:
            batch = task.sample(length, size, data_rng)
            correct, total = _count_correct(model, batch, device)
            sub_batch_accuracies.append(correct / total)
    return float(np.mean(sub_batch_accuracies))


def _sub_batch_sizes(samples: int, batch_size: int) -> list[int]:
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def _count_correct(model: torch.nn.Module, batch, device: torch.device) -> tuple[int, int]:
    """Correct and counted positions of one sub-batch, halving the forward chunk on CUDA OOM."""
    inputs, targets, mask = batch_to_device(batch, device)
    chunk = inputs.shape[0]
    while True:
        try:
            with torch.inference_mode():
                counts = [
                    masked_correct(model(inputs[i : i + chunk]), targets[i : i + chunk], mask[i : i + chunk])
                    for i in range(0, inputs.shape[0], chunk)
                ]
            return sum(c for c, _ in counts), sum(t for _, t in counts)
        except torch.OutOfMemoryError:
            if chunk == 1:
                raise
            torch.cuda.empty_cache()
            chunk = max(1, chunk // 2)


@contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Progress | None]:
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with bar:
        bar.add_task("eval", total=total)
        yield bar

