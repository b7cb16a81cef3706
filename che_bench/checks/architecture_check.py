"""Check (f) of the self-test: every built-in architecture trains on the device as on the CPU.

Each one (the registry's, plugins' left out) is built small, copied to the device and trained
a few plain gradient steps there and on the CPU side by side, from the same weights on the
same batch; every step's logits and gradients on the device must be the CPU's. The device
runs its own code path (a one-member LSTM: cuDNN's fused kernel on a GPU), the CPU the
batched loop; on a CPU the device copy is made to take the GPU's path (``use_device_path``),
so the check compares the two there too. An error on the device (cuDNN refusing a backward)
fails the architecture's cases with the error's line.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from che_bench.checks.comparison import (
    GRADIENT_TOLERANCE,
    LOGITS_TOLERANCE,
    QUICK_LAYERS,
    Case,
    model_sizes,
    on_cpu_and_device,
    relative_error,
    sample_batch,
)
from che_bench.checks.model_checks import TINY_RECURRENT
from che_bench.checks.speed import TASK
from che_bench.errors import CheBenchError, one_line
from che_bench.model.architectures import (
    ARCHITECTURES,
    TRANSFORMER,
    build_architecture,
    get_architecture,
)
from che_bench.model.base import BenchModel
from che_bench.model.recurrent.base import RecurrentModel
from che_bench.tasks import Task

#: Sizes of the quick check, for any option of these names an architecture takes (never
#: above its default); its dropout is always off (each device draws its own masks).
TINY_SIZES: dict[str, Any] = {
    **TINY_RECURRENT,
    **dict.fromkeys(("width", "dim", "d_model"), 16),
    **dict.fromkeys(("layers", "num_layers", "n_layers"), QUICK_LAYERS),
}
#: Plain gradient steps of the summed token losses, per token of the batch.
STEP_SIZE = 0.1


def built_in_architectures() -> list[str]:
    """Every registered architecture che-bench itself defines, in registration order."""
    return [name for name in ARCHITECTURES.names() if ARCHITECTURES.origin(name) is None]


def small_options(name: str, quick: bool) -> dict[str, Any]:
    """The options (f) builds ``name`` with: tiny sizes in quick mode (``TINY_SIZES`` for
    the options it takes), else its defaults; dropout off."""
    if name == TRANSFORMER:
        return {**model_sizes(quick), "dropout": 0.0}
    options: dict[str, Any] = {}
    for key, default in get_architecture(name).defaults.items():
        if quick and key in TINY_SIZES:
            tiny = TINY_SIZES[key]
            numbers = isinstance(default, int) and not isinstance(default, bool)
            options[key] = min(default, tiny) if numbers and isinstance(tiny, int) else tiny
        if "dropout" in key and isinstance(default, float):
            options[key] = 0.0
    return options


def build_small(name: str, task: Task, quick: bool, seed: int = 0) -> BenchModel:
    """``name`` with ``small_options``, or with only its dropout off where it refuses them
    (an option's tiny size may not suit another's default), initialised after
    ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    options = small_options(name, quick)
    try:
        return build_architecture(name, task, **options)
    except CheBenchError:
        torch.manual_seed(seed)
        dropout = {key: value for key, value in options.items() if "dropout" in key}
        return build_architecture(name, task, **dropout)


def use_device_path(model: BenchModel, device: torch.device) -> None:
    """Make ``model`` train on the path ``device`` takes, the GPU's on a CPU too (a
    one-member LSTM's fused kernel)."""
    for module in model.modules():
        if isinstance(module, RecurrentModel):
            module.fused_training = None if device.type == "cuda" else True


def architecture_cases(name: str, device: torch.device, quick: bool) -> list[Case]:
    """(f) for one architecture: the worst relative error of the device's logits and
    gradients against the CPU's over a few steps."""
    length, batch, steps = (12, 4, 3) if quick else (40, 16, 10)
    task, inputs, targets = sample_batch(TASK, length, batch, seed=2)
    reference = build_small(name, task, quick).train()
    tested = copy.deepcopy(reference).to(device)
    use_device_path(tested, device)
    draws = reference.sample_draws(length)
    step_size = STEP_SIZE / targets.numel()
    worst, error = [0.0, 0.0], ""
    try:
        for _ in range(steps):
            expected, got = on_cpu_and_device(
                reference, tested, device, inputs, targets[None], draws
            )
            for index in (0, 1):
                worst[index] = max(worst[index], relative_error(got[index], expected[index]))
            for model in (reference, tested):
                _gradient_step(model, step_size)
    except RuntimeError as exc:  # the device's kernels refused (cuDNN) or ran out of memory
        worst, error = [math.inf, math.inf], one_line(exc)
    subject = f"{get_architecture(name).label}, {steps} steps"
    what = "relative error vs the CPU's batched loop, worst step"
    return [
        Case("f", subject, "logits", worst[0], LOGITS_TOLERANCE, what, error),
        Case("f", subject, "gradients", worst[1], GRADIENT_TOLERANCE, what, error),
    ]


def _gradient_step(model: BenchModel, step_size: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.sub_(step_size * parameter.grad)


def check_architectures(device: torch.device, quick: bool) -> list[Case]:
    """(f) for every built-in architecture."""
    return [
        case
        for name in built_in_architectures()
        for case in architecture_cases(name, device, quick)
    ]
