"""Range evaluation of trained models (CHE protocol, spec section 4), a pack at a time.

For every length, ``eval_samples`` sequences are drawn in sub-batches of ``eval_batch_size``
from a numpy Generator seeded with (eval_seed, length), so every model sees the same test
sequences whatever lengths are evaluated, and every member of a pack sees the same batches. A
sub-batch's accuracy is the masked token accuracy pooled over its sequences, its exact-match
accuracy the share of its sequences whose every masked position is right; a length's
accuracies are the means over its sub-batches; the run's scores are the means over the test
lengths (``RunConfig.score_lengths``). Counted exactly besides: each length's correct and
scored positions over all its sequences (their ratio pooled over the score's lengths: the
pooled score), and at the longest test length the sequences right up to each position (the
prefix curve, ``LengthScores``). Dropout is off unless ``dropout_at_eval`` (the
reference keeps it on; it then draws one seed per sequence from torch's RNG seeded per length,
and its masks are a function of those seeds, ``che_bench.model.dropout``); randomized encodings
draw from their own generators, seeded per length, once per sub-batch, and only if
``randomize_at_eval``.

On CUDA the row-chunk memory budget is sized from the free GPU memory, and on out-of-memory
the budget is halved (smaller row chunks and sub-batches) until the forward pass fits; a model
that does not split its forward pass (``query_row_bytes`` 0: plugins' models) is given half the
sequences at a time instead, down to one. The accounting stays per logical sub-batch (with
the same random draws), so the numbers do not depend on the split. Sub-batches are copied to
the GPU from pinned memory without waiting.
"""

from __future__ import annotations

import functools
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn

from che_bench.allocator import large_blocks_returned
from che_bench.config import RunConfig
from che_bench.device_memory import free_gpu_memory, release_memory
from che_bench.model.base import BenchModel
from che_bench.outcomes import Scores
from che_bench.tasks.base import Task
from che_bench.train.batches import host_to_device
from che_bench.train.metrics import check_token_ids, exact_counts, masked_counts, prefix_counts
from che_bench.train.progress import AverageTimeRemaining, ProgressLines, progress_display

#: Share of the free GPU memory an evaluation's row chunks may fill (the rest: weights,
#: activations outside attention, the allocator's slack, other processes on the GPU).
GPU_BUDGET_SHARE = 0.5


@dataclass(kw_only=True)
class Evaluation(Scores):
    """One member's scores (see the module docstring) and the evaluation's seconds."""

    seconds: float


def evaluate(
    model: BenchModel, task: Task, config: RunConfig, device: torch.device, *, progress: bool = True
) -> list[Evaluation]:
    """Per-length accuracies on the test and in-distribution lengths, score and timing, for
    each member of ``model`` (all evaluated under ``config``'s evaluation protocol)."""
    started = time.perf_counter()
    model.train(config.dropout_at_eval)
    use_evaluation_budget(model, device)
    scores = _scores_by_length(model, task, config, device, progress)
    seconds = time.perf_counter() - started
    return [_member_evaluation(scores, member, config, seconds) for member in range(model.members)]


def _member_evaluation(
    scores: dict[int, LengthScores], member: int, config: RunConfig, seconds: float
) -> Evaluation:
    """One member's ``Evaluation`` from the ``LengthScores`` of every evaluated length."""

    def curve(name: str, lengths: tuple[int, ...]) -> dict[int, Any]:
        return {n: getattr(scores[n], name)[member] for n in lengths}

    test, train = config.test_lengths, config.train_eval_lengths
    score_lengths = config.score_lengths
    token, exact = curve("token", test), curve("exact", test)
    train_token, train_exact = curve("token", train), curve("exact", train)
    correct, scored = curve("correct", test), curve("scored", test)
    train_correct, train_scored = curve("correct", train), curve("scored", train)
    return Evaluation(
        per_length=token,
        train_per_length=train_token,
        score=float(np.mean([token[n] for n in score_lengths])),
        train_accuracy=float(np.mean(list(train_token.values()))),
        seconds=seconds,
        exact_per_length=exact,
        train_exact_per_length=train_exact,
        exact_score=float(np.mean([exact[n] for n in score_lengths])),
        train_exact_accuracy=float(np.mean(list(train_exact.values()))),
        correct_per_length=correct,
        scored_per_length=scored,
        train_correct_per_length=train_correct,
        train_scored_per_length=train_scored,
        pooled_score=pooled_accuracy(correct, scored, score_lengths),
        train_pooled_accuracy=pooled_accuracy(train_correct, train_scored, train),
        prefix_length=max(test),
        prefix_accuracies=scores[max(test)].prefix[member],
    )


def pooled_accuracy(
    correct: dict[int, int], scored: dict[int, int], lengths: tuple[int, ...]
) -> float | None:
    """Correct / scored positions pooled over ``lengths`` (None when none is scored)."""
    total = sum(scored[n] for n in lengths)
    return sum(correct[n] for n in lengths) / total if total else None


def _scores_by_length(
    model: BenchModel, task: Task, config: RunConfig, device: torch.device, progress: bool
) -> dict[int, LengthScores]:
    """Each member's ``LengthScores`` at every in-distribution and test length
    (``length_scores``), in that order, with the progress shown (``_progress_bar``)."""
    lengths = list(dict.fromkeys([*config.train_eval_lengths, *config.test_lengths]))
    work = [length_work(task, config, length) for length in lengths]
    scores: dict[int, LengthScores] = {}
    rows = ForwardRows()
    with _progress_bar(progress, len(lengths), sum(work)) as bar:
        for done, (length, cost) in enumerate(zip(lengths, work, strict=True), start=1):
            scores[length] = length_scores(model, task, config, length, device, rows)
            if isinstance(bar, Progress):
                bar.update(bar.task_ids[0], advance=cost, done=done, description=f"eval n={length}")
            elif bar is not None:
                bar.report(done, f"n={length} done", done_share=sum(work[:done]) / sum(work))
    return scores


def length_work(task: Task, config: RunConfig, length: int) -> float:
    """The relative time of evaluating ``length``, for the time left: the model's input
    tokens, squared for a transformer (attention dominates at long lengths)."""
    tokens = task.model_length(length)
    return float(tokens**2 if config.is_transformer else tokens)


def evaluation_budget(device: torch.device) -> int:
    """The memory budget of an evaluation on a GPU: a share of its free memory."""
    return int(free_gpu_memory(device) * GPU_BUDGET_SHARE)


def use_evaluation_budget(model: BenchModel, device: torch.device) -> None:
    """On a GPU, size the model's memory budget from the memory free now; elsewhere keep
    the model's own (``memory_budget_bytes``, 1 GiB by default)."""
    if device.type == "cuda":
        model.set_memory_budget(evaluation_budget(device))


def seed_for_length(
    model: BenchModel, config: RunConfig, length: int
) -> tuple[np.random.Generator, int]:
    """The test data generator of ``length`` and the seed of its dropout (when on), with
    which the model's draw generators are seeded too (alike for every member): every model
    sees the same test sequences and positions at a length, whatever else is evaluated."""
    seed = config.eval_seed * 1_000_003 + length
    model.seed_draws([seed] * model.members)
    return np.random.default_rng([config.eval_seed, length]), seed


def length_accuracies(
    model: BenchModel, task: Task, config: RunConfig, length: int, device: torch.device
) -> list[float]:
    """Each member's mean over sub-batches of the pooled masked token accuracy at one length."""
    return length_scores(model, task, config, length, device).token


@dataclass
class LengthScores:
    """Each member's scores at one length: token accuracy (mean over sub-batches of the
    pooled masked token accuracy), exact match (mean over sub-batches of the share of
    sequences with every masked position right), the correct and scored positions of all
    its sequences (their ratio: the pooled accuracy, 1 - flip-flop's read error) and the
    cumulative sequence accuracy by prefix (``prefix_counts`` over all sequences / their
    number; one value per output position)."""

    token: list[float]
    exact: list[float]
    correct: list[int]
    scored: list[int]
    prefix: list[list[float]]


def length_scores(
    model: BenchModel,
    task: Task,
    config: RunConfig,
    length: int,
    device: torch.device,
    rows: ForwardRows | None = None,
) -> LengthScores:
    """Each member's ``LengthScores`` at one length; ``rows``: see ``ForwardRows``."""
    data_rng, seed = seed_for_length(model, config, length)
    sub_batch_scores, counts, prefixes = [], [], []
    forked = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with forked, large_blocks_returned():
        torch.manual_seed(seed)  # dropout at evaluation
        for size in _sub_batch_sizes(config.eval_samples, config.eval_batch_size):
            batch = task.sample(length, size, data_rng)
            correct, counted, exact, sequences, right = _count_correct(model, batch, device, rows)
            sub_batch_scores.append(torch.stack([correct / counted, exact / sequences]))
            counts.append(torch.stack([correct, counted]))  # [2, M]
            prefixes.append(right)  # [M, L]
    token, exact = torch.stack(sub_batch_scores).mean(0).tolist()
    correct_total, scored_total = torch.stack(counts).sum(0).round().long().tolist()
    prefix = torch.stack(prefixes).sum(0) / config.eval_samples
    return LengthScores(token, exact, correct_total, scored_total, prefix.tolist())


def _sub_batch_sizes(samples: int, batch_size: int) -> list[int]:
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


@dataclass
class ForwardRows:
    """Sequences per forward pass of a model that does not split its own (``query_row_bytes``
    0); None: the whole sub-batch. Halved on out-of-memory, for the rest of the evaluation."""

    limit: int | None = None


def _count_correct(
    model: BenchModel, batch, device: torch.device, rows: ForwardRows | None = None
) -> tuple[torch.Tensor, ...]:
    """Correct and counted positions, exactly right and counted sequences (``[M]`` each) and
    the sequences right up to each position (``[M, L]``, ``prefix_counts``) of one sub-batch
    per member, on the device, so that a length costs one synchronisation; one
    random draw serves the whole sub-batch (positions, and dropout's per-sequence seeds). On
    out-of-memory the model's memory budget is halved (for the rest of the evaluation too),
    down to one query row of one sequence; a model that does not split its forward pass is
    given fewer sequences at a time instead (``rows``), down to one. Below that the error
    stands (a pack then trains and evaluates as two narrower ones)."""
    check_token_ids(batch.inputs, model.task)
    # Copies: task arrays may be reversed views, whose negative strides torch rejects (and
    # numpy calls such an array contiguous when the reversed axis has size 1).
    inputs, targets, mask = (
        host_to_device(torch.from_numpy(array.copy()), device)
        for array in (batch.inputs, batch.targets, batch.mask)
    )
    draws = model.sample_draws(inputs.shape[-1], evaluating=True)
    dropout_seeds = model.sample_dropout_seeds(inputs.shape[0])
    rows = rows if rows is not None else ForwardRows()
    splits_itself = model.query_row_bytes(inputs.shape[-1], device) > 0
    while True:
        step = min(rows.limit or inputs.shape[0], inputs.shape[0])
        try:
            with torch.inference_mode():
                parts = [
                    _counts(model, inputs, targets, mask, draws, dropout_seeds, part)
                    for part in _row_slices(inputs.shape[0], step)
                ]
            return tuple(torch.stack(counts).sum(0).double() for counts in zip(*parts, strict=True))
        except torch.cuda.OutOfMemoryError:
            if splits_itself:
                if model.memory_budget_bytes <= model.query_row_bytes(inputs.shape[-1], device):
                    raise
            elif step == 1:
                raise
        # Past the except block, whose traceback held the failed attempt's maps.
        release_memory(device)
        if splits_itself:
            model.set_memory_budget(model.memory_budget_bytes // 2)
        else:
            rows.limit = (step + 1) // 2


def _row_slices(total: int, step: int) -> list[slice]:
    return [slice(start, min(start + step, total)) for start in range(0, total, step)]


def _counts(model: BenchModel, inputs, targets, mask, draws, dropout_seeds, rows: slice):
    """``_count_correct``'s counts of the sequences ``rows`` of a sub-batch."""
    seeds = None if dropout_seeds is None else dropout_seeds[..., rows]
    logits = model(inputs[rows], draws, evaluating=True, dropout_seeds=seeds)
    part_targets, part_mask = targets[rows], mask[rows]
    return (
        *masked_counts(logits, part_targets, part_mask),
        *exact_counts(logits, part_targets, part_mask),
        prefix_counts(logits, part_targets, part_mask),
    )


def _progress_bar(
    enabled: bool, lengths: int, work: float
) -> AbstractContextManager[Progress | ProgressLines | None]:
    """The bar on a terminal; elsewhere ``ProgressLines`` (a line a minute: a slow model's
    evaluation is seen to move); None when not ``enabled``. The bar advances by ``work``
    (``length_work``), so that its time left holds for the long lengths at the end."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        TextColumn(f"{{task.fields[done]}}/{lengths} lengths · ETA"),
        AverageTimeRemaining(),
    )
    lines = functools.partial(ProgressLines, "evaluate", lengths, 0, unit="length")
    return progress_display(enabled, lines, columns, "eval", work, done=0)
