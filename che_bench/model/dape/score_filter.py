"""DAPE's filter in training (``ScoreFilter``, an autograd function) on a CPU: the native
kernel's (``native_training``) where it trains (``training_kernel``), else the ``chunks``
implementation's (``kernel``). See ``che_bench.model.dape``."""

from __future__ import annotations

import torch

from che_bench.model.dape import native_training
from che_bench.model.dape.kernel import (
    KEEP_BYTES,
    _member_backward,
    _member_bias,
    _member_forward,
)
from che_bench.model.dape.native import NativeFilter, native_filter, usable

#: The widest key kernel whose weights' gradients the native kernel sums in registers.
WIDEST_NATIVE_KERNEL = 7


def training_kernel(kernel: int) -> NativeFilter | None:
    """The native kernel, where it trains DAPE V2's f with key kernel ``kernel`` (3 to
    ``WIDEST_NATIVE_KERNEL``), else None. DAPE's k = 1 keeps torch's products, which train it
    faster (docs/benchmarks.md)."""
    native = native_filter()
    return native if native is not None and 1 < kernel <= WIDEST_NATIVE_KERNEL else None


class ScoreFilter(torch.autograd.Function):
    """``scores + residual + Conv2(LeakyReLU(Conv1([content; bias]) + bias1))`` for every
    member, ``content`` None meaning the scores themselves, with a hand-written backward;
    ``residual`` (``[M, 1, H, R or 1, T or 1]``) and ``bias`` (``[M or 1, 1, C_b, R, T]``,
    or None) are shared by the batch. The logits are one fresh map: f is added in place.

    Forward and backward run member by member: by the native kernel row by row (its
    backward recomputes the hidden map; with the scores as f's content, the kernel also adds
    them, and the logits' gradient, in its rows), or by the chunks implementation over chunks
    whose hidden map (D_DAPE channels, the largest tensor by far) stays in cache; there the
    backward needs the forward's hidden maps again: they are kept when they fit in
    ``KEEP_BYTES`` per member (training lengths), else recomputed chunk by chunk. Autograd
    never sees the shifted views (whose gradients would be zero-filled full-size tensors).
    """

    @staticmethod
    def forward(ctx, scores, residual, content, bias, weight1, bias1, weight2, grad_enabled):
        own = content is None  # f's content is the scores
        content = scores if own else content
        native = None
        if grad_enabled and usable(scores, content) and weight1.dtype == torch.float32:
            native = training_kernel(weight1.shape[-1])
        fused = native is not None and own
        out = torch.empty_like(scores) if fused else scores + residual
        kept = _kept_maps(content, weight1) if grad_enabled and native is None else None
        addends = []
        for m in range(weight1.shape[0]):
            member = out[m], content[m], _member_bias(bias, m)
            weights = weight1[m], bias1[m], weight2[m]
            if native is None:
                addends.append(_member_forward(*member, weights, _of_member(kept, m)))
            else:
                terms = residual[m] if fused else None
                addends.append(native_training.member_forward(native, *member, weights, terms))
        ctx.native, ctx.own, ctx.residual_shape = native, own, residual.shape
        ctx.save_for_backward(content, bias, weight1, weight2, torch.stack(addends), *(kept or ()))
        return out

    @staticmethod
    def backward(ctx, grad):
        content, bias, weight1, weight2, addends, *kept = ctx.saved_tensors
        own, native = ctx.own, ctx.native
        if native is not None and not usable(grad):
            grad = grad.contiguous()
        needs_scores, needs_residual, needs_content, needs_bias = ctx.needs_input_grad[:4]
        needs = needs_content or (own and needs_scores), needs_bias
        plus_grad = own and native is not None  # the kernel adds the logits' gradient
        saved = content, bias, (weight1, weight2, addends), kept
        grads, summed = _member_gradients(grad, saved, needs, native, plus_grad)
        grad_content, grad_bias, grad_weight1, grad_bias1, grad_weight2 = grads
        if grad_bias is not None and bias.shape[0] == 1:  # one bias shared by the members
            grad_bias = grad_bias.sum(0, keepdim=True)
        grad_scores = grad
        if own:
            grad_scores = grad_content if plus_grad else grad + grad_content
            grad_content = None
        grad_residual = None
        if needs_residual:
            grad_residual = (grad if summed is None else summed).sum_to_size(ctx.residual_shape)
        return (
            grad_scores,
            grad_residual,
            grad_content,
            grad_bias,
            grad_weight1,
            grad_bias1,
            grad_weight2,
            None,
        )


def _member_gradients(grad, saved, needs, native, plus_grad) -> tuple[list, torch.Tensor | None]:
    """Every member's gradients (content, bias, weight1, bias1, weight2), each stacked over
    the members (one member's viewed, not copied: a full-size map for the content), from the
    ``saved`` content, bias, weights and kept maps; with the native kernel, also the logits'
    gradient summed over the batch (``[M, 1, H, R, T]``: the residual's), which it adds up
    as it goes (else None)."""
    content, bias, (weight1, weight2, addends), kept = saved
    members = weight1.shape[0]
    summed = None if native is None else grad.new_zeros(members, 1, *grad.shape[2:])
    grads: list[list] = [[] for _ in range(5)]
    for m in range(members):
        member = grad[m], content[m], _member_bias(bias, m)
        member_weights = weight1[m], weight2[m], addends[m]
        if native is None:
            member_grads = _member_backward(*member, member_weights, _of_member(kept, m), needs)
        else:
            assert summed is not None
            member_grads = native_training.member_backward(
                native, *member, member_weights, needs, plus_grad, summed[m, 0]
            )
        for collected, value in zip(grads, member_grads, strict=False):
            collected.append(value)
    stacked = [
        None if values[0] is None else values[0][None] if members == 1 else torch.stack(values)
        for values in grads
    ]
    return stacked, summed


def _kept_maps(
    content: torch.Tensor, weight1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The chunks' im2col matrices and hidden maps, kept for the backward of every member
    when they fit in ``KEEP_BYTES`` per member, else None (the backward recomputes them)."""
    width, kernel, heads = weight1.shape[1], weight1.shape[-1], content.shape[2]
    members, columns = content.shape[0], content[0, :, 0].numel()
    if 4 * (width + kernel * heads) * columns > KEEP_BYTES:
        return None
    return content.new_empty(members, kernel * heads * columns), content.new_empty(
        members, width * columns
    )


def _of_member(
    kept: tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor] | None, member: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Member ``member``'s part of the kept maps."""
    return None if not kept else (kept[0][member], kept[1][member])
