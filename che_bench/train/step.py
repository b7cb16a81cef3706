"""One training step of a pack: forward, loss and backward (in micro-batches where that keeps
a CPU's passes at a single run's size), then the optimizer and Kerple's projection."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from che_bench.config import RunConfig
from che_bench.encodings.base import Draws
from che_bench.model.base import BenchModel
from che_bench.settings import BFLOAT16
from che_bench.train.metrics import token_loss
from che_bench.train.optimizer import PackOptimizer


def training_step(
    model: BenchModel,
    optimizer: PackOptimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    projected: Sequence[Projected],
    micro_batches: int = 1,
    loss_mask: torch.Tensor | None = None,
    draws: Draws | None = None,
    lengths: torch.Tensor | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of every member: forward, per-member loss, backward, clipped Adam,
    projection of constrained parameters. Returns (losses ``[M]``, logits), on the device.
    ``loss_mask`` (like ``targets``): the positions the loss counts (default: all).
    ``draws``: the randomized encoding's sample, drawn with the batch (default: drawn here).
    ``lengths``: a mixed-length batch's input tokens per sequence (``BenchModel.reads_lengths``).
    ``autocast``: the forward pass and loss under autocast to this dtype (bf16, the xLSTM
    harness's), the weights, gradients and update in float32.

    ``micro_batches`` > 1 splits the batch (every member's sequences alike) into that many
    forward/backward passes whose gradients add up to the whole batch's (the loss is a mean
    over sequences, so each part is weighted by its share); one random draw serves them all.
    On a CPU this keeps a pack's working set that of a single run: the step is memory-bound
    there, and a pack four times as wide no longer fits the caches a single run fits in.
    """
    if draws is None:
        draws = model.sample_draws(inputs.shape[-1])
    optimizer.zero_grad()
    with autocast_to(autocast, inputs.device):
        if micro_batches <= 1:  # the GPU's step: no operator spent on splitting
            logits = model(inputs, draws, **forward_keywords(model, targets, lengths))
            losses = token_loss(logits.float(), targets, loss_mask)
            losses.sum().backward()  # members are independent: each gets its own gradient
            losses, logits = losses.detach(), logits.detach().float()
        else:
            losses, logits = _micro_batched_backward(
                model, inputs, targets, loss_mask, draws, micro_batches, lengths
            )
    optimizer.step()
    for module in projected:
        module.project_()
    return losses, logits


def _micro_batched_backward(
    model: BenchModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None,
    draws: Any,
    micro_batches: int,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward in ``micro_batches`` passes, each weighted by its share of the
    batch; the whole batch's (losses, logits), detached."""
    batch = inputs.shape[1]
    losses, logits = [], []
    for rows in micro_batch_rows(batch, micro_batches):
        share = (rows.stop - rows.start) / batch
        keywords = forward_keywords(
            model, targets[:, rows], None if lengths is None else lengths[rows]
        )
        part_logits = model(inputs[:, rows], draws, **keywords).float()
        part_losses = token_loss(
            part_logits, targets[:, rows], None if loss_mask is None else loss_mask[:, rows]
        )
        (part_losses.sum() * share).backward()
        losses.append(part_losses.detach() * share)
        logits.append(part_logits.detach())
    return torch.stack(losses).sum(0), torch.cat(logits, dim=1)


def teacher_targets(model: BenchModel, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The targets, as keyword, for a model trained with teacher forcing (``uses_targets``)."""
    return {"targets": targets} if model.uses_targets else {}


def forward_keywords(
    model: BenchModel, targets: torch.Tensor, lengths: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The training forward's keywords: the teacher's targets, a mixed batch's lengths."""
    keywords = teacher_targets(model, targets)
    return keywords if lengths is None else {**keywords, "lengths": lengths}


def training_autocast(config: RunConfig) -> torch.dtype | None:
    """The dtype a run's training forward autocasts to (``train_precision``); None: float32."""
    return torch.bfloat16 if config.train_precision == BFLOAT16 else None


def autocast_to(
    dtype: torch.dtype | None, device: torch.device
) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``'s kind, or nothing (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def micro_batch_rows(batch: int, parts: int) -> list[slice]:
    """``parts`` (at most ``batch``) contiguous row ranges covering ``batch`` rows, the first
    ``batch % parts`` one row longer (``torch.tensor_split``'s split, in plain integers)."""
    parts = min(parts, batch)
    size, longer = divmod(batch, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (part < longer))
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def micro_batches_for(members: int, device: torch.device) -> int:
    """Passes per training step: on a CPU one per member, so that each pass holds as many
    sequences as a single run's step (see ``training_step``); on a GPU one, the widest."""
    return members if device.type == "cpu" else 1


class Projected(Protocol):
    """A module whose parameters are projected after every optimizer step."""

    def project_(self) -> None: ...


def projected_modules(model: torch.nn.Module) -> list[Projected]:
    """The modules whose parameters are projected after every step (Kerple's positivity)."""
    return [cast(Projected, module) for module in model.modules() if hasattr(module, "project_")]
