"""What the self-test's checks measure with: a ``Case`` (one comparison and its verdict), the
relative error of two tensors, one forward and backward pass, and the checks' batches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from che_bench.model.base import BenchModel
from che_bench.model.dape import DapeProcessor
from che_bench.settings import BY_NAME
from che_bench.tasks import Task, get_task
from che_bench.train.metrics import token_loss
from che_bench.train.step import teacher_targets

#: Relative error (``relative_error``) allowed between float32 logits / gradients computed by
#: two implementations or devices (TF32 off): rounding differences only.
LOGITS_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-3
#: DAPE kernels of the transformer's checks: none, DAPE (1), DAPE V2 (3).
KERNELS = (None, 1, 3)
#: Layers of the quick checks' models: the smoke preset's width, but two layers, so that a
#: layer's output feeds another.
QUICK_LAYERS = 2


def model_sizes(quick: bool) -> dict[str, int]:
    """The transformer of checks (a)-(c) and (f): tiny in quick mode, else the paper's size."""
    sizes = {
        name: BY_NAME[name].default_for("smoke" if quick else "paper")
        for name in ("layers", "dim", "heads", "ffn")
    }
    return {**sizes, "layers": QUICK_LAYERS} if quick else sizes


@dataclass
class Case:
    """One comparison: ``quantity`` of ``subject`` (e.g. the logits of "kerple k=3") differs
    from its reference by ``measured`` (see ``what``), which must not exceed ``tolerance``
    (0: bit-identical). ``error``: why nothing could be measured (``measured`` is then
    infinite: the case fails)."""

    check: str
    subject: str
    quantity: str
    measured: float
    tolerance: float
    what: str
    error: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.measured) and self.measured <= self.tolerance


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` in the Euclidean norm over all elements."""
    value, reference = value.detach().double().cpu(), reference.detach().double().cpu()
    return float((value - reference).norm() / reference.norm().clamp(min=1e-30))


def forward_backward(
    model: BenchModel, inputs: torch.Tensor, targets: torch.Tensor, draws: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[M, B, L, C]`` and every member's gradient ``[M, P]`` of the summed token
    losses, on the CPU."""
    model.zero_grad(set_to_none=True)
    logits = model(inputs, draws, **teacher_targets(model, targets))
    token_loss(logits, targets).sum().backward()
    members = model.members
    gradients = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(members, -1)
            for p in model.parameters()
        ],
        dim=1,
    )
    return logits.detach().cpu(), gradients.cpu()


def on_cpu_and_device(
    reference: BenchModel,
    tested: BenchModel,
    device: torch.device,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    draws: Any,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``forward_backward`` of ``reference`` on the CPU and of ``tested`` (its copy on
    ``device``) on the same inputs, targets and draws moved there: (expected, got)."""
    expected = forward_backward(reference, inputs, targets, draws)
    got = forward_backward(
        tested,
        inputs.to(device),
        targets.to(device),
        None if draws is None else draws.to(device),
    )
    return expected, got


def sample_batch(
    task_name: str, length: int, batch: int, seed: int = 0
) -> tuple[Task, torch.Tensor, torch.Tensor]:
    """``task_name``, and a batch of its inputs and targets at ``length`` (on the CPU)."""
    task = get_task(task_name)
    sample = task.sample(length, batch, np.random.default_rng(seed))
    return task, torch.from_numpy(sample.inputs.copy()), torch.from_numpy(sample.targets.copy())


def use_device_dape(model: BenchModel, device: torch.device) -> None:
    """Make ``model``'s DAPE use ``device``'s implementation, the GPU's on a CPU too."""
    for module in model.modules():
        if isinstance(module, DapeProcessor):
            module.implementation = "auto" if device.type == "cuda" else "convolution"
