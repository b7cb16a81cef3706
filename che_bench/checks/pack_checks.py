"""Check (b) of the self-test: a pack computes, on the device, what its members compute alone.

A pack built from its members' weights (``stack_members``) must give each member's logits and
gradients of the summed token losses, within the tolerances of check (a), worst member: the
transformer for every encoding x DAPE kernel (quick: none and 3) in a pack of 4, and every other
built-in architecture (``built_in_architectures``; tiny in quick mode) in a pack of 4 (quick: 2).
A one-member LSTM alone runs the device's own path (cuDNN's kernel on a GPU), its pack the
batched loop. An error on the device fails that architecture's cases with the error's line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from che_bench.checks.architecture_check import build_small, built_in_architectures
from che_bench.checks.comparison import (
    GRADIENT_TOLERANCE,
    KERNELS,
    LOGITS_TOLERANCE,
    Case,
    forward_backward,
    model_sizes,
    relative_error,
    sample_batch,
)
from che_bench.checks.speed import TASK
from che_bench.encodings import list_encodings
from che_bench.errors import one_line
from che_bench.model.architectures import TRANSFORMER, get_architecture
from che_bench.model.base import BenchModel
from che_bench.model.encoder import build_model
from che_bench.model.packs import stack_members

#: DAPE kernels of the transformer's packs in quick mode (else ``KERNELS``).
QUICK_KERNELS = (None, 3)


def pack_cases(
    subject: str, alone: Sequence[BenchModel], inputs: torch.Tensor, targets: torch.Tensor
) -> list[Case]:
    """(b) for the models ``alone`` (on the device, built alike from their own seeds): the worst
    member's relative error, pack vs alone, of its logits and gradients on one batch; an error
    on the device fails both cases with its line."""
    members, worst, error = len(alone), [0.0, 0.0], ""
    try:
        pack = stack_members(alone).train()
        pack.seed_draws(range(members))
        packed = forward_backward(pack, inputs, targets.expand(members, -1, -1), None)
        for member, model in enumerate(alone):
            model.seed_draws([member])
            single = forward_backward(model, inputs, targets[None], None)
            for index in (0, 1):
                error_now = relative_error(packed[index][member], single[index][0])
                worst[index] = max(worst[index], error_now)
    except RuntimeError as exc:  # the device's kernels refused, or it ran out of memory
        worst, error = [math.inf, math.inf], one_line(exc)
    what = f"relative error, pack of {members} vs alone, worst member"
    return [
        Case("b", subject, "logits", worst[0], LOGITS_TOLERANCE, what, error),
        Case("b", subject, "gradients", worst[1], GRADIENT_TOLERANCE, what, error),
    ]


def transformer_pack_cases(
    encoding: str, kernel: int | None, device: torch.device, quick: bool, members: int = 4
) -> list[Case]:
    """(b) for the transformer with ``encoding`` and DAPE ``kernel``."""
    length, batch = (12, 4) if quick else (40, 16)
    task, inputs, targets = sample_batch(TASK, length, batch, seed=1)
    alone = []
    for seed in range(members):
        torch.manual_seed(seed)
        model = build_model(task, encoding, kernel, dropout=0.0, **model_sizes(quick))
        alone.append(model.to(device).train())
    subject = f"{encoding} k={kernel or '-'}"
    return pack_cases(subject, alone, inputs.to(device), targets.to(device))


def architecture_pack_cases(name: str, device: torch.device, quick: bool) -> list[Case]:
    """(b) for a built-in architecture other than the transformer, built as check (f) builds
    it (``build_small``), one member per seed."""
    length, batch, members = (12, 4, 2) if quick else (40, 16, 4)
    task, inputs, targets = sample_batch(TASK, length, batch, seed=1)
    alone = [build_small(name, task, quick, seed).to(device).train() for seed in range(members)]
    return pack_cases(get_architecture(name).label, alone, inputs.to(device), targets.to(device))


def check_packs(device: torch.device, quick: bool) -> list[Case]:
    """(b) for the transformer's encodings x kernels and every other built-in architecture."""
    kernels = QUICK_KERNELS if quick else KERNELS
    transformer = [
        case
        for encoding in list_encodings()
        for kernel in kernels
        for case in transformer_pack_cases(encoding.name, kernel, device, quick)
    ]
    others = [
        case
        for name in built_in_architectures()
        if name != TRANSFORMER
        for case in architecture_pack_cases(name, device, quick)
    ]
    return transformer + others
