"""``che-bench selftest``: does this device compute what che-bench computes on a CPU?

Nine checks, each a list of cases with a measured value, the tolerance it must stay within
and a verdict (``Case``); measurements and labelled estimates besides (``Measurement``):

* (a) agreement: the same weights, inputs and random draws give the same logits and gradients
  on the device as on the CPU, for every encoding x DAPE kernel none / 1 / 3, and for DAPE V2
  k = 5, 7 and causal k = 3 (``DAPE_VARIANTS``), TF32 off. The device runs its own DAPE
  implementation (grouped convolutions on a GPU); on a CPU the "device" copy is made to use
  the GPU's implementation, so the check compares the two.
* (b) packs: a pack gives each member's logits and gradients alone, on the device, for the
  transformer and every other built-in architecture (``che_bench.checks.pack_checks``).
* (c) training: a 100-step training on the device follows the CPU's loss curve.
* (d) speed: a step of the paper-size model at n = 40 (the longest training length) for one
  run and for the widest ``--pack auto`` pack, peak memory, and *estimates* (not
  measurements) of one paper run's and one table cell's training time on this device.
* (e) determinism: ``--deterministic`` training twice gives bit-identical losses and weights.
* (f) architectures: every built-in architecture trains a few steps on the device, on the
  device's own code path (a one-member LSTM: cuDNN's kernel), with the logits and gradients
  of the CPU's batched loop (``che_bench.checks.architecture_check``).
* (g) evaluation: at n = 500, the transformer's row chunks with DAPE, cuDNN's LSTM
  inference, greedy decoding, the state-tracking models' chunked forms, on the device as on
  the CPU (``che_bench.checks.evaluation_checks``).
* (h) resuming: a pack stopped after a checkpoint and resumed on the device repeats the
  uninterrupted pack bit for bit (``che_bench.checks.training_checks``, as (c) and (e)).
* (i) the state-tracking tasks: word problems (S3, A4 x Z5, S5 in 4-token blocks, A5's
  final-only identity form) and flip-flop (p_ignore 0.8, 0.98) train and are scored (their
  masks, sequence and pooled accuracies, prefix curves) on the device as on the CPU
  (``che_bench.checks.task_cases``).

On a CPU, (c), (e), (h) and (i) compare the CPU with itself: equal by construction, they exercise
the code paths; (a), (f) and (g) make the "device" copy take the GPU's implementation.
``quick`` shrinks the models, lengths and lists (a CPU finishes in about a minute).
"""

from __future__ import annotations

import copy
import platform
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from che_bench.checks.architecture_check import check_architectures
from che_bench.checks.comparison import (
    GRADIENT_TOLERANCE,
    KERNELS,
    LOGITS_TOLERANCE,
    Case,
    model_sizes,
    on_cpu_and_device,
    relative_error,
    sample_batch,
    use_device_dape,
)
from che_bench.checks.evaluation_checks import check_evaluation
from che_bench.checks.pack_checks import check_packs
from che_bench.checks.speed import TASK, Measurement, measure_speed
from che_bench.checks.task_cases import check_task_cases
from che_bench.checks.training_checks import check_determinism, check_resume, check_training
from che_bench.encodings import list_encodings
from che_bench.model.encoder import build_model
from che_bench.run.device import configure_numerics, prepare_deterministic_cublas
from che_bench.run.provenance import software_versions

#: (a)'s DAPE V2 beyond ``KERNELS``, with one encoding: (encoding, kernel, causal).
DAPE_VARIANTS = (("kerple", 5, False), ("kerple", 7, False), ("kerple", 3, True))
#: The letter of (d), which measures and estimates instead of comparing.
SPEED = "d"


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


def agreement_cases(
    encoding: str, kernel: int | None, device: torch.device, quick: bool, causal: bool = False
) -> list[Case]:
    """(a) for one encoding and kernel, ``causal`` or not: a copy on ``device`` vs the CPU
    model, with the same weights, inputs and draws."""
    length, batch = (12, 4) if quick else (40, 16)
    task, inputs, targets = sample_batch(TASK, length, batch)
    torch.manual_seed(0)
    sizes = model_sizes(quick)
    reference = build_model(task, encoding, kernel, dropout=0.0, causal=causal, **sizes).train()
    tested = copy.deepcopy(reference).to(device)
    use_device_dape(tested, device)
    draws = reference.sample_draws(length)
    expected, got = on_cpu_and_device(reference, tested, device, inputs, targets[None], draws)
    name = f"{encoding} k={kernel or '-'}{' causal' if causal else ''}"
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
    """(a) device vs CPU for every encoding x kernel, and ``DAPE_VARIANTS``."""
    every_encoding = [
        case
        for encoding in list_encodings()
        for kernel in KERNELS
        for case in agreement_cases(encoding.name, kernel, device, quick)
    ]
    variants = [
        case
        for encoding, kernel, causal in DAPE_VARIANTS
        for case in agreement_cases(encoding, kernel, device, quick, causal)
    ]
    return every_encoding + variants


#: The checks in order: letter, title, function(device, quick).
CHECKS: tuple[tuple[str, str, Callable[[torch.device, bool], list[Case]]], ...] = (
    ("a", "device vs CPU, every encoding x kernel, DAPE V2 k = 5, 7, causal", check_agreement),
    ("b", "packs vs members alone, every built-in architecture", check_packs),
    ("c", "training follows the CPU loss curve", check_training),
    ("e", "deterministic mode repeats bit for bit", check_determinism),
    ("f", "every built-in architecture trains on the device as on the CPU", check_architectures),
    ("g", "evaluation on the device as on the CPU at a long length", check_evaluation),
    ("h", "a pack resumed from its checkpoint repeats the uninterrupted one", check_resume),
    (
        "i",
        "word problems and flip-flop train and score on the device as on the CPU",
        check_task_cases,
    ),
)


def run_selftest(
    device: torch.device,
    quick: bool,
    on_check: Callable[[str], None] | None = None,
    only: Collection[str] | None = None,
) -> SelftestReport:
    """Every check on ``device`` (TF32 off), or those whose letters ``only`` holds;
    ``on_check(title)`` is called as each starts."""
    from che_bench.run.device import describe_device

    started = time.perf_counter()
    prepare_deterministic_cublas()  # check (e) is deterministic; cuBLAS starts in check (a)
    configure_numerics(tf32=False)
    report = SelftestReport(describe_device(device), quick, software_versions())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for letter, title, check in CHECKS:
            if only is None or letter in only:
                if on_check is not None:
                    on_check(f"({letter}) {title}")
                report.cases.extend(check(device, quick))
        if only is None or SPEED in only:
            if on_check is not None:
                on_check(f"({SPEED}) step time and estimates")
            report.measurements.extend(measure_speed(device, quick))
    report.seconds = time.perf_counter() - started
    return report
