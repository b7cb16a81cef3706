"""``che-bench selftest``: does this device compute what che-bench computes on a CPU?

Six checks, each a list of cases with a measured value, the tolerance it must stay within
and a verdict (``Case``); measurements and labelled estimates besides (``Measurement``):

* (a) agreement: the same weights, inputs and random draws give the same logits and gradients
  on the device as on the CPU, for every encoding x DAPE kernel none / 1 / 3, TF32 off. The
  device runs its own DAPE implementation (grouped convolutions on a GPU); on a CPU the
  "device" copy is made to use the GPU's implementation, so the check compares the two.
* (b) packs: a pack of 4 gives each member's logits and gradients alone, on the device.
* (c) training: a 100-step training on the device follows the CPU's loss curve.
* (d) speed: a step of the paper-size model at n = 40 (the longest training length) for one
  run and for the widest ``--pack auto`` pack, peak memory, and *estimates* (not
  measurements) of one paper run's and one table cell's training time on this device.
* (e) determinism: ``--deterministic`` training twice gives bit-identical losses and weights.
* (f) architectures: every built-in architecture trains a few steps on the device, on the
  device's own code path (a one-member LSTM: cuDNN's kernel), with the logits and gradients
  of the CPU's batched loop (``che_bench.checks.architecture_check``).

On a CPU, (c) and (e) compare the CPU with itself: equal by construction, they exercise the
code paths; (a) and (f) make the "device" copy take the GPU's implementation. ``quick``
shrinks the models and lists (a CPU finishes in about a minute).
"""

from __future__ import annotations

import copy
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from che_bench.checks.architecture_check import check_architectures
from che_bench.checks.comparison import (
    GRADIENT_TOLERANCE,
    LOGITS_TOLERANCE,
    Case,
    forward_backward,
    model_sizes,
    on_cpu_and_device,
    relative_error,
    sample_batch,
)
from che_bench.checks.speed import TASK, Measurement, measure_speed
from che_bench.config import RunConfig, make_config
from che_bench.encodings import list_encodings
from che_bench.model.dape import DapeProcessor
from che_bench.model.encoder import Encoder, build_model
from che_bench.model.packs import stack_members
from che_bench.run.device import configure_numerics, prepare_deterministic_cublas
from che_bench.run.runner import build_pack_model, software_versions
from che_bench.train.loop import train_pack

#: Largest difference, in nats, allowed between two loss curves over 100 steps.
LOSS_TOLERANCE = 0.05
KERNELS = (None, 1, 3)


@dataclass
class SelftestReport:
    device: str
    quick: bool
    versions: dict[str, str]
    cases: list[Case] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(case.passed for case in self.cases)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "quick": self.quick,
            "passed": self.passed,
            "seconds": self.seconds,
            "versions": self.versions,
            "host": platform.node(),
            "cases": [{**asdict(case), "passed": case.passed} for case in self.cases],
            "measurements": [asdict(measurement) for measurement in self.measurements],
        }


def use_device_dape(model: Encoder, device: torch.device) -> None:
    """Make ``model``'s DAPE use ``device``'s implementation, the GPU's on a CPU too."""
    for module in model.modules():
        if isinstance(module, DapeProcessor):
            module.implementation = "auto" if device.type == "cuda" else "convolution"


def agreement_cases(
    encoding: str, kernel: int | None, device: torch.device, quick: bool
) -> list[Case]:
    """(a) for one encoding and kernel: a copy on ``device`` vs the CPU model, with the same
    weights, inputs and draws."""
    length, batch = (12, 4) if quick else (40, 16)
    task, inputs, targets = sample_batch(TASK, length, batch)
    torch.manual_seed(0)
    reference = build_model(task, encoding, kernel, dropout=0.0, **model_sizes(quick)).train()
    tested = copy.deepcopy(reference).to(device)
    use_device_dape(tested, device)
    draws = reference.sample_draws(length)
    expected, got = on_cpu_and_device(reference, tested, device, inputs, targets[None], draws)
    name = f"{encoding} k={kernel or '-'}"
    return [
        Case(
            "a",
            name,
            "logits",
            relative_error(got[0], expected[0]),
            LOGITS_TOLERANCE,
            "relative error vs CPU",
        ),
        Case(
            "a",
            name,
            "gradients",
            relative_error(got[1], expected[1]),
            GRADIENT_TOLERANCE,
            "relative error vs CPU",
        ),
    ]


def check_agreement(device: torch.device, quick: bool) -> list[Case]:
    """(a) device vs CPU for every encoding x kernel."""
    return [
        case
        for encoding in list_encodings()
        for kernel in KERNELS
        for case in agreement_cases(encoding.name, kernel, device, quick)
    ]


def check_packs(device: torch.device, quick: bool, members: int = 4) -> list[Case]:
    """(b) a pack of ``members`` vs each member alone, both on the device."""
    length, batch = (12, 4) if quick else (40, 16)
    task, inputs, targets = sample_batch(TASK, length, batch, seed=1)
    inputs, targets = inputs.to(device), targets.to(device)
    kernels = (None, 3) if quick else KERNELS
    cases = []
    for encoding in list_encodings():
        for kernel in kernels:
            alone = []
            for seed in range(members):
                torch.manual_seed(seed)
                alone.append(
                    build_model(task, encoding.name, kernel, dropout=0.0, **model_sizes(quick))
                    .to(device)
                    .train()
                )
            pack = stack_members(alone).train()
            pack.seed_draws(range(members))
            packed = forward_backward(pack, inputs, targets.expand(members, -1, -1), None)
            worst_logits = worst_gradients = 0.0
            for member, model in enumerate(alone):
                model.seed_draws([member])
                logits, gradients = forward_backward(model, inputs, targets[None], None)
                worst_logits = max(worst_logits, relative_error(packed[0][member], logits[0]))
                worst_gradients = max(
                    worst_gradients, relative_error(packed[1][member], gradients[0])
                )
            name = f"{encoding.name} k={kernel or '-'}"
            cases.append(
                Case(
                    "b",
                    name,
                    "logits",
                    worst_logits,
                    LOGITS_TOLERANCE,
                    f"relative error, pack of {members} vs alone, worst member",
                )
            )
            cases.append(
                Case(
                    "b",
                    name,
                    "gradients",
                    worst_gradients,
                    GRADIENT_TOLERANCE,
                    f"relative error, pack of {members} vs alone, worst member",
                )
            )
    return cases


def _training_configs(quick: bool, steps: int, dropout: float) -> list[RunConfig]:
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
    configs = _training_configs(quick, steps, dropout=0.0)
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
    configs = _training_configs(quick, steps, dropout=0.1)
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


#: The checks in order: letter, title, function(device, quick).
CHECKS: tuple[tuple[str, str, Callable[[torch.device, bool], list[Case]]], ...] = (
    ("a", "device vs CPU, every encoding x kernel", check_agreement),
    ("b", "pack of 4 vs members alone", check_packs),
    ("c", "training follows the CPU loss curve", check_training),
    ("e", "deterministic mode repeats bit for bit", check_determinism),
    ("f", "every built-in architecture trains on the device as on the CPU", check_architectures),
)


def run_selftest(
    device: torch.device, quick: bool, on_check: Callable[[str], None] | None = None
) -> SelftestReport:
    """Every check on ``device`` (TF32 off); ``on_check(title)`` is called as each starts."""
    from che_bench.run.device import describe_device

    started = time.perf_counter()
    prepare_deterministic_cublas()  # check (e) is deterministic; cuBLAS starts in check (a)
    configure_numerics(tf32=False)
    report = SelftestReport(describe_device(device), quick, software_versions())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for letter, title, check in CHECKS:
            if on_check is not None:
                on_check(f"({letter}) {title}")
            report.cases.extend(check(device, quick))
        if on_check is not None:
            on_check("(d) step time and estimates")
        report.measurements.extend(measure_speed(device, quick))
    report.seconds = time.perf_counter() - started
    return report
