"""DAPE's ``chunks`` filter without gradients (evaluation on a CPU), one cache tile at a time.

The attention computes a tile's scores (some sequences x query rows, ``tiles``), and
``TileFilter.probabilities`` turns them into the tile's attention probabilities in place
while they are in cache (the residual and f added, the future keys hidden when causal, the
softmax); the attention then multiplies them by the values, still in cache. No map of the
whole batch is ever built. The tiles are the training path's chunks
(``che_bench.model.dape.kernel``). With the native kernel (``che_bench.model.dape.native``)
or without it, the arithmetic is the one ``ScoreFilter`` trains with, and with the scores as
f's content the logits are bit for bit ``ScoreFilter``'s."""

from __future__ import annotations

import math

import torch

from che_bench.model.dape.kernel import (
    _add_taps,
    _cache_chunks,
    _Chunk,
    _ChunkBuffers,
    _first_layer,
    _im2col_matrix,
    _member_bias,
    _rows_of,
    _taps_matrix,
    batch_free_addend,
)
from che_bench.model.dape.native import Convolutions, native_filter, usable

Tile = _Chunk


def _member_rows(terms: torch.Tensor, member: int, rows: slice) -> torch.Tensor:
    """Member ``member``'s query ``rows`` of ``[M or 1, 1, H, R or 1, T or 1]`` terms."""
    member_terms = terms[member if terms.shape[0] > 1 else 0]
    return member_terms if member_terms.shape[-2] == 1 else member_terms[..., rows, :]


class TileFilter:
    """One member's ``logits = scores + residual + f(content; bias)`` for the tiles of a
    ``[B, H, R, T]`` row chunk (``shape``), in place.

    ``residual`` is ``[M or 1, 1, H, R or 1, T or 1]``, ``bias`` (f's bias channels)
    ``[M or 1, 1, C_b, R, T]`` or None; f's content is a tile's scores, plus ``added_bias``
    (``[M or 1, 1, H, R, T]``, DAPE's ``add_residual``) when given, zero where ``hidden``
    (``[R, T]``, DAPE's ``tril``) when given.
    """

    def __init__(
        self,
        member: int,
        shape: torch.Size,
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        residual: torch.Tensor,
        bias: torch.Tensor | None,
        added_bias: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        weight1, bias1, weight2 = (weight[member] for weight in weights)
        heads = shape[1]
        self.member, self.kernel, self.heads = member, weight1.shape[-1], heads
        self.residual, self.added_bias, self.hidden = residual, added_bias, hidden
        self.addend = batch_free_addend(_member_bias(bias, member), weight1, bias1, heads)
        self.conv1, self.conv2 = _im2col_matrix(weight1[:, :heads]), _taps_matrix(weight2)
        self.width = weight1.shape[0]
        # Rows outer: a row chunk's addend and residual (maps over the rows, shared by the
        # batch) stay in cache while every sequence's tile of those rows uses them.
        tiles = _cache_chunks(shape, self.width)
        self.tiles = sorted(tiles, key=lambda tile: (tile.rows.start, tile.batch.start))
        self.buffers = _ChunkBuffers(residual, self.tiles)
        self.native = native_filter() if weight1.dtype == torch.float32 else None
        if self.native is not None:
            self.native_weights = Convolutions.of(weight1[:, :heads], weight2)
            # The kernel reads the residual along the keys with unit stride (FIRE's bias,
            # for one, comes permuted): this member's, copied once.
            own = residual[member : member + 1] if residual.shape[0] > 1 else residual
            self.residual = own.contiguous()

    def add(self, scores: torch.Tensor, tile: Tile) -> torch.Tensor:
        """``scores`` of ``tile`` (contiguous ``[b, H, r, T]``) made its logits, in place."""
        self._logits(scores, tile, softmax=False, first_row=None)
        return scores

    def probabilities(
        self, scores: torch.Tensor, tile: Tile, future: torch.Tensor | None, first_row: int
    ) -> torch.Tensor:
        """``scores`` of ``tile`` made the attention's probabilities, in place: its logits,
        the keys where ``future`` (``[R, T]`` of the row chunk, whose first query row is
        ``first_row``) is True hidden, then the softmax over the keys."""
        causal_row = None if future is None else first_row + tile.rows.start
        if self._logits(scores, tile, softmax=True, first_row=causal_row):
            return scores
        if future is not None:
            scores.masked_fill_(future[tile.rows], -math.inf)
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)

    def _logits(
        self, scores: torch.Tensor, tile: Tile, softmax: bool, first_row: int | None
    ) -> bool:
        """The logits in place; True when the native kernel also took the ``softmax`` (causal
        from ``first_row`` when given)."""
        content = scores
        if self.added_bias is not None:
            content = scores + _member_rows(self.added_bias, self.member, tile.rows)
        if self.hidden is not None:
            content = content.masked_fill(self.hidden[tile.rows], 0.0)
        residual = _member_rows(self.residual, self.member, tile.rows)[0]
        if self.native is not None and usable(scores, content):
            addend = self.addend if self.addend.shape[1] == 1 else self.addend[:, tile.rows]
            weights = self.native_weights
            self.native.add(scores, content, residual, addend, weights, softmax, first_row)
            return softmax
        taps_rows = self.kernel * self.heads
        _, hidden = _first_layer(
            content,
            self.kernel,
            self.conv1,
            _rows_of(self.addend, tile.rows),
            self.buffers.scratch("windows", taps_rows, tile),
            self.buffers.scratch("hidden", self.width, tile),
        )
        taps = torch.mm(self.conv2, hidden, out=self.buffers.scratch("taps", taps_rows, tile))
        scores += residual
        _add_taps(scores, taps)
        return False
