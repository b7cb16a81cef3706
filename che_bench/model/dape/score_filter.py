"""DAPE's filter in training (``ScoreFilter``, the ``chunks`` implementation's autograd
function) and the native kernel's part in it: each chunk's forward and its backward through
f's hidden map, where the kernel gives the chunks' own arithmetic's bits (``training_kernel``).
See ``che_bench.model.dape``."""

from __future__ import annotations

import functools

import torch

from che_bench.model.dape.kernel import (
    KEEP_BYTES,
    _member_backward,
    _member_bias,
    _member_forward,
)
from che_bench.model.dape.native import NativeFilter, native_filter


def training_kernel(heads: int, width: int, kernel: int) -> NativeFilter | None:
    """The native kernel, where it trains DAPE V2's f (``heads`` score channels, ``width``
    hidden ones, key kernel ``kernel`` >= 3) with the bits of the chunks' arithmetic, else
    None (training then keeps that arithmetic). The kernel sums in the order of torch's
    matrix products on the CPUs checked (in order, with fused multiply-adds); whether it
    gives their bits here is checked once per process, kernel, shape and thread count, on a
    small map. DAPE's k = 1 keeps torch's products, which train it faster (docs/benchmarks.md)."""
    native = native_filter()
    if native is None or kernel == 1:
        return None
    bits = _gives_chunks_bits(native, heads, width, kernel, torch.get_num_threads())
    return native if bits else None


@functools.cache
def _gives_chunks_bits(
    native: NativeFilter, heads: int, width: int, kernel: int, threads: int
) -> bool:
    """Whether ``native`` trains f with the chunks' bits: forward and gradients on a small
    map with bias channels (``threads`` is the cache's key: torch's products may split by
    thread)."""
    generator = torch.Generator().manual_seed(0)
    content, grad = torch.randn(2, 2, heads, 3, 37, generator=generator)
    bias = torch.randn(1, heads, 3, 37, generator=generator)
    weight1 = torch.randn(width, 2 * heads, kernel, generator=generator)
    bias1 = torch.randn(width, generator=generator)
    weight2 = torch.randn(heads, width, kernel, generator=generator)
    results = []
    for candidate in (None, native):
        out, columns = content.clone(), content[:, 0].numel()
        kept = {
            "windows": content.new_empty(kernel * heads * columns),
            "hidden": content.new_empty(width * columns),
        }
        addend = _member_forward(out, content, bias, (weight1, bias1, weight2), kept, candidate)
        gradients = _member_backward(
            grad, content, bias, (weight1, weight2, addend), kept, (True, True), candidate
        )
        results.append([out, *gradients])
    return all(map(torch.equal, *results))


class ScoreFilter(torch.autograd.Function):
    """``out += Conv2(LeakyReLU(Conv1([content; bias]) + bias1))`` in place for every member
    (``out`` is a fresh map, so no further full-size map is allocated), with a hand-written
    backward; ``bias`` (``[M or 1, 1, C_b, R, T]``, or None) is shared by the batch.

    Forward and backward run member by member over chunks whose hidden map (D_DAPE
    channels, the largest tensor by far) stays in cache. Backward needs the hidden map and
    the im2col matrix of every chunk again: they are kept when they fit in ``KEEP_BYTES``
    (training lengths) and recomputed chunk by chunk otherwise. Autograd never sees the
    shifted views (whose gradients would be zero-filled full-size tensors).
    """

    @staticmethod
    def forward(ctx, out, content, bias, weight1, bias1, weight2, grad_enabled):
        members, width, kernel = weight1.shape[0], weight1.shape[1], weight1.shape[-1]
        heads, per_member_columns = content.shape[2], content[0, :, 0].numel()
        keep_floats = (width + kernel * heads) * per_member_columns
        keep = grad_enabled and 4 * keep_floats <= KEEP_BYTES
        kept_windows = (
            content.new_empty(members, kernel * heads * per_member_columns) if keep else None
        )
        kept_hidden = content.new_empty(members, width * per_member_columns) if keep else None
        addends, native = [], _training_kernel(content, weight1)
        for m in range(members):
            kept = {"windows": kept_windows[m], "hidden": kept_hidden[m]} if keep else None
            weights = weight1[m], bias1[m], weight2[m]
            member_bias = _member_bias(bias, m)
            addends.append(_member_forward(out[m], content[m], member_bias, weights, kept, native))
        ctx.mark_dirty(out)
        ctx.save_for_backward(
            content, bias, weight1, weight2, torch.stack(addends), kept_windows, kept_hidden
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        content, bias, weight1, weight2, addends, kept_windows, kept_hidden = ctx.saved_tensors
        needs_content, needs_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        members, native = weight1.shape[0], _training_kernel(grad, weight1)
        grads: list[list] = [[] for _ in range(5)]
        for m in range(members):
            kept = (
                None
                if kept_hidden is None
                else {"windows": kept_windows[m], "hidden": kept_hidden[m]}
            )
            weights = weight1[m], weight2[m], addends[m]
            needs = needs_content, needs_bias
            member_bias = _member_bias(bias, m)
            member_grads = _member_backward(
                grad[m], content[m], member_bias, weights, kept, needs, native
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
    keys are longer than two of the kernel's vectors, else None: on shorter rows, whose
    vectors are partly empty, torch's products are as fast (docs/benchmarks.md)."""
    if maps.dtype != torch.float32 or weight1.dtype != torch.float32:
        return None
    native = training_kernel(maps.shape[2], weight1.shape[1], weight1.shape[-1])
    return native if native is not None and maps.shape[-1] > 2 * native.lanes else None
