"""PaTH's attention scores (Yang et al., NeurIPS 2025, arXiv 2505.16381): keys seen through an
accumulated product of data-dependent Householder-like matrices. The mathematics only; the
parameters that make ``w_t, beta_t`` from the layer input are ``path_parameters``.

Definition (spec ``data_dependent_encodings.md`` §2; per head, ``d = d_h``, ``scale = d^-1/2``)::

    H_t = I - beta_t w_t w_t^T       (||w_t|| = 1; beta in (0, 2): eigenvalue 1 - beta in (-1, 1))
    s_ij = scale * q_i^T (H_i H_{i-1} ... H_{j+1}) k_j     for j <= i (empty product at j = i)

``H_j`` itself is not in the product, ``H_i`` is, next to ``q_i``. This is fla's decode
recurrence: when token t arrives every earlier key becomes ``k <- H_t k``, then ``k_t`` joins
untransformed and query t scores against all of them (``path_scores_recurrent``, the oracle).

**Bidirectional form** (che-bench's, spec §2 [D]): keys right of the query go through a second
set ``H'_t = I - beta'_t w'_t w'_t^T`` (its own parameters, ``w'`` from an anti-causal
convolution), mirrored::

    s_ij = scale * q_i^T (H'_i H'_{i+1} ... H'_{j-1}) k_j        for j > i

positions ``s in [i, j)``: the query's end included and the key's excluded, exactly the causal
``(j, i]`` read backwards. Reversing time turns it into the causal form of the reversed
sequences, which is how it is computed; the diagonal (``q_i . k_i``) is the same in both.

**Fast form** (UT transform of Joffrain et al. 2006 as used by PaTH §3.3 and fla's
``fla/ops/path_attn/naive.py``; the algebra below is [D]). For tokens ``a..b`` in order,
``H_b ... H_a = I - W^T T W`` with ``W`` the rows ``w_a..w_b`` and the lower-triangular
``T = (I + L)^-1 diag(beta)``, ``L_sr = beta_s w_s . w_r`` for ``r < s``. Because ``I + L`` is
unit lower-triangular, the inverse of a contiguous diagonal block of it is that block of the
inverse, so one ``T`` per block of ``C`` tokens serves every sub-range inside it. Split the
(zero-padded: ``w = 0`` gives ``H = I``) sequence into blocks of ``C``; then

* same block (``j <= i``): ``s_ij = q_i.k_j - sum_{j < r <= s <= i} (q_i.w_s) T_sr (w_r.k_j)``,
  i.e. ``tril(Q K^T) - tril(Q W^T) V`` with ``V = (I + L)^-1 diag(beta) strict_tril(W K^T)``
  (one triangular solve);
* key block ``J`` left of the query's block ``I``:
  ``s_ij = q^_i^T P_{I-1} ... P_{J+1} k^_j`` with the block products ``P_J = I - W_J^T Y_J``,
  ``Y = (I + L)^-1 diag(beta) W``, the query carried back to its block's start,
  ``q^ = Q - tril(Q W^T) Y`` (``= (H_i ... H_start)^T q_i``), and the key carried to its block's
  end, ``k^ = K - V^T W`` (``= H_end ... H_{j+1} k_j``).

``prepare_path`` computes, once per layer, the in-block scores ``[..., T, C]``, ``q^``, ``k^``
``[..., T, d]`` and the ``d x d`` block products; ``PreparedPath.scores(rows)`` then walks the
key blocks from the query's leftwards, carrying each query row through one ``P_J`` per block
(fla's ``q_i <- q_i - q_i H_mat``), so that a chunk of R query rows costs ``O(R T d + R (T/C)
d^2)`` time and ``O(R T)`` memory, under autograd too, against the plain recurrence's ``O(T^2
d)`` stored per head. Everything is exact: the same sums in another order (float32 rounding;
``T`` stays bounded since every partial product of ``H``'s has norm <= 1 for beta in [0, 2]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from che_bench.encodings.common import autocast_off, query_positions, running_sum

#: Tokens per block of the UT transform (fla's naive reference uses 64). The in-block work grows
#: as ``T C^2``, the walk over key blocks as ``T^2 d / C`` steps of ``d x d``; a training batch
#: (n <= 41) is one block.
BLOCK = 64


class Householders(NamedTuple):
    """The factors ``H_t = I - beta_t w_t w_t^T`` of one direction: ``w [..., T, d]`` (unit rows),
    ``beta [..., T]``, in natural time order for either direction."""

    w: Tensor
    beta: Tensor


@dataclass
class CausalPath:
    """One direction's tensors prepared once per layer (shapes per head, ``Tp`` = T padded to a
    multiple of ``block``): ``local [..., Tp, C]`` each query's scores over its own block (zero
    right of the diagonal), and with more than one block ``queries`` q^ ``[..., Tp, d]``,
    ``keys`` k^ ``[..., Tp/C, C, d]``, ``transitions`` the block products ``[..., Tp/C, d, d]``."""

    length: int
    block: int
    local: Tensor
    queries: Tensor | None
    keys: Tensor | None
    transitions: Tensor | None

    def scores(self, rows: slice) -> Tensor:
        """Unscaled ``q_i^T H_i ... H_{j+1} k_j`` of query ``rows`` (a slice of step 1) over all
        keys, ``[..., R, T]``, zero right of the diagonal."""
        start, stop, _ = rows.indices(self.length)
        block = self.block
        own = query_positions(slice(start, stop), self.length, self.local.device) // block
        last = (stop - 1) // block  # the key blocks 0..last hold every key j <= i
        local = self.local[..., start:stop, None, :]  # [..., R, 1, C]
        key_blocks = torch.arange(last + 1, device=own.device)
        same = (key_blocks[None, :] == own[:, None])[..., None]  # [R, last + 1, 1]
        if last == 0:
            by_block = local.expand(*local.shape[:-2], 1, block)
        else:
            earlier = (key_blocks[None, :] < own[:, None])[..., None]
            cross = self._cross_blocks(start, stop, own, last)  # [..., R, last, C]
            cross = F.pad(cross, (0, 0, 0, 1))  # block `last` is never left of a query's own
            by_block = torch.where(same, local, torch.where(earlier, cross, 0.0))
        flat = by_block.flatten(-2)
        width = flat.shape[-1]
        return (
            flat[..., : self.length]
            if width >= self.length
            else F.pad(flat, (0, self.length - width))
        )

    def _cross_blocks(self, start: int, stop: int, own: Tensor, last: int) -> Tensor:
        """``[..., R, last, C]``: row i's scores over key block J for every ``J < last``, valid
        where ``J`` is left of row i's own block (the rest is discarded by the caller)."""
        assert self.queries is not None and self.keys is not None and self.transitions is not None
        carried = start_of_walk = self.queries[..., start:stop, :]  # [..., R, d]
        per_block = []
        for key_block in range(last - 1, -1, -1):
            if key_block < last - 1:  # through block key_block + 1, or start at its own
                starts = (own == key_block + 1)[:, None]
                moved = carried @ self.transitions[..., key_block + 1, :, :]
                carried = torch.where(starts, start_of_walk, moved)
            per_block.append(carried @ self.keys[..., key_block, :, :].transpose(-1, -2))
        return torch.stack(per_block[::-1], dim=-2)


def prepare_causal(q: Tensor, k: Tensor, factors: Householders, block: int = BLOCK) -> CausalPath:
    """The causal form's prepared tensors for ``q, k [..., T, d]``, in fp32 (fp64 stays fp64)."""
    length, dim = q.shape[-2:]
    size = min(block, length)
    blocks = -(-length // size)
    pad = blocks * size - length
    dtype = torch.promote_types(q.dtype, torch.float32)

    def blocked(x: Tensor) -> Tensor:  # [..., T, d] -> [..., blocks, C, d], zero-padded
        return F.pad(x.to(dtype), (0, 0, 0, pad)).unflatten(-2, (blocks, size))

    q_b, k_b, w_b = blocked(q), blocked(k), blocked(factors.w)
    beta = F.pad(factors.beta.to(dtype), (0, pad)).unflatten(-1, (blocks, size))[..., None]
    # I + L, L_sr = beta_s w_s.w_r (r < s); the unit diagonal is implied by `unitriangular`.
    lower = torch.tril((beta * w_b) @ w_b.transpose(-1, -2), -1)
    query_w = torch.tril(q_b @ w_b.transpose(-1, -2))  # q_i.w_s, s <= i
    w_keys = torch.tril(w_b @ k_b.transpose(-1, -2), -1)  # w_r.k_j, r > j
    solved = torch.linalg.solve_triangular(lower, beta * w_keys, upper=False, unitriangular=True)
    local = (torch.tril(q_b @ k_b.transpose(-1, -2)) - query_w @ solved).flatten(-3, -2)
    if blocks == 1:
        return CausalPath(length, size, local, None, None, None)
    carry = torch.linalg.solve_triangular(lower, beta * w_b, upper=False, unitriangular=True)
    queries = (q_b - query_w @ carry).flatten(-3, -2)
    keys = k_b - solved.transpose(-1, -2) @ w_b
    eye = torch.eye(dim, dtype=carry.dtype, device=carry.device)
    transitions = eye - w_b.transpose(-1, -2) @ carry
    return CausalPath(length, size, local, queries, keys, transitions)


@dataclass
class PreparedPath:
    """What ``prepare_path`` returns: the causal direction and, for the bidirectional form, the
    mirrored one (``right``, prepared on the time-reversed sequences), both from ``q d^-1/2``."""

    left: CausalPath
    right: CausalPath | None

    def scores(self, rows: slice) -> Tensor:
        """Scaled PaTH scores of query ``rows`` over all keys, ``[..., R, T]`` (fp32): causal
        ones zero right of the diagonal (the caller masks them), bidirectional ones complete."""
        left = self.left.scores(rows)
        if self.right is None:
            return left
        length = self.left.length
        start, stop, _ = rows.indices(length)
        right = self.right.scores(slice(length - stop, length - start)).flip(-2, -1)
        queries = query_positions(slice(start, stop), length, left.device)
        to_the_left = torch.arange(length, device=left.device)[None, :] <= queries[:, None]
        return torch.where(to_the_left, left, right)


def prepare_path(
    q: Tensor,
    k: Tensor,
    left: Householders,
    right: Householders | None = None,
    block: int = BLOCK,
) -> PreparedPath:
    """PaTH's prepared state for ``q, k [..., T, d]`` (any leading axes, e.g. ``[M, B, H]``) and
    the factors of keys left of the query (``left``) and, for the bidirectional form, right of
    it (``right``, in natural order); ``block``: tokens per UT block. Computed in fp32 with
    autocast off; ``.scores(rows)`` per query-row chunk."""
    scale = 1 / math.sqrt(q.shape[-1])
    q = q * scale  # the scores are linear in q: scaled once, here
    with autocast_off(q.device.type):
        causal = prepare_causal(q, k, left, block)
        mirrored = None
        if right is not None:
            reversed_factors = Householders(right.w.flip(-2), right.beta.flip(-1))
            mirrored = prepare_causal(q.flip(-2), k.flip(-2), reversed_factors, block)
    return PreparedPath(causal, mirrored)


def path_scores_recurrent(
    q: Tensor, k: Tensor, left: Householders, right: Householders | None = None
) -> Tensor:
    """The plain form, ``[..., T, T]`` scaled scores, by fla's decode recurrence: for t = 0, 1, ...
    every key j < t becomes ``k_j <- k_j - beta_t (w_t . k_j) w_t``, then row t is ``q_t`` against
    the keys as they stand; the bidirectional form runs it again on the reversed sequences with
    ``right`` for the keys j > i. ``O(T^2 d)`` time, and memory under autograd: the reference
    the tests check the fast form against, not for training."""
    scores = _recurrence(q, k, left)
    if right is not None:
        reversed_factors = Householders(right.w.flip(-2), right.beta.flip(-1))
        mirrored = _recurrence(q.flip(-2), k.flip(-2), reversed_factors).flip(-2, -1)
        scores = torch.tril(scores) + torch.triu(mirrored, 1)
    return scores / math.sqrt(q.shape[-1])


def _recurrence(q: Tensor, k: Tensor, factors: Householders) -> Tensor:
    """Unscaled causal scores by the step-by-step recurrence, zero right of the diagonal."""
    length = q.shape[-2]
    keys, rows = k, []
    positions = torch.arange(length, device=q.device)
    for step in range(length):
        w, beta = factors.w[..., step, :], factors.beta[..., step, None, None]
        earlier = (positions < step)[:, None]
        update = beta * (keys @ w[..., :, None]) * w[..., None, :]
        keys = torch.where(earlier, keys - update, keys)
        row = (q[..., step, None, :] @ keys.transpose(-1, -2))[..., 0, :]
        rows.append(torch.where(positions <= step, row, 0.0))
    return torch.stack(rows, dim=-2)


def forget_bias(
    log_forget: Tensor,
    rows: slice,
    log_forget_right: Tensor | None = None,
    scale: float = 1.0,
) -> Tensor:
    """PaTH-FoX's (and FoX's) forget bias of query ``rows``, ``[..., R, T]``, times ``scale``:
    ``D_ij = sum_{s = j+1}^{i} log f_s`` for ``j <= i`` from ``log_forget [..., T]`` (log f <= 0),
    and for ``j > i`` either 0 (causal: masked by the caller) or, bidirectional, the mirror
    ``D_ij = sum_{s = i}^{j-1} log f'_s`` from ``log_forget_right``. fla's PaTH-FoX adds D
    before the ``d^-1/2`` scaling (``scale = d^-1/2``), FoX after it (``scale = 1``)."""
    length = log_forget.shape[-1]
    start, stop, _ = rows.indices(length)
    dtype = torch.promote_types(log_forget.dtype, torch.float32)
    totals = running_sum(log_forget.to(dtype), from_the_right=False)  # c_t = sum_{s <= t}
    bias = totals[..., start:stop, None] - totals[..., None, :]
    queries = query_positions(slice(start, stop), length, log_forget.device)
    to_the_left = torch.arange(length, device=log_forget.device)[None, :] <= queries[:, None]
    if log_forget_right is None:
        right = bias.new_zeros(())
    else:  # e_t = sum_{s < t} log f'_s, D_ij = e_j - e_i
        right_logs = log_forget_right.to(dtype)
        before = running_sum(right_logs, from_the_right=False) - right_logs
        right = before[..., None, :] - before[..., start:stop, None]
    return torch.where(to_the_left, bias, right) * scale
