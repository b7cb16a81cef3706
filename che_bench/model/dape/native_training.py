"""DAPE V2's f in training by the native kernel (``native.py``). The forward is the kernel's
rows, as at evaluation; nothing is kept for the backward, which goes chunk by chunk of query
rows whose maps stay in cache: the kernel recomputes each row's hidden map, takes the
gradients through it, and writes the hidden map, its gradient and their inputs out as
zero-padded rows (``[rows, channels, span]``), over which both weights' gradients are long
dot products. The batch-free terms (``bias1``, the bias channels) keep the chunks
filter's arithmetic (``kernel.bias_gradients``). See ``che_bench.model.dape``."""

from __future__ import annotations

import torch

from che_bench.model.dape.kernel import _adjoint, _cache_chunks, batch_free_addend, bias_gradients
from che_bench.model.dape.native import Convolutions, NativeFilter


def span_of(length: int, kernel: int, lanes: int) -> int:
    """Keys per written row: the keys and k // 2 zeros after them, in whole vectors."""
    return -(-(length + kernel // 2) // lanes) * lanes


def _padded_rows(
    like: torch.Tensor, leading: tuple[int, ...], channels: int, span: int, lanes: int
) -> torch.Tensor:
    """A ``[*leading, channels, span]`` buffer of rows; each ``leading[0]`` slice has ``lanes``
    zeros before and after it: what the weights' gradients read past the ends of its rows."""
    buffers, *rest = leading
    size = channels * span * int(torch.Size(rest).numel())
    flat = like.new_empty(buffers, size + 2 * lanes)
    flat[:, :lanes] = 0.0
    flat[:, -lanes:] = 0.0
    return flat[:, lanes:-lanes].view(*leading, channels, span)


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
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One member's ``out += f(content; bias)`` in place (as ``kernel._member_forward``), or
    with a ``residual`` (``[1, H, R, T]``, batch-free) ``out = content + (residual + f)``.
    Returns the first layer's batch-free addend."""
    weight1, bias1, weight2 = weights
    heads = content.shape[1]
    addend = batch_free_addend(bias, weight1, bias1, heads)
    terms = None if residual is None else residual[0].contiguous()  # unit stride along T
    convolutions = Convolutions.of(weight1[:, :heads], weight2)
    native.add(out, content, terms, addend, convolutions, onto_content=residual is not None)
    return addend


def _row_buffers(
    content: torch.Tensor, largest: int, width: int, span: int, lanes: int
) -> tuple[torch.Tensor, ...]:
    """Buffers of ``largest`` rows ``[rows, channels, span]`` for what a chunk writes: the
    hidden map and its gradient (read past their ends by the weights' gradients, so
    ``_padded_rows``), the content and the logits' gradient (``[B, H, R, T]`` ``content``)."""
    hidden = _padded_rows(content, (2, largest), width, span, lanes).unbind()
    return *hidden, *content.new_empty(2, largest, content.shape[1], span).unbind()


def member_backward(
    native: NativeFilter,
    grad: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    needs: tuple[bool, bool],
    plus_grad: bool = False,
    grad_summed: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One member's gradients (content, bias, weight1, bias1, weight2) of ``f`` (as
    ``kernel._member_backward``; ``weights``: ``weight1``, ``weight2`` and the first layer's
    batch-free addend); with ``plus_grad`` the content's plus ``grad``. ``grad_summed``
    (``[H, R, T]`` zeros), when given, receives ``grad`` summed over the batch."""
    weight1, weight2, addend = weights
    width, heads, kernel = weight1.shape[0], content.shape[1], weight1.shape[-1]
    length = content.shape[-1]
    grad_content = torch.empty_like(content)
    # The hidden pre-activation's gradient summed over the batch is the addend's.
    grad_addend = grad.new_zeros(width, *content.shape[2:])
    grad_weight2 = grad.new_zeros(heads, width, kernel)
    grad_conv1 = grad.new_zeros(heads, width, kernel)  # transposed, as weight_grads sums it
    conv1 = weight1[:, :heads]
    forward_weights = Convolutions.of(conv1, weight2)
    adjoints = Convolutions.of(_adjoint(weight2), _adjoint(conv1))
    chunks = _cache_chunks(content.shape, width)
    span = span_of(length, kernel, native.lanes)
    largest = chunks[0].columns // length  # rows
    hidden, grad_hidden, content_rows, grad_rows = _row_buffers(
        content, largest, width, span, native.lanes
    )
    sequences = chunks[0].batch.stop - chunks[0].batch.start  # the largest chunk's
    written = (
        _as_hidden(hidden, sequences),
        _as_maps(content_rows, sequences),
        _as_hidden(grad_hidden, sequences),
        _as_maps(grad_rows, sequences),
    )
    summed = grad_summed if grad_summed is not None else grad.new_zeros(grad.shape[1:])
    backward = native.backward_rows(
        grad_content,
        grad,
        (content, addend, forward_weights),
        adjoints,
        written,
        plus_grad,
        (summed, grad_addend),
    )
    for chunk in chunks:
        count = chunk.columns // length
        backward(chunk.batch, chunk.rows)
        native.weight_grads(grad_weight2, grad_rows[:count], hidden[:count], 1)
        native.weight_grads(grad_conv1, content_rows[:count], grad_hidden[:count], -1)
    grad_weight1 = torch.empty_like(weight1)
    grad_weight1[:, :heads] = grad_conv1.transpose(0, 1)
    grad_bias, grad_bias1 = bias_gradients(grad_addend, bias, weight1, grad_weight1, needs[1])
    wanted = needs[0] or plus_grad
    return grad_content if wanted else None, grad_bias, grad_weight1, grad_bias1, grad_weight2
