"""DAPE's ``chunks`` filter without gradients (evaluation): f and the residual are added into
the score map in place, chunk by chunk, so that no further full-size map is allocated. The
arithmetic is the training path's (``che_bench.model.dape.kernel``), in the same order, so
the logits are bit for bit those of ``ScoreFilter``."""

from __future__ import annotations

import torch

from che_bench.model.dape.kernel import (
    _add_taps,
    _cache_chunks,
    _ChunkBuffers,
    _first_layer,
    _im2col_matrix,
    _member_bias,
    _taps_matrix,
    batch_free_addend,
)


def _member_rows(terms: torch.Tensor, member: int, rows: slice) -> torch.Tensor:
    """Member ``member``'s query ``rows`` of ``[M or 1, 1, H, R or 1, T or 1]`` terms."""
    member_terms = terms[member if terms.shape[0] > 1 else 0]
    return member_terms if member_terms.shape[-2] == 1 else member_terms[..., rows, :]


def add_filter_in_place(
    logits: torch.Tensor,
    content: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor,
    weight2: torch.Tensor,
) -> torch.Tensor:
    """``logits += residual + f(content; bias)`` in place, member by member and chunk by chunk
    of (sequences, rows), and return ``logits`` (``[M, B, H, R, T]``). ``content`` (same shape)
    may be ``logits`` itself: a chunk's content is copied into its im2col matrix before the
    chunk's logits are written, and no chunk reads another's rows. ``bias`` is
    ``[M or 1, 1, C_b, R, T]`` or None, ``residual`` ``[M or 1, 1, H, R or 1, T or 1]``."""
    heads = content.shape[2]
    for m in range(weight1.shape[0]):
        kernel, width = weight1.shape[-1], weight1.shape[1]
        addend = batch_free_addend(_member_bias(bias, m), weight1[m], bias1[m], heads)
        conv1, conv2 = _im2col_matrix(weight1[m, :, :heads]), _taps_matrix(weight2[m])
        chunks = _cache_chunks(content[m], width)
        buffers = _ChunkBuffers(content[m], chunks)
        for chunk in chunks:
            _, hidden = _first_layer(
                content[m],
                chunk,
                kernel,
                conv1,
                addend,
                buffers.scratch("windows", kernel * heads, chunk),
                buffers.scratch("hidden", width, chunk),
            )
            taps = torch.mm(conv2, hidden, out=buffers.scratch("taps", kernel * heads, chunk))
            out = logits[m, chunk.batch, :, chunk.rows]
            out += _member_rows(residual, m, chunk.rows)
            _add_taps(out, taps)
    return logits
