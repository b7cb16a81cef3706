"""DAPE and DAPE V2: learned processors of the pre-softmax attention scores.

Given the scaled scores ``S`` ``[B, H, R, T]`` of ``R`` query rows and, for encodings that
carry one, the additive positional bias ``Bias`` ``[1, H, R, T]``, the processor returns the
logits that go into the softmax (variant ``concat_residual``, the default)::

    logits = S + Bias + f([S; Bias])
    f(Z)   = Conv_{D->H}( LeakyReLU( Conv_{C->D}(Z) ) )

Both convolutions have a ``1 x k`` kernel along the KEY axis (zero "same" padding, with
biases), so query rows never mix and chunking over rows is exact. ``k = 1`` is DAPE (a
two-layer MLP over the score channels at every (i, j)); odd ``k >= 3`` is DAPE V2, whose
output at (i, j) sees keys ``j-(k-1) .. j+(k-1)`` of row i.

Layout: the heads are the channels and the scores arrive channel-first, ``[B, C, R, T]``.
A key-axis convolution is then a matrix product ``[O, k*C] @ [B, k*C, R*T]`` over the
flattened (row, key) plane, which avoids any permute copy. The first convolution stacks the
k shifted copies of its (narrow) input; the second multiplies once by all k taps and adds the
k shifted (narrow) outputs. The batch-free bias channels go through the first convolution
once and are broadcast over the batch, never tiled. The hidden map (D_DAPE channels) is only
ever built for cache-sized chunks of (sequences, rows) and recomputed in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.errors import CheBenchError

VARIANTS = ("concat_residual", "concat", "add_residual")
NEGATIVE_SLOPE = 0.01
#: Target size of one batch chunk of the hidden map inside f (fits a core's L2/L3 cache).
CACHE_CHUNK_BYTES = 4 << 20


def check_kernel(kernel: object) -> int:
    """Validate a DAPE kernel size (1 = DAPE, odd >= 3 = DAPE V2) and return it."""
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise CheBenchError(
            f"DAPE kernel must be a positive odd integer (1 = DAPE, 3/5/7 = DAPE V2), got {kernel!r}"
        )
    return kernel


def check_variant(variant: str) -> str:
    """Validate a DAPE variant name and return it."""
    if variant not in VARIANTS:
        raise CheBenchError(f"unknown dape_variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return variant


def _stack_shifted_keys(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[B, C, R, T] -> [B, k*C, R*T]``; block s holds ``x[..., j + s - k//2]`` (0 outside)."""
    if kernel == 1:
        return x.flatten(2)
    batch, channels, rows, length = x.shape
    stack = x.new_zeros(batch, kernel, channels, rows, length)  # one memset covers the edges
    centre = kernel // 2
    for s in range(kernel):
        offset = s - centre
        if offset >= 0:
            stack[:, s, ..., : length - offset] = x[..., offset:]
        else:
            stack[:, s, ..., -offset:] = x[..., : length + offset]
    return stack.view(batch, kernel * channels, rows * length)


def key_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    addend: torch.Tensor | None = None,
    stack: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bias-free ``1 x k`` convolution along the key axis with zero "same" padding.

    ``x [B, C, R, T]``, ``weight [O, C, k]``, optional ``addend`` broadcastable to the output
    ``[B, O, R, T]`` (added for free), optional ``stack``: ``x``'s shifted stack if already
    built. The narrower side is the one that gets shifted: either
    the input (k shifted copies, one product) or the output (one product with all k taps,
    then k shifted in-place additions).
    """
    out_channels, in_channels, kernel = weight.shape
    batch, _, rows, length = x.shape
    if kernel == 1 or in_channels <= out_channels:
        matrix = weight.permute(0, 2, 1).reshape(out_channels, kernel * in_channels)
        columns = _stack_shifted_keys(x, kernel) if stack is None else stack
        matrix = matrix.expand(batch, -1, -1)  # bmm on a stride-0 batch beats matmul's path
        if addend is None:
            out = torch.bmm(matrix, columns)
        else:
            # [O, 1, 1] -> [O, 1] or [1|B, O, R, T] -> [1|B, O, R*T]: broadcastable either way
            out = torch.baddbmm(addend.flatten(-2), matrix, columns)
        return out.view(batch, out_channels, rows, length)
    matrix = weight.permute(2, 0, 1).reshape(kernel * out_channels, in_channels)
    taps = torch.bmm(matrix.expand(batch, -1, -1), x.flatten(2))
    taps = taps.view(batch, kernel, out_channels, rows, length)
    centre = kernel // 2
    out = taps[:, centre].clone() if addend is None else taps[:, centre] + addend
    for s in range(kernel):  # output key j gets tap s evaluated at key j + s - centre
        offset = s - centre
        if offset > 0:
            out[..., : length - offset] += taps[:, s, ..., offset:]
        elif offset < 0:
            out[..., -offset:] += taps[:, s, ..., : length + offset]
    return out


def _key_conv_weight_grad(
    grad: torch.Tensor, x: torch.Tensor, kernel: int, grad_stack: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient ``[O, C, k]`` of ``key_conv(x, weight)`` given the output gradient ``grad``.

    ``dW[o, c, s] = sum_{b,r,j} grad[b, o, r, j] * x[b, c, r, j + s - k//2]``; the narrower
    of the two tensors is the one shifted (``grad_stack``: grad's shifted stack, if built).
    """
    out_channels, in_channels = grad.shape[1], x.shape[1]
    if in_channels <= out_channels:
        product = torch.bmm(grad.flatten(2), _stack_shifted_keys(x, kernel).transpose(1, 2))
        return product.sum(0).view(out_channels, kernel, in_channels).permute(0, 2, 1)
    # grad shifted by -(s - k//2) is block k-1-s of grad's shifted stack.
    if grad_stack is None:
        grad_stack = _stack_shifted_keys(grad, kernel)
    product = torch.bmm(grad_stack, x.flatten(2).transpose(1, 2))
    product = product.sum(0).view(kernel, out_channels, in_channels).flip(0)
    return product.permute(1, 2, 0)


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    """The weight of the convolution's adjoint: swap in/out channels, mirror the taps."""
    return weight.transpose(0, 1).flip(-1)


def _cache_chunks(content: torch.Tensor, width: int) -> list[tuple[slice, slice]]:
    """(batch, row) chunks whose hidden map ``[b, width, r, T]`` stays cache-sized: whole
    sequences when one fits, else groups of query rows of one sequence at a time."""
    batch, _, rows, length = content.shape
    row_bytes = 4 * width * length
    rows_per_chunk = max(1, CACHE_CHUNK_BYTES // row_bytes)
    if rows_per_chunk >= rows:
        step = max(1, rows_per_chunk // rows)
        return [(slice(b, b + step), slice(None)) for b in range(0, batch, step)]
    return [
        (slice(b, b + 1), slice(r, r + rows_per_chunk))
        for b in range(batch)
        for r in range(0, rows, rows_per_chunk)
    ]


def _rows_of(addend: torch.Tensor, rows: slice) -> torch.Tensor:
    """The addend restricted to query ``rows`` (a per-channel ``[O, 1, 1]`` addend has none)."""
    return addend[:, :, rows] if addend.dim() == 4 else addend


class _ScoreFilter(torch.autograd.Function):
    """``f = Conv2(LeakyReLU(Conv1(x) + addend)) + bias2`` with a hand-written backward.

    The hidden map (D_DAPE channels, the largest tensor by far) is never stored: forward and
    backward run over small batch chunks whose hidden map stays in cache, and backward
    recomputes it. This keeps DAPE from being bound by memory traffic, and autograd never
    sees the shifted views (whose gradients would be zero-filled full-size tensors).
    """

    @staticmethod
    def _hidden(content, addend, weight1):
        return F.leaky_relu(key_conv(content, weight1, addend), NEGATIVE_SLOPE, inplace=True)

    @staticmethod
    def forward(ctx, content, addend, weight1, weight2, bias2):  # type: ignore[override]
        out = content.new_empty(content.shape[0], weight2.shape[0], *content.shape[2:])
        for batch, rows in _cache_chunks(content, weight1.shape[0]):
            hidden = _ScoreFilter._hidden(content[batch, :, rows], _rows_of(addend, rows), weight1)
            out[batch, :, rows] = key_conv(hidden, weight2, bias2[:, None, None])
        ctx.save_for_backward(content, addend, weight1, weight2)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        content, addend, weight1, weight2 = ctx.saved_tensors
        kernel = weight1.shape[-1]
        grad = grad.contiguous()
        grad_content = torch.empty_like(content) if ctx.needs_input_grad[0] else None
        grad_addend = torch.zeros_like(addend)
        grad_weight1, grad_weight2 = torch.zeros_like(weight1), torch.zeros_like(weight2)
        for batch, rows in _cache_chunks(content, weight1.shape[0]):
            chunk = (batch, slice(None), rows)
            addend_rows = _rows_of(addend, rows)
            hidden = _ScoreFilter._hidden(content[chunk], addend_rows, weight1)
            grad_out = grad[chunk]
            grad_stack = _stack_shifted_keys(grad_out, kernel)  # shared by two products
            grad_weight2 += _key_conv_weight_grad(grad_out, hidden, kernel, grad_stack)
            # LeakyReLU keeps the sign, so the activated map tells where the slope was 0.01.
            grad_hidden = torch.ops.aten.leaky_relu_backward(
                key_conv(grad_out, _transposed(weight2), stack=grad_stack),
                hidden,
                NEGATIVE_SLOPE,
                True,
            )
            if addend.dim() == 4:
                grad_addend[:, :, rows] += grad_hidden.sum_to_size(addend_rows.shape)
            else:
                grad_addend += grad_hidden.sum_to_size(addend.shape)
            grad_weight1 += _key_conv_weight_grad(grad_hidden, content[chunk], kernel)
            if grad_content is not None:
                grad_content[chunk] = key_conv(grad_hidden, _transposed(weight1))
        grad_bias2 = grad.sum((0, 2, 3))
        return grad_content, grad_addend, grad_weight1, grad_weight2, grad_bias2


class DapeProcessor(nn.Module):
    """Per-layer DAPE (``kernel=1``) or DAPE V2 (odd ``kernel >= 3``) score processor.

    Args:
        heads: number of attention heads H (the score channels).
        kernel: key-axis kernel size k.
        width: hidden channels D_DAPE of f.
        variant: ``concat_residual`` (S + Bias + f([S; Bias])), ``concat`` (S + f([S; Bias]))
            or ``add_residual`` (S + Bias + f(S + Bias)).
        with_bias: the encoding carries an additive bias, so f sees it (2H channels for the
            concat variants); without it every variant is ``S + f(S)``.
        tril: zero the entries with key j > query i of f's input (the residual keeps them);
            this is what makes DAPE V2 leak-free in a causal model.
    """

    def __init__(
        self,
        heads: int,
        kernel: int,
        width: int = 32,
        variant: str = "concat_residual",
        with_bias: bool = False,
        tril: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.kernel, self.width = heads, check_kernel(kernel), width
        self.variant, self.with_bias, self.tril = check_variant(variant), with_bias, tril
        if width < 1:
            raise CheBenchError(f"dape_width must be >= 1, got {width!r}")
        self.concat_bias = with_bias and variant != "add_residual"
        in_channels = 2 * heads if self.concat_bias else heads
        self.weight1 = nn.Parameter(torch.empty(width, in_channels, kernel))
        self.bias1 = nn.Parameter(torch.empty(width))
        self.weight2 = nn.Parameter(torch.empty(heads, width, kernel))
        self.bias2 = nn.Parameter(torch.empty(heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default Conv2d/Linear initialisation (uniform, fan-in = channels * k)."""
        for weight, bias in ((self.weight1, self.bias1), (self.weight2, self.bias2)):
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            bound = 1 / math.sqrt(weight.shape[1] * weight.shape[2])
            nn.init.uniform_(bias, -bound, bound)

    def transient_channels(self) -> int:
        """Full-size maps ``[B, ., R, T]`` alive at once per row chunk (an estimate: scores,
        filter input, residual, filter output, logits, probabilities). The hidden map of f
        only ever exists for a few sequences at a time."""
        return 6 * self.heads

    def forward(
        self, scores: torch.Tensor, bias: torch.Tensor | None = None, rows: slice | None = None
    ) -> torch.Tensor:
        """Logits ``[B, H, R, T]`` from scores ``[B, H, R, T]`` and bias ``[1, H, R, T]``.

        ``rows`` locates the chunk's query rows (needed only by ``tril``).
        """
        if (bias is not None) != self.with_bias:
            raise CheBenchError(
                f"DAPE processor built with with_bias={self.with_bias} got bias={bias is not None}"
            )
        num_rows, length = scores.shape[-2:]
        if bias is not None and self.variant != "concat":
            residual = scores + bias
        else:
            residual = scores
        content = residual if self.variant == "add_residual" else scores
        if self.tril:
            start = 0 if rows is None or rows.start is None else rows.start
            query = torch.arange(start, start + num_rows, device=scores.device)[:, None]
            future = torch.arange(length, device=scores.device) > query
            content = content.masked_fill(future, 0.0)
            bias = bias.masked_fill(future, 0.0) if self.concat_bias else bias

        addend = self.bias1[:, None, None]  # broadcast over batch, rows and keys
        if self.concat_bias:  # the batch-free bias channels pass the first conv once
            addend = addend + key_conv(bias, self.weight1[:, self.heads :])
        weight1 = self.weight1[:, : content.shape[1]]
        return residual + _ScoreFilter.apply(content, addend, weight1, self.weight2, self.bias2)
