"""Check (i) of the self-test: the state-tracking tasks train and evaluate on the device as on
the CPU.

Their scores are not the CHE tasks' mean token accuracy alone: flip-flop and the word
problem's final-only identity form score a few positions of each sequence (a mask), and the
evaluation counts, per member on the device, the sequences right in full, the pooled correct
and scored positions and the cumulative sequence accuracy by prefix. For each case of
``TASK_CASES``, a causal RoPE transformer (check (c)'s sizes, no dropout):

* "losses": a few training steps from the same weights on the device and on the CPU, the
  largest loss difference (check (c)'s tolerance);
* "scored positions": the evaluation's scored positions at one length (what the mask lets
  through), which must be equal;
* "scores": the token, sequence and pooled accuracies and the prefix curve there, the largest
  difference in accuracy points; under one sequence's worth (``SCORE_TOLERANCE``): an argmax
  that rounding flips moves a sequence, a miscount moves many.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from che_bench.checks.comparison import Case, model_sizes
from che_bench.checks.training_checks import LOSS_TOLERANCE
from che_bench.config import RunConfig, make_config
from che_bench.eval.evaluation import LengthScores, length_scores
from che_bench.model.base import BenchModel
from che_bench.run.runner import build_pack_model
from che_bench.train.loop import train_pack

#: (task, its parameters): groups of three sizes, DeltaProduct's m-token blocks, PaTH's
#: final-only identity form (A5), flip-flop's training and sparse distributions.
TASK_CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("word_problem", {"group": "S3"}),
    ("word_problem", {"group": "A4_x_Z5"}),
    ("word_problem", {"group": "S5", "variant": "tokens", "m": 4}),
    ("word_problem", {"variant": "identity"}),
    ("flip_flop", {}),
    ("flip_flop", {"p_ignore": 0.98}),
)
#: Evaluated sequences: one of them is 100 / EVAL_SEQUENCES points of the sequence accuracy.
EVAL_SEQUENCES = 128
#: Largest difference of a score, in accuracy points: one sequence's worth.
SCORE_TOLERANCE = 100 / EVAL_SEQUENCES


def case_config(task: str, params: dict[str, Any], quick: bool) -> RunConfig:
    """The run of one case: a causal RoPE transformer, a few steps, one evaluated length."""
    steps, length = (3, 20) if quick else (20, 100)
    return make_config(
        task,
        "rope",
        None,
        "smoke",
        task_params=params,
        steps=steps,
        batch_size=16,
        lr=1e-3,
        dropout=0.0,
        length_seed=0,
        test_lengths=str(length),
        eval_samples=EVAL_SEQUENCES,
        eval_batch_size=64,
        **model_sizes(quick),
    )


def device_copy(model: BenchModel, device: torch.device) -> BenchModel:
    """``model``'s copy on ``device`` (same weights)."""
    return copy.deepcopy(model).to(device)


def losses(model: BenchModel, config: RunConfig, device: torch.device) -> list[float]:
    """The per-step losses of training ``model`` on ``device`` for the config's steps."""
    found: list[float] = []
    train_pack(
        model,
        config.build_task(),
        [config],
        device,
        progress=False,
        on_step=lambda step, step_losses: found.append(step_losses[0]),
    )
    return found


def largest_score_gap(got: LengthScores, expected: LengthScores) -> float:
    """The largest difference, in accuracy points, of the token, sequence and pooled
    accuracies and the prefix curve."""
    pairs = [
        *zip(got.token, expected.token, strict=True),
        *zip(got.exact, expected.exact, strict=True),
        *zip(pooled(got), pooled(expected), strict=True),
        *zip(got.prefix[0], expected.prefix[0], strict=True),
    ]
    return 100 * max(abs(a - b) for a, b in pairs)


def pooled(scores: LengthScores) -> list[float]:
    """Each member's pooled accuracy: correct / scored positions of all its sequences."""
    return [
        right / max(total, 1) for right, total in zip(scores.correct, scores.scored, strict=True)
    ]


def task_cases(task: str, params: dict[str, Any], device: torch.device, quick: bool) -> list[Case]:
    """(i) for one task: losses, scored positions and scores on ``device`` vs the CPU."""
    config = case_config(task, params, quick)
    subject = f"{task} {' '.join(f'{k}={v}' for k, v in params.items())}".strip()
    reference = build_pack_model(config.build_task(), [config])
    tested = device_copy(reference, device)
    cpu, (length,) = torch.device("cpu"), config.test_lengths
    evaluated = config.build_evaluation_task()
    expected = length_scores(reference.eval(), evaluated, config, length, cpu)
    got = length_scores(tested.eval(), evaluated, config, length, device)
    expected_losses = losses(reference.train(), config, cpu)
    got_losses = losses(tested.train(), config, device)
    loss_gap = (
        max(abs(a - b) for a, b in zip(got_losses, expected_losses, strict=True))
        if len(got_losses) == len(expected_losses)
        else math.inf
    )
    scored_gap = max(abs(a - b) for a, b in zip(got.scored, expected.scored, strict=True))
    at = f"n = {length}, {EVAL_SEQUENCES} sequences"
    return [
        Case("i", subject, "losses", loss_gap, LOSS_TOLERANCE, "largest loss difference, nats"),
        Case("i", subject, "scored", float(scored_gap), 0.0, f"scored positions' gap, {at}"),
        Case(
            "i",
            subject,
            "scores",
            largest_score_gap(got, expected),
            SCORE_TOLERANCE,
            f"largest score difference, points, {at}",
        ),
    ]


def check_task_cases(device: torch.device, quick: bool) -> list[Case]:
    """(i) for every case of ``TASK_CASES``."""
    return [case for task, params in TASK_CASES for case in task_cases(task, params, device, quick)]
