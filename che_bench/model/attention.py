"""A layer of the CHE encoder: multi-head attention over chunks of query rows (with the
encoding's hook and an optional DAPE processor of the scores) and the post-LN block around it.

Without gradients (evaluation) attention runs over chunks of query rows sized from the memory
budget, so that no ``[M, B, ., T, T]`` map of the whole sequence is ever materialised; with
gradients everything is one chunk. With DAPE on a CPU (and nothing captured), every chunk's
default scores go into one buffer reused by the next chunk, and DAPE's logits, the mask and
the softmax are written over them in place: the same values, without the fresh full-size maps
whose page faults cost more than their arithmetic.

The hook may read the layer's input (``reads_input``), carry a bias per sequence
(``sequence_bias``: added in the scores' product, ``biased_scores``, since SDPA's fused CPU
kernel gives no gradient of a mask), compute its own scores, or replace the softmax
(``normalise``); the last three take the explicit maps (``che_bench.encodings.base``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from che_bench.encodings import AttentionHook
from che_bench.encodings.base import (
    biased_scores,
    own_normalisation,
    own_scores,
    prepare_hook,
    scaled_scores,
)
from che_bench.members import MemberLayerNorm, MemberLinear
from che_bench.model.dape import DapeProcessor
from che_bench.model.dropout import SequenceDropout
from che_bench.model.fused_attention import fused_attention, future_keys

FLOAT_BYTES = 4


def rows_per_chunk(batch: int, length: int, channels: int, budget_bytes: int) -> int:
    """Query rows whose ``[batch, channels, rows, length]`` float maps fit in the budget
    (``batch`` counts every member's sequences)."""
    return max(1, budget_bytes // (FLOAT_BYTES * batch * channels * length))


def times_values(probabilities: torch.Tensor, values_t: torch.Tensor) -> torch.Tensor:
    """``probabilities @ values`` (``[..., R, T] @ [..., T, d_h]``) given the values
    transposed, ``[..., d_h, T]``: taken as ``(v^T P^T)^T``, which MKL computes about four
    times faster than ``P v`` with d_h = 8 (8 rows instead of 8 columns), in other roundings."""
    return torch.matmul(values_t, probabilities.transpose(-1, -2)).transpose(-1, -2)


class Attention(nn.Module):
    """Multi-head attention calling the encoding's hook and then, optionally, DAPE.

    ``capture``: when a list (see ``Encoder.capture_attention``), every row chunk appends its
    maps (raw scores plus bias, DAPE logits, the weights: softmax probabilities or the hook's
    own ``normalise``) to it; the output is computed exactly as without it.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        hook: AttentionHook,
        dape: DapeProcessor | None,
        causal: bool,
        memory_budget_bytes: int,
        members: int = 1,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value, self.output = (
            MemberLinear(members, dim, dim, bias=False) for _ in range(4)
        )
        self.hook, self.dape, self.causal = hook, dape, causal
        self.memory_budget_bytes = memory_budget_bytes
        # Plain scores, the softmax and no processor: the fused kernel can take the bias as
        # a mask. A bias per sequence has a gradient in training, which SDPA's fused CPU
        # kernel does not give: its math path costs more than one product that adds the
        # bias (``biased_scores``); without gradients the fused kernel takes it.
        self.own_normalisation = own_normalisation(hook)
        self.plain_sum = hook.sequence_bias and not own_scores(hook)
        self.fused_without_gradients = (
            dape is None and not own_scores(hook) and not self.own_normalisation
        )
        self.fused = self.fused_without_gradients and not hook.sequence_bias
        self.capture: list[dict[str, torch.Tensor | None]] | None = None

    def transient_channels(self, device: torch.device) -> int:
        """Float maps of shape ``[M, B, ., R, T]`` alive per row chunk (an estimate): those the
        encoding's ``scores`` holds (many for CoPE and Transformer-XL), those its bias and
        normalisation hold beyond the softmax's (``extra_maps``), plus those after the scores."""
        after_scores = (
            self.dape.transient_channels(device) if self.dape is not None else 2 * self.heads
        )
        return (self.hook.score_maps + self.hook.extra_maps) * self.heads + after_scores

    def query_row_floats(self, length: int, device: torch.device) -> int:
        """Floats of one query row of one sequence (one member) over ``length`` keys: its
        transient maps' and the hook's per-sequence state (``state_floats``), the least an
        evaluation's forward pass can be split down to."""
        return self.transient_channels(device) * length + self.hook.state_floats(length)

    def forward(self, x: torch.Tensor, draw: Any = None) -> torch.Tensor:
        members, batch, length, dim = x.shape
        q, k, v = (
            proj(x).view(members, batch, length, self.heads, self.head_dim).transpose(2, 3)
            for proj in (self.query, self.key, self.value)
        )
        q, k, ctx = prepare_hook(self.hook, q, k, draw, x)
        if torch.is_grad_enabled():
            step = length
        else:
            channels = self.transient_channels(x.device)
            # The per-sequence state lives through every chunk: the chunks get the rest.
            state = FLOAT_BYTES * members * batch * self.hook.state_floats(length)
            budget = max(1, self.memory_budget_bytes - state)
            step = rows_per_chunk(members * batch, length, channels, budget)
        # The chunks' outputs go into one map as they come: kept apart until joined, each lay
        # among the next chunks' freed maps, splitting the allocator's free memory into pieces
        # too small for them (PaTH's evaluation at n = 500 held 0.4 GiB more that way).
        out = self._attend(q, k, v, slice(0, min(step, length)), ctx)
        if step < length:
            whole = out.new_empty(*out.shape[:-2], length, out.shape[-1])
            whole[..., :step, :] = out
            for start in range(step, length, step):
                rows = slice(start, min(start + step, length))
                whole[..., rows, :] = self._attend(q, k, v, rows, ctx)
            out = whole
        return self.output(out.transpose(2, 3).reshape(members, batch, length, dim))

    def _tiled(self, device: torch.device) -> bool:
        """Whether attention runs in DAPE's cache tiles: with DAPE's ``chunks`` filter and
        without gradients (on a CPU, a full-size map per row chunk costs more in trips to
        memory and page faults than its arithmetic). Capturing needs the explicit maps,
        so it takes them, with the tiles' product with the values."""
        return (
            self.dape is not None
            and not self.dape.uses_convolution(device)
            and not self.own_normalisation
            and not torch.is_grad_enabled()
        )

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice, ctx: Any
    ) -> torch.Tensor:
        """Attention output ``[M, B, H, R, d_h]`` of the query ``rows``."""
        length = k.shape[-2]
        bias = self.hook.bias(rows, length, ctx)
        future = future_keys(rows, length, q.device) if self.causal else None
        tiled = self._tiled(q.device)
        if tiled and self.capture is None:
            return self._attend_in_tiles(q, k, v, rows, ctx, bias, future)
        fused = self.fused_without_gradients if not torch.is_grad_enabled() else self.fused
        if not fused:  # custom scores or DAPE need the explicit map; SDPA cannot give it
            probabilities = self._maps(q, k, rows, ctx, bias, future)
            if tiled:
                return times_values(probabilities, v.transpose(-1, -2))
            return torch.matmul(probabilities, v)
        # SDPA scales q.k by 1/sqrt(d_h), then adds the mask: the same order as _maps
        out = fused_attention(q[..., rows, :], k, v, bias, future, rows.start)
        if self.capture is not None:
            self._maps(q, k, rows, ctx, bias, future)
        return out

    def _attend_in_tiles(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: slice,
        ctx: Any,
        bias: torch.Tensor | None,
        future: torch.Tensor | None,
    ) -> torch.Tensor:
        """``_attend`` tile by tile in cache (``_tiled``), with the values of ``_maps``: a
        tile's scores, DAPE's logits, the mask and the softmax are written over each other."""
        assert self.dape is not None
        members, batch, heads, _, head_dim = q.shape
        shape = torch.Size((batch, heads, rows.stop - rows.start, k.shape[-2]))
        scores = self.hook.scores(q, k, rows, ctx) if own_scores(self.hook) else None
        out = q.new_empty(members, batch, heads, shape[2], head_dim)
        for member in range(members):
            tile_filter = self.dape.tile_filter(member, bias, rows, shape)
            values_t = v[member].transpose(-1, -2).contiguous()
            buffer = q.new_empty(heads * tile_filter.tiles[0].columns)  # the largest tile
            for tile in tile_filter.tiles:
                sequences = tile.batch.stop - tile.batch.start
                logits = buffer[: heads * tile.columns].view(sequences, heads, -1, shape[3])
                if scores is None:
                    start = rows.start + tile.rows.start
                    tile_rows = slice(start, rows.start + tile.rows.stop)
                    scaled_scores(q[member, tile.batch], k[member, tile.batch], tile_rows, logits)
                else:
                    logits.copy_(scores[member, tile.batch, :, tile.rows])
                tile_filter.probabilities(logits, tile, future, rows.start)
                out[member, tile.batch, :, tile.rows] = times_values(logits, values_t[tile.batch])
        return out

    def _maps(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        rows: slice,
        ctx: Any,
        bias: torch.Tensor | None,
        future: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention weights of the query ``rows`` (the softmax, or the hook's own
        ``normalise``), computed explicitly (recorded in ``capture`` with the raw scores and
        the DAPE logits when capturing)."""
        raw: torch.Tensor | None
        if self.dape is None and bias is not None and self.plain_sum:
            logits = raw = biased_scores(q, k, rows, bias)
        elif self.dape is None:
            scores = self.hook.scores(q, k, rows, ctx)
            logits = raw = scores if bias is None else scores + bias
        else:  # the scores are DAPE's alone unless captured; their sum with the bias is unused
            scores = self.hook.scores(q, k, rows, ctx)
            raw = (scores if bias is None else scores + bias) if self.capture is not None else None
            logits = self.dape(scores, bias, rows)
        if self.own_normalisation:  # it takes the mask itself
            probabilities = self.hook.normalise(logits, rows, future, ctx)
        else:
            if future is not None:  # after every processor, never inside it
                logits = logits.masked_fill(future, -math.inf)
            probabilities = torch.softmax(logits, dim=-1)
        if self.capture is not None:
            self.capture.append(
                {
                    "scores": raw,
                    "logits": logits if self.dape is not None else None,
                    "probabilities": probabilities,
                }
            )
        return probabilities


class Block(nn.Module):
    """Post-LN transformer block: ``LN(h + drop(attn(h)))`` then ``LN(h + drop(ffn(h)))``."""

    attention: Attention

    def __init__(
        self, attention: Attention, dim: int, ffn: int, dropout: float, members: int = 1
    ) -> None:
        super().__init__()
        self.attention = attention
        self.attention_norm = MemberLayerNorm(members, dim)
        self.ffn = nn.Sequential(
            MemberLinear(members, dim, ffn), nn.ReLU(), MemberLinear(members, ffn, dim)
        )
        self.ffn_norm = MemberLayerNorm(members, dim)
        self.dropout = SequenceDropout(dropout)

    def forward(
        self,
        h: torch.Tensor,
        draw: Any = None,
        dropout_seeds: torch.Tensor | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``dropout_seeds``: evaluation dropout's per-sequence seeds (``che_bench.model.dropout``);
        ``layer`` tells this block's two dropout sites from the other blocks'."""
        attended = self.dropout(self.attention(h, draw), dropout_seeds, site=2 * layer + 1)
        h = self.attention_norm(h + attended)
        return self.ffn_norm(h + self.dropout(self.ffn(h), dropout_seeds, site=2 * layer + 2))
