"""Checks (c), (e) and (h) of the self-test: training on the device.

* (c) a 100-step training on the device follows the CPU's loss curve;
* (e) ``--deterministic`` training twice gives bit-identical losses and weights;
* (h) a pack stopped by Ctrl-C after a checkpoint and resumed on the device gives the
  uninterrupted pack's losses and accuracies, bit for bit (deterministic mode): the
  transformer with a randomized encoding, DAPE V2 and dropout (draw, RNG and optimizer states
  restored); not quick, a one-member LSTM (cuDNN's kernel on a GPU) and an mLSTM pack too.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from che_bench.checks.architecture_check import small_options
from che_bench.checks.comparison import Case, model_sizes
from che_bench.checks.speed import TASK
from che_bench.config import RunConfig, make_config
from che_bench.outcomes import RunResult
from che_bench.run.device import configure_numerics
from che_bench.run.runner import build_pack_model, execute_runs
from che_bench.train.loop import train_pack

#: Largest difference, in nats, allowed between two loss curves over 100 steps.
LOSS_TOLERANCE = 0.05


def training_configs(quick: bool, steps: int, dropout: float) -> list[RunConfig]:
    """One run of checks (c) and (e): Kerple + DAPE V2 k = 3 on ``TASK``."""
    return [
        make_config(
            TASK,
            "kerple",
            3,
            "smoke",
            steps=steps,
            batch_size=16,
            dropout=dropout,
            lr=1e-3,
            length_seed=0,
            **model_sizes(quick),
        )
    ]


def train_losses(
    configs: Sequence[RunConfig], device: torch.device
) -> tuple[list[float], torch.Tensor]:
    """Per-step losses (first member) of a fresh training on ``device``, and its final weights."""
    losses: list[float] = []
    task = configs[0].build_task()
    model = build_pack_model(task, configs).to(device)
    train_pack(
        model,
        task,
        configs,
        device,
        progress=False,
        on_step=lambda step, step_losses: losses.append(step_losses[0]),
    )
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return losses, weights


def check_training(device: torch.device, quick: bool, steps: int = 100) -> list[Case]:
    """(c) the device's loss curve vs the CPU's over ``steps`` steps (same seeds; no dropout,
    whose masks come from each device's own random number generator)."""
    configs = training_configs(quick, steps, dropout=0.0)
    expected, _ = train_losses(configs, torch.device("cpu"))
    got, _ = train_losses(configs, device)
    gap = (
        max(abs(a - b) for a, b in zip(got, expected, strict=True))
        if len(got) == len(expected)
        else math.inf
    )
    return [
        Case(
            "c",
            f"{steps} steps, kerple k=3",
            "losses",
            gap,
            LOSS_TOLERANCE,
            "largest loss difference vs CPU, nats",
        )
    ]


def check_determinism(device: torch.device, quick: bool, steps: int = 20) -> list[Case]:
    """(e) two trainings in deterministic mode (with dropout): bit-identical losses and
    weights."""
    configs = training_configs(quick, steps, dropout=0.1)
    configure_numerics(tf32=False, deterministic=True)
    try:
        runs = [train_losses(configs, device) for _ in range(2)]
    finally:
        configure_numerics(tf32=False, deterministic=False)
    (first_losses, first_weights), (second_losses, second_weights) = runs
    # Not strict: a training stops once every member diverges, so two runs that differ may
    # record different numbers of steps; the weights' gap tells them apart then.
    loss_gap = max(abs(a - b) for a, b in zip(first_losses, second_losses, strict=False))
    weight_gap = float((first_weights - second_weights).abs().max())
    subject = f"{steps} steps twice, kerple k=3"
    return [
        Case("e", subject, "losses", loss_gap, 0.0, "largest difference"),
        Case("e", subject, "weights", weight_gap, 0.0, "largest difference"),
    ]


def resume_packs(quick: bool) -> dict[str, list[RunConfig]]:
    """(h)'s packs, by subject: tiny, a few steps, one short test length."""
    steps = 6 if quick else 20
    common: dict[str, Any] = dict(
        steps=steps, test_lengths="13", eval_samples=4, eval_batch_size=4, length_seed=0
    )
    transformer = [
        make_config(
            TASK,
            "random_alibi",
            3,
            "smoke",
            seed=seed,
            dropout=0.1,
            lr=1e-3,
            **model_sizes(quick),
            **common,
        )
        for seed in range(2)
    ]
    packs = {"transformer random_alibi k=3, dropout 0.1, pack of 2": transformer}
    if not quick:
        for arch, members in (("lstm", 1), ("mlstm", 2)):
            options = small_options(arch, quick=True)
            packs[f"{arch}, {'alone' if members == 1 else f'pack of {members}'}"] = [
                make_config(
                    TASK,
                    preset="smoke",
                    arch=arch,
                    arch_options=options,
                    seed=seed,
                    lr=1e-3,
                    **common,
                )
                for seed in range(members)
            ]
    return packs


def deterministic_runs(
    configs: Sequence[RunConfig], device: torch.device, **options: Any
) -> list[RunResult]:
    """``configs`` trained and evaluated as one pack on ``device`` in deterministic mode, a
    history row every step (``options``: ``execute_runs``'s others)."""
    return execute_runs(
        configs,
        device=str(device),
        pack=len(configs),
        progress=False,
        log_every=1,
        deterministic=True,
        **options,
    )


def interrupted_then_resumed(
    configs: Sequence[RunConfig], device: torch.device, directory: Path, stop_at: int
) -> list[RunResult]:
    """``deterministic_runs`` of ``configs``, stopped as by Ctrl-C after step ``stop_at`` (its
    checkpoints saved in ``directory``), then resumed from them. What the runs say of it on
    stderr (to run the command again) is not for a self-test's reader."""

    def stop(step: int, losses: list[float]) -> None:
        if step == stop_at:
            raise KeyboardInterrupt

    with contextlib.redirect_stderr(io.StringIO()):
        with contextlib.suppress(KeyboardInterrupt):  # after the checkpoints of ``stop_at``
            deterministic_runs(configs, device, on_step=stop, checkpoint_dir=directory)
        return deterministic_runs(configs, device, checkpoint_dir=directory)


def resume_cases(subject: str, configs: Sequence[RunConfig], device: torch.device) -> list[Case]:
    """(h) for one pack: resumed vs uninterrupted, both deterministic on ``device``."""
    stop_at = configs[0].steps // 2
    try:
        uninterrupted = deterministic_runs(configs, device)
        with tempfile.TemporaryDirectory(prefix="che-bench-selftest-") as directory:
            resumed = interrupted_then_resumed(configs, device, Path(directory), stop_at)
    finally:
        configure_numerics(tf32=False, deterministic=False)
    errors = [
        result.error or f"resumed from step {result.timings.get('resumed_from_step', 0)}"
        for result in resumed
        if result.status != "complete" or result.timings.get("resumed_from_step") != stop_at
    ]
    gaps = [math.inf, math.inf]
    if not errors:
        gaps = [largest_gap(resumed, uninterrupted, reading) for reading in ("loss", "accuracy")]
    what = f"largest difference, stopped after step {stop_at} and resumed vs uninterrupted"
    error = "; ".join(dict.fromkeys(errors))
    return [
        Case("h", subject, "losses", gaps[0], 0.0, what, error),
        Case("h", subject, "accuracies", gaps[1], 0.0, what, error),
    ]


def largest_gap(got: Sequence[RunResult], expected: Sequence[RunResult], reading: str) -> float:
    """The largest difference of a training curve's ``reading`` ("loss": every history row;
    "accuracy": the history's and every test length's) between two runs of each member."""
    pairs: list[tuple[float, float]] = []
    for a, b in zip(got, expected, strict=True):
        if len(a.history) != len(b.history):
            return math.inf
        pairs += [
            (row[reading], other[reading]) for row, other in zip(a.history, b.history, strict=True)
        ]
        if reading == "accuracy":
            pairs += [(a.per_length[n], b.per_length.get(n, math.nan)) for n in a.per_length]
    # Equal values differ by 0 (infinite ones too); a NaN differs from everything.
    differences = [0.0 if x == y else abs(x - y) for x, y in pairs]
    return max((d if math.isfinite(d) else math.inf for d in differences), default=0.0)


def check_resume(device: torch.device, quick: bool) -> list[Case]:
    """(h) for every pack of ``resume_packs``."""
    return [
        case
        for subject, configs in resume_packs(quick).items()
        for case in resume_cases(subject, configs, device)
    ]
