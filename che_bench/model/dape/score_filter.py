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
from che_bench.model.dape.native import NativeFilter, native_filter

#: The widest key kernel whose weights' gradients the native kernel sums in registers.
WIDEST_NATIVE_KERNEL = 7


def training_kernel(kernel: int) -> NativeFilter | None:
    """The native kernel, where it trains DAPE V2's f with key kernel ``kernel`` (3 to
    ``WIDEST_NATIVE_KERNEL``), else None. DAPE's k = 1 keeps torch's products, which train it
    faster (docs/benchmarks.md)."""
    native = native_filter()
    return native if native is not None and 1 < kernel <= WIDEST_NATIVE_KERNEL else None


class ScoreFilter(torch.autograd.Function):
    """``out += Conv2(LeakyReLU(Conv1([content; bias]) + bias1))`` in place for every member
    (``out`` is a fresh map, so no further full-size map is allocated), with a hand-written
    backward; ``bias`` (``[M or 1, 1, C_b, R, T]``, or None) is shared by the batch.

    Forward and backward run member by member: by the native kernel row by row, or by the
    chunks implementation over chunks whose hidden map (D_DAPE channels, the largest tensor
    by far) stays in cache. Backward needs the forward's hidden maps again: they are kept
    when they fit in ``KEEP_BYTES`` per member (training lengths); otherwise the chunks
    implementation recomputes them chunk by chunk. Autograd never sees the shifted views
    (whose gradients would be zero-filled full-size tensors).
    """

    @staticmethod
    def forward(ctx, out, content, bias, weight1, bias1, weight2, grad_enabled):
        native = _training_kernel(content, weight1) if grad_enabled else None
        kept = _kept_maps(content, weight1, native) if grad_enabled else None
        addends = []
        for m in range(weight1.shape[0]):
            member = out[m], content[m], _member_bias(bias, m)
            weights, member_kept = (weight1[m], bias1[m], weight2[m]), _of_member(kept, m)
            if native is None:
                addends.append(_member_forward(*member, weights, member_kept))
            else:
                addends.append(
                    native_training.member_forward(native, *member, weights, member_kept)
                )
        ctx.mark_dirty(out)
        ctx.native = native
        ctx.save_for_backward(content, bias, weight1, weight2, torch.stack(addends), *(kept or ()))
        return out

    @staticmethod
    def backward(ctx, grad):
        content, bias, weight1, weight2, addends, *kept = ctx.saved_tensors
        needs = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        members, native = weight1.shape[0], ctx.native
        grads: list[list] = [[] for _ in range(5)]
        for m in range(members):
            member = grad[m], content[m], _member_bias(bias, m)
            weights, member_kept = (weight1[m], weight2[m], addends[m]), _of_member(kept, m)
            if native is None:
                member_grads = _member_backward(*member, weights, member_kept, needs)
            else:
                member_grads = native_training.member_backward(
                    native, *member, weights, member_kept, needs
                )
            for collected, value in zip(grads, member_grads, strict=False):
                collected.append(value)
        # One member's gradients are viewed, not copied (a full-size map for the content).
        grad_content, grad_bias, grad_weight1, grad_bias1, grad_weight2 = (
            None if values[0] is None else values[0][None] if members == 1 else torch.stack(values)
            for values in grads
        )
        if grad_bias is not None and bias.shape[0] == 1:  # one bias shared by the members
            grad_bias = grad_bias.sum(0, keepdim=True)
        return grad, grad_content, grad_bias, grad_weight1, grad_bias1, grad_weight2, None


def _training_kernel(maps: torch.Tensor, weight1: torch.Tensor) -> NativeFilter | None:
    """``training_kernel`` for float32 ``[M, B, H, R, T]`` maps and ``weight1`` whose rows of
    keys are longer than two of the kernel's vectors and whose written rows fit in
    ``KEEP_BYTES`` per member, else None: on shorter rows, whose vectors are partly empty,
    torch's products are as fast (docs/benchmarks.md)."""
    if maps.dtype != torch.float32 or weight1.dtype != torch.float32:
        return None
    native = training_kernel(weight1.shape[-1])
    if native is None or maps.shape[-1] <= 2 * native.lanes:
        return None
    width, kernel = weight1.shape[1], weight1.shape[-1]
    floats = native_training.kept_floats(maps.shape[1:], width, kernel, native.lanes)
    return native if 4 * floats <= KEEP_BYTES else None


def _kept_maps(
    content: torch.Tensor, weight1: torch.Tensor, native: NativeFilter | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the forward keeps for the backward, for every member: the native kernel's
    written rows, or the chunks' im2col matrices and hidden maps when they fit in
    ``KEEP_BYTES`` per member (else None)."""
    width, kernel = weight1.shape[1], weight1.shape[-1]
    if native is not None:
        return native_training.kept_rows(content, width, kernel, native.lanes)
    members, columns = content.shape[0], content[0, :, 0].numel()
    if 4 * (width + kernel * content.shape[2]) * columns > KEEP_BYTES:
        return None
    windows = content.new_empty(members, kernel * content.shape[2] * columns)
    return windows, content.new_empty(members, width * columns)


def _of_member(
    kept: tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor] | None, member: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Member ``member``'s part of the kept maps."""
    return None if not kept else (kept[0][member], kept[1][member])
