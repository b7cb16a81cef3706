"""DAPE's ``chunks`` implementation of f (the CPU filter without the native kernel): for each
member, f runs over chunks of (sequences, rows) whose hidden map fits a core's cache, as plain
matrix products on channel-major im2col matrices, forward and backward
(``score_filter.ScoreFilter`` is the autograd function). See ``che_bench.model.dape`` for what
f computes."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

NEGATIVE_SLOPE = 0.01
#: Target size of one chunk of the hidden map inside f (about a core's L2 cache).
CACHE_CHUNK_BYTES = 2 << 20
#: Backward reuses f's hidden map and im2col matrix when they take at most this much per
#: member (the training lengths); above it, it recomputes them chunk by chunk.
KEEP_BYTES = 64 << 20


def _key_windows(x: torch.Tensor, kernel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, C, R, T] -> [k*C, b*R*T]``, the im2col matrix of a ``1 x k`` key convolution,
    channel-major so that a whole chunk of sequences is one plain matrix product: block s
    holds ``x[..., j + s - k//2]``, 0 past either end of a row. Written into ``out`` if given."""
    batch, channels, rows, length = x.shape
    if out is None:
        out = x.new_empty(kernel * channels, batch * rows * length)
    windows = out.view(kernel, channels, batch, rows, length)
    source = x.transpose(0, 1)
    centre = kernel // 2
    windows[centre] = source
    for s in range(kernel):
        offset = s - centre
        inside = max(0, length - abs(offset))  # keys whose shifted key lies in the row
        if offset > 0:
            windows[s, ..., :inside] = source[..., offset : offset + inside]
            windows[s, ..., inside:] = 0.0
        elif offset < 0:
            windows[s, ..., length - inside :] = source[..., :inside]
            windows[s, ..., : length - inside] = 0.0
    return out


def _add_taps(out: torch.Tensor, taps: torch.Tensor, accumulate: bool = True) -> None:
    """``out[b, c, r, j] (+)= sum_s taps[s*C + c, (b, r, j + s - k//2)]`` (0 past the row
    ends); without ``accumulate`` the centre tap overwrites ``out``, so it may start empty.

    This is how a convolution with more input than output channels is applied: one product
    with all k taps at once, then k shifted additions of the narrow per-tap outputs.
    """
    batch, channels, rows, length = out.shape
    taps = taps.view(-1, channels, batch, rows, length).transpose(1, 2)
    centre = taps.shape[0] // 2
    if accumulate:
        out += taps[centre]
    else:
        out.copy_(taps[centre])
    for s in range(taps.shape[0]):
        offset = s - centre
        inside = max(0, length - abs(offset))  # keys whose shifted key lies in the row
        if offset > 0:
            out[..., :inside] += taps[s, ..., offset : offset + inside]
        elif offset < 0:
            out[..., length - inside :] += taps[s, ..., :inside]


def _im2col_matrix(weight: torch.Tensor) -> torch.Tensor:
    """``[O, C, k] -> [O, k*C]``, matching the block order of :func:`_key_windows`."""
    return weight.permute(0, 2, 1).reshape(weight.shape[0], -1)


def _taps_matrix(weight: torch.Tensor) -> torch.Tensor:
    """``[O, C, k] -> [k*O, C]``, row block s is tap s (as :func:`_add_taps` expects)."""
    return weight.permute(2, 0, 1).reshape(-1, weight.shape[1])


def _adjoint(weight: torch.Tensor) -> torch.Tensor:
    """The weight of the convolution's adjoint: swap in/out channels, mirror the taps."""
    return weight.transpose(0, 1).flip(-1)


class _Chunk(NamedTuple):
    """Sequences ``batch`` x query ``rows`` of the score map; its flattened (b, r, j) positions
    are the columns ``start .. start + columns`` of the whole map's."""

    batch: slice
    rows: slice
    start: int
    columns: int


def _cache_chunks(shape: torch.Size | tuple[int, ...], width: int) -> list[_Chunk]:
    """Chunks of a ``[B, C, R, T]`` map whose hidden map ``[width, b*r*T]`` stays cache-sized:
    whole sequences when one fits, else groups of query rows of one sequence at a time."""
    batch, _, rows, length = shape
    rows_per_chunk = max(1, CACHE_CHUNK_BYTES // (4 * width * length))
    if rows_per_chunk >= rows:
        step = max(1, rows_per_chunk // rows)
        spans = [(slice(b, min(b + step, batch)), slice(0, rows)) for b in range(0, batch, step)]
    else:
        spans = [
            (slice(b, b + 1), slice(r, min(r + rows_per_chunk, rows)))
            for b in range(batch)
            for r in range(0, rows, rows_per_chunk)
        ]
    chunks, start = [], 0
    for sequences, query_rows in spans:
        columns = (sequences.stop - sequences.start) * (query_rows.stop - query_rows.start) * length
        chunks.append(_Chunk(sequences, query_rows, start, columns))
        start += columns
    return chunks


def _named(kept: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The kept im2col matrix and hidden map (flat buffers) by their buffer names."""
    return {} if kept is None else {"windows": kept[0], "hidden": kept[1]}


class _ChunkBuffers:
    """Per-chunk matrices ``[rows, columns]`` carved out of flat buffers, so that chunks do not
    pay a fresh MB-sized allocation (and its page faults) each: a ``scratch`` buffer is reused
    by every chunk, a ``kept`` buffer holds all chunks side by side (to outlive the loop)."""

    def __init__(self, like: torch.Tensor, chunks: list[_Chunk], **kept: torch.Tensor) -> None:
        self.like, self.buffers = like, dict(kept)
        self.chunk_columns = chunks[0].columns  # the largest
        self.total_columns = chunks[-1].start + chunks[-1].columns

    def _flat(self, name: str, size: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = self.like.new_empty(size)
        return self.buffers[name]

    def scratch(self, name: str, rows: int, chunk: _Chunk) -> torch.Tensor:
        flat = self._flat(name, rows * self.chunk_columns)
        return flat[: rows * chunk.columns].view(rows, chunk.columns)

    def kept(self, name: str, rows: int, chunk: _Chunk) -> torch.Tensor:
        flat = self._flat(name, rows * self.total_columns)
        return flat[rows * chunk.start : rows * (chunk.start + chunk.columns)].view(rows, -1)


def _rows_of(addend: torch.Tensor, rows: slice) -> torch.Tensor:
    """The ``[D, r*T | 1]`` part of a ``[D, R, T]`` or ``[D, 1, 1]`` addend for query ``rows``."""
    return (addend if addend.shape[1] == 1 else addend[:, rows]).flatten(1)


def _first_layer(
    content: torch.Tensor,
    kernel: int,
    conv1: torch.Tensor,
    addend: torch.Tensor,
    windows_out: torch.Tensor,
    hidden_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The im2col matrix ``[k*C, n]`` of a chunk's ``content`` ``[b, C, r, T]`` and its
    activated hidden map ``[D, n]``, written into the given buffers; ``conv1`` is ``[D, k*C]``,
    ``addend`` the chunk's rows of the batch-free addend, ``[D, r*T | 1]``."""
    windows = _key_windows(content, kernel, windows_out)
    if addend.shape[1] in (1, windows.shape[1]):  # one sequence: the product adds it, no pass
        hidden = torch.addmm(addend, conv1, windows, out=hidden_out)
    else:
        hidden = torch.mm(conv1, windows, out=hidden_out)
        hidden.view(hidden.shape[0], -1, addend.shape[-1]).add_(addend[:, None])
    return windows, F.leaky_relu(hidden, NEGATIVE_SLOPE, inplace=True)


def batch_free_addend(
    bias: torch.Tensor | None, weight1: torch.Tensor, bias1: torch.Tensor, heads: int
) -> torch.Tensor:
    """The first convolution's batch-free part, ``[D, R, T]`` (``[D, 1, 1]`` without a bias):
    ``bias1`` plus the bias channels ``[1, C_b, R, T]`` through their columns of ``weight1``
    (``[D, heads + C_b, k]``), computed once for every sequence of the batch."""
    addend = bias1[:, None, None]
    if bias is not None:
        windows = _key_windows(bias, weight1.shape[-1])
        addend = torch.addmm(bias1[:, None], _im2col_matrix(weight1[:, heads:]), windows)
        addend = addend.view(-1, *bias.shape[2:])
    return addend


def _member_forward(
    out: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One member's ``out += f(content; bias)`` in place (``out``, ``content`` ``[B, C, R, T]``,
    ``bias`` ``[1, C_b, R, T]``, ``weights`` ``weight1``, ``bias1``, ``weight2``); writes f's
    im2col and hidden maps into ``kept`` (flat buffers) when given. Returns the first layer's
    batch-free addend, ``[D, R, T]`` or ``[D, 1, 1]``."""
    weight1, bias1, weight2 = weights
    kernel, width, heads = weight1.shape[-1], weight1.shape[0], content.shape[1]
    addend = batch_free_addend(bias, weight1, bias1, heads)
    conv1, conv2 = _im2col_matrix(weight1[:, :heads]), _taps_matrix(weight2)
    chunks = _cache_chunks(content.shape, width)
    buffers = _ChunkBuffers(content, chunks, **_named(kept))
    matrix = buffers.kept if kept is not None else buffers.scratch
    for chunk in chunks:
        _, hidden = _first_layer(
            content[chunk.batch, :, chunk.rows],
            kernel,
            conv1,
            _rows_of(addend, chunk.rows),
            matrix("windows", kernel * heads, chunk),
            matrix("hidden", width, chunk),
        )
        taps = torch.mm(conv2, hidden, out=buffers.scratch("taps", kernel * heads, chunk))
        _add_taps(out[chunk.batch, :, chunk.rows], taps)
    return addend


class _Adjoints(NamedTuple):
    """The weights of f's adjoint convolutions: the second's as an im2col matrix ``[D, k*H]``,
    the first's (content part) as a taps matrix ``[k*H, D]``."""

    conv2: torch.Tensor
    conv1: torch.Tensor

    @classmethod
    def of(cls, weight1: torch.Tensor, weight2: torch.Tensor) -> _Adjoints:
        adjoint2, adjoint1 = _adjoint(weight2), _adjoint(weight1[:, : weight2.shape[0]])
        return cls(_im2col_matrix(adjoint2), _taps_matrix(adjoint1))


def _member_backward(
    grad: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, torch.Tensor] | None,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One member's gradients (content, bias, weight1, bias1, weight2) of ``f`` (``weights``
    ``weight1``, ``weight2`` and the first layer's batch-free addend; ``needs`` says whether
    the content's and the bias's gradients are wanted); the hidden maps come from ``kept`` or
    are recomputed chunk by chunk."""
    weight1, weight2, addend = weights
    kernel, width, heads = weight1.shape[-1], weight1.shape[0], content.shape[1]
    conv1, adjoints = _im2col_matrix(weight1[:, :heads]), _Adjoints.of(weight1, weight2)
    grad_content = torch.empty_like(content) if needs[0] else None
    # The hidden pre-activation's gradient summed over the batch is the addend's.
    grad_addend = grad.new_zeros(width, *content.shape[2:])
    grad_conv1 = grad.new_zeros(kernel * heads, width)  # transposed: the faster product
    grad_conv2 = grad.new_zeros(kernel * heads, width)
    chunks = _cache_chunks(content.shape, width)
    buffers = _ChunkBuffers(content, chunks, **_named(kept))
    for chunk in chunks:
        windows, hidden = _hidden_maps(buffers, kept is not None, content, chunk, conv1, addend)
        grad_windows = _key_windows(  # shared by two products
            grad[chunk.batch, :, chunk.rows],
            kernel,
            buffers.scratch("grad_windows", kernel * heads, chunk),
        )
        grad_conv2.addmm_(grad_windows, hidden.t())
        grad_hidden = torch.mm(
            adjoints.conv2, grad_windows, out=buffers.scratch("grad_hidden", width, chunk)
        )
        # LeakyReLU keeps the sign, so the activated map tells where the slope was 0.01.
        torch.ops.aten.leaky_relu_backward.grad_input(
            grad_hidden, hidden, NEGATIVE_SLOPE, True, grad_input=grad_hidden
        )
        rows_addend = grad_addend[:, chunk.rows]
        rows_addend += grad_hidden.view(width, -1, *rows_addend.shape[1:]).sum(1)
        grad_conv1.addmm_(windows, grad_hidden.t())
        if grad_content is not None:
            taps = torch.mm(
                adjoints.conv1, grad_hidden, out=buffers.scratch("taps", kernel * heads, chunk)
            )
            _add_taps(grad_content[chunk.batch, :, chunk.rows], taps, accumulate=False)
    grad_weight1 = torch.empty_like(weight1)
    grad_weight1[:, :heads] = grad_conv1.view(kernel, heads, width).permute(2, 1, 0)
    grad_weight2 = grad_conv2.view(kernel, heads, width).flip(0).permute(1, 2, 0)
    grad_bias, grad_bias1 = bias_gradients(grad_addend, bias, weight1, grad_weight1, needs[1])
    return grad_content, grad_bias, grad_weight1, grad_bias1, grad_weight2


def _hidden_maps(
    buffers: _ChunkBuffers,
    kept: bool,
    content: torch.Tensor,
    chunk: _Chunk,
    conv1: torch.Tensor,
    addend: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's im2col matrix and hidden map for the backward: the forward's, when kept,
    else recomputed (``conv1`` is ``[D, k*H]``, the first convolution's content part)."""
    width, taps = conv1.shape
    if kept:
        return buffers.kept("windows", taps, chunk), buffers.kept("hidden", width, chunk)
    kernel = taps // content.shape[1]
    return _first_layer(
        content[chunk.batch, :, chunk.rows],
        kernel,
        conv1,
        _rows_of(addend, chunk.rows),
        buffers.scratch("windows", taps, chunk),
        buffers.scratch("hidden", width, chunk),
    )


def bias_gradients(
    grad_addend: torch.Tensor,
    bias: torch.Tensor | None,
    weight1: torch.Tensor,
    grad_weight1: torch.Tensor,
    needs_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gradients of f's batch-free terms from the addend's, ``grad_addend`` ``[D, R, T]``
    (the hidden pre-activation's summed over the batch): the bias's (when there is a bias
    and ``needs_bias``) and ``bias1``'s; the bias channels' columns of ``grad_weight1`` are
    filled in."""
    grad_bias1 = grad_addend.sum((1, 2))
    if bias is None:
        return None, grad_bias1
    width, kernel, heads = weight1.shape[0], weight1.shape[-1], weight1.shape[1] - bias.shape[1]
    grad_addend = grad_addend.flatten(1)
    bias_windows = _key_windows(bias, kernel)
    grad_weight1[:, heads:] = (
        (grad_addend @ bias_windows.t()).view(width, kernel, -1).permute(0, 2, 1)
    )
    if not needs_bias:
        return None, grad_bias1
    grad_bias = torch.empty_like(bias)
    bias_adjoint = _taps_matrix(_adjoint(weight1[:, heads:]))
    _add_taps(grad_bias, bias_adjoint @ grad_addend, accumulate=False)
    return grad_bias, grad_bias1


def _member_bias(bias: torch.Tensor | None, member: int) -> torch.Tensor | None:
    """Member ``member``'s ``[1, C_b, R, T]`` bias of a ``[M or 1, 1, C_b, R, T]`` one."""
    if bias is None:
        return None
    return bias[member if bias.shape[0] > 1 else 0]
