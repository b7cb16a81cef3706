"""DAPE V2's f in training by the native kernel (``native.py``): the forward writes each query
row's activated hidden map and its content out, zero-padded to ``span`` keys, row after row
(``[M, B*R, channels, span]``); the backward takes the gradients through the hidden map row by
row, then both weights' gradients as dot products over the written rows, chunk by chunk of
rows while they are in cache. The batch-free terms (``bias1``, the bias channels) keep the
chunks filter's arithmetic (``kernel.bias_gradients``). See ``che_bench.model.dape``."""

from __future__ import annotations

import torch

from che_bench.model.dape.kernel import _adjoint, _cache_chunks, batch_free_addend, bias_gradients
from che_bench.model.dape.native import NativeFilter


def span_of(length: int, kernel: int, lanes: int) -> int:
    """Keys per written row: the keys and k // 2 zeros after them, in whole vectors."""
    return -(-(length + kernel // 2) // lanes) * lanes


def kept_floats(shape: torch.Size, width: int, kernel: int, lanes: int) -> int:
    """Floats of one member's written rows for ``[B, H, R, T]`` maps."""
    batch, heads, rows, length = shape
    return batch * rows * (width + heads) * span_of(length, kernel, lanes)


def _padded_rows(
    like: torch.Tensor, leading: tuple[int, ...], channels: int, span: int, lanes: int
) -> torch.Tensor:
    """A ``[*leading, channels, span]`` buffer of rows; each ``leading[0]`` slice has ``lanes``
    zeros before and after it: what the weights' gradients read past the ends of its rows."""
    members, *rest = leading
    size = channels * span * int(torch.Size(rest).numel())
    flat = like.new_empty(members, size + 2 * lanes)
    flat[:, :lanes] = 0.0
    flat[:, -lanes:] = 0.0
    return flat[:, lanes:-lanes].view(*leading, channels, span)


def kept_rows(
    content: torch.Tensor, width: int, kernel: int, lanes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the forward writes for the backward, for ``[M, B, H, R, T]`` content: the
    hidden map ``[M, B*R, D, span]`` and the content ``[M, B*R, H, span]``."""
    members, batch, heads, rows, length = content.shape
    span = span_of(length, kernel, lanes)
    leading = members, batch * rows
    return (
        _padded_rows(content, leading, width, span, lanes),
        _padded_rows(content, leading, heads, span, lanes),
    )


def _as_hidden(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``[b*r, D, S]`` rows as the kernel's ``[D, b, r, S]`` hidden map (a view)."""
    return rows.view(batch, -1, *rows.shape[1:]).permute(2, 0, 1, 3)


def _as_maps(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``[b*r, H, S]`` rows as ``[b, H, r, S]`` maps (a view)."""
    return rows.view(batch, -1, *rows.shape[1:]).transpose(1, 2)


def member_forward(
    native: NativeFilter,
    out: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One member's ``out += f(content; bias)`` in place (as ``kernel._member_forward``),
    writing its rows into ``kept`` (``kept_rows``' of the member) when given. Returns the
    first layer's batch-free addend."""
    weight1, bias1, weight2 = weights
    batch, heads = content.shape[:2]
    addend = batch_free_addend(bias, weight1, bias1, heads)
    written = None if kept is None else (_as_hidden(kept[0], batch), _as_maps(kept[1], batch))
    convolutions = weight1[:, :heads].contiguous(), weight2.contiguous()
    native.add(out, content, None, addend, convolutions, kept=written)
    return addend


def member_backward(
    native: NativeFilter,
    grad: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, torch.Tensor],
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One member's gradients (content, bias, weight1, bias1, weight2) of ``f`` (as
    ``kernel._member_backward``) from the rows its forward wrote (``kept``), so the
    addend (``weights``' third) is not needed again."""
    weight1, weight2 = weights[:2]
    width, heads, kernel = weight1.shape[0], content.shape[1], weight1.shape[-1]
    hidden_rows, content_rows = kept
    grad_content = torch.empty_like(content)
    # The hidden pre-activation's gradient summed over the batch is the addend's.
    grad_addend = grad.new_zeros(width, *content.shape[2:])
    grad_weight2 = grad.new_zeros(heads, width, kernel)
    grad_conv1 = grad.new_zeros(heads, width, kernel)  # transposed, as weight_grads sums it
    adjoints = _adjoint(weight2).contiguous(), _adjoint(weight1[:, :heads]).contiguous()
    chunks = _cache_chunks(content.shape, width)
    length, span = content.shape[-1], hidden_rows.shape[-1]
    largest = chunks[0].columns // length  # rows
    grad_hidden_rows = _padded_rows(grad, (1, largest), width, span, native.lanes)[0]
    grad_rows = grad.new_empty(largest, heads, span)
    for chunk in chunks:
        sequences, count = chunk.batch.stop - chunk.batch.start, chunk.columns // length
        first = chunk.batch.start * content.shape[2] + chunk.rows.start
        rows = slice(first, first + count)
        written = grad_hidden_rows[:count], grad_rows[:count]
        native.backward(
            grad_content[chunk.batch, :, chunk.rows],
            grad[chunk.batch, :, chunk.rows],
            _as_hidden(hidden_rows[rows], sequences),
            adjoints,
            (_as_hidden(written[0], sequences), _as_maps(written[1], sequences)),
        )
        summed = written[0].view(sequences, -1).sum(0).view(-1, width, span)[..., :length]
        grad_addend[:, chunk.rows] += summed.transpose(0, 1)
        native.weight_grads(grad_weight2, written[1], hidden_rows[rows], 1)
        native.weight_grads(grad_conv1, content_rows[rows], written[0], -1)
    grad_weight1 = torch.empty_like(weight1)
    grad_weight1[:, :heads] = grad_conv1.transpose(0, 1)
    grad_bias, grad_bias1 = bias_gradients(grad_addend, bias, weight1, grad_weight1, needs[1])
    return grad_content if needs[0] else None, grad_bias, grad_weight1, grad_bias1, grad_weight2
