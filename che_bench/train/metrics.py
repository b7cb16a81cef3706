"""What a step or an evaluation counts: the loss per member, correct positions and
exactly right sequences, and the check of a batch's token ids (shared by training and
evaluation)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Task


def check_token_ids(inputs: np.ndarray, task: Task) -> None:
    """Input ids must lie in ``0..input_size-1`` (checked on the host, before any copy)."""
    if inputs.size and (inputs.min() < 0 or inputs.max() >= task.input_size):
        raise CheBenchError(f"input ids must lie in 0..{task.input_size - 1}")


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy per output token, averaged over batch and positions, per member: logits
    ``[M, B, L, C]`` and targets ``[M, B, L]`` -> ``[M]``. Not masked (the CHE reference), or
    with ``mask`` (``[M, B, L]`` or ``[B, L]``) averaged over its positions only."""
    members = logits.shape[0]
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(members, -1)
    if mask is None:
        return per_token.mean(1)
    weights = mask.expand(targets.shape).reshape(members, -1).to(per_token.dtype)
    return (per_token * weights).sum(1) / weights.sum(1).clamp(min=1)


def masked_counts(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct masked-in positions and masked-in positions per member (device tensors ``[M]``);
    ``targets`` and ``mask`` are ``[M, B, L]`` or ``[B, L]`` (shared by the members)."""
    hits = (logits.argmax(-1) == targets) & mask
    counted = mask.expand_as(hits)
    return hits.flatten(1).sum(1), counted.flatten(1).sum(1)


def exact_counts(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences with every masked-in position right, and sequences with any masked-in
    position, per member (device tensors ``[M]``); shapes as in ``masked_counts``."""
    wrong = (logits.argmax(-1) != targets) & mask
    scored = mask.expand_as(wrong).any(-1)
    return (scored & ~wrong.any(-1)).sum(-1), scored.sum(-1)


def prefix_counts(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per member and output position t, the sequences whose every masked-in position
    0..t is right (DeltaProduct's cumulative sequence accuracy before the mean; a sequence
    with no masked-in position up to t counts as right there): ``[M, L]``, shapes as in
    ``masked_counts``."""
    wrong = (logits.argmax(-1) != targets) & mask
    return (wrong.cumsum(-1) == 0).sum(-2)
