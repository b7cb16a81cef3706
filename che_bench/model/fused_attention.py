"""PyTorch's scaled-dot-product attention (SDPA) as the encoder calls it when the scores are
plain ``q.k`` plus an optional additive bias, shaped so that CUDA's fused kernels take it.

Those kernels (flash, memory-efficient) take 4-D tensors and a mask whose last dimension is
contiguous; any other call falls back to the math path, which materialises, and keeps for
the backward pass, every ``[B, H, R, T]`` map. A causal model without a bias needs no mask
at all: ``is_causal`` lets the kernels skip the blocks of future keys (about half the work)
instead of adding ``-inf`` to them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def future_keys(rows: slice, length: int, device: torch.device) -> torch.Tensor:
    """``[R, T]``: True where the key lies after the query (what a causal model hides)."""
    query = torch.arange(rows.start, rows.stop, device=device)[:, None]
    return torch.arange(length, device=device) > query


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    future: torch.Tensor | None,
    first_row: int,
) -> torch.Tensor:
    """Output ``[M, B, H, R, d_h]`` of the query rows ``q`` (``[M, B, H, R, d_h]``, starting
    at row ``first_row``) against ``k``, ``v``, with the encoding's ``bias`` (or None) and,
    in a causal model, the ``future`` keys of ``future_keys`` hidden."""
    if future is not None and bias is None and first_row == 0:
        # SDPA's causal mask is aligned top-left, so it is ours only from query row 0 on.
        return _members_attention(q, k, v, None, is_causal=True)
    mask = bias
    if future is not None:
        infinite = torch.zeros(future.shape, dtype=q.dtype, device=q.device)
        infinite = infinite.masked_fill(future, -math.inf)
        mask = infinite if bias is None else bias + infinite
    return _members_attention(q, k, v, mask, is_causal=False)


def _members_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA over ``[M, B, H, ., d_h]``, always called with 4-D tensors: a mask shared by the
    members (member axis 1, or none) lets the members join the batch axis; a mask of each
    member's own (``[M, b, H, R, T]``) makes them join the head axis instead,
    ``[B, M * H, ., d_h]``, so that a pack never falls back to the math path; a mask per
    sequence (``[M or 1, B, H or 1, R, T]``) makes them join the batch axis, with the mask."""
    members, batch, heads, rows, head_dim = q.shape
    if mask is not None and mask.dim() == 5 and mask.shape[1] > 1:  # a mask per sequence
        q, k, v = (x.reshape(members * batch, heads, x.shape[-2], head_dim) for x in (q, k, v))
        mask = mask.expand(members, -1, -1, -1, -1).reshape(members * batch, *mask.shape[2:])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_last_dim_contiguous(mask))
        return out.view(members, batch, heads, rows, head_dim)
    if mask is not None and mask.dim() == 5 and mask.shape[0] > 1:
        q, k, v = (
            x.transpose(0, 1).reshape(batch, members * heads, x.shape[-2], head_dim)
            for x in (q, k, v)
        )
        mask = mask.expand(members, mask.shape[1], heads, rows, mask.shape[-1])
        mask = mask.transpose(0, 1).reshape(mask.shape[1], members * heads, rows, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_last_dim_contiguous(mask))
        return out.view(batch, members, heads, rows, head_dim).transpose(0, 1)
    q, k, v = (x.reshape(members * batch, heads, x.shape[-2], head_dim) for x in (q, k, v))
    mask = mask[0] if mask is not None and mask.dim() == 5 else mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_last_dim_contiguous(mask), is_causal=is_causal
    )
    return out.view(members, batch, heads, rows, head_dim)


def _last_dim_contiguous(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask with unit stride along the keys, copied only when it has another (a bias
    made by a ``permute``, as FIRE's, or a sum that kept such a layout)."""
    if mask is None or mask.stride(-1) == 1:
        return mask
    return mask.contiguous()
