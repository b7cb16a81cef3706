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
``(j, i]`` read backwards (the oracle computes it as the causal form of the reversed sequences).
The diagonal is ``q_i . k_i`` on both sides.

**Fast form** (the UT transform of Joffrain et al., ACM TOMS 2006, as PaTH §3.3 and fla's
``fla/ops/path_attn/naive.py`` use it; the derivation below is che-bench's). For tokens ``a..b``
in order, ``H_b ... H_a = I - W^T T W`` with ``W`` the rows ``w_a..w_b`` and the lower-triangular
``T = (I + L)^-1 diag(beta)``, ``L_sr = beta_s w_s . w_r`` for ``r < s`` (the coefficients
``c = T W x`` of ``x``'s rank-one updates solve ``c_s = beta_s w_s.(x - sum_{r<s} w_r c_r)``).
The inverse of a contiguous diagonal block of a unit triangular matrix is that block of its
inverse, so one ``T`` per block of ``C`` tokens serves every sub-range inside the block. The
sequence is zero-padded (``w = 0``: ``H = I``) and cut into blocks of ``C``; with ``A = Q W^T``
and ``B = W K^T`` of a block:

* same block, ``j <= i``: ``s_ij = q_i.k_j - sum_{j < r <= s <= i} A_is T_sr B_rj``, i.e.
  ``tril(Q K^T) - tril(A) V`` with ``V = (I + L)^-1 diag(beta) strict_tril(B)`` (one triangular
  solve, ``O(C^3)`` per block);
* key block ``J`` left of the query's block ``I``: ``s_ij = q^_i^T P_{I-1} ... P_{J+1} k^_j`` with
  the block products ``P_J = I - W_J^T Y_J``, ``Y = (I + L)^-1 diag(beta) W``, the query carried
  to its block's start, ``q^ = Q - tril(A) Y`` (``= (H_i ... H_start)^T q_i``), and the key to its
  block's end, ``k^ = K - V^T W`` (``= H_end ... H_{j+1} k_j``).

The right side is the mirror image: ``I + U`` with ``U_sr = beta'_s w'_s.w'_r`` for ``r > s``
(upper-triangular solves), ``A`` masked to ``s >= i``, ``B`` to ``r < j``; ``q^`` carried to its
block's end and ``k^`` to its block's start. Inside a block the two sides add their terms to
one ``Q K^T``.

``prepare_path`` computes, once per layer, the in-block scores ``[..., T, C]``, ``q^``, ``k^``
``[..., T, d]`` and the ``d x d`` block products of each side. ``PreparedPath.scores(rows)``
walks the keys block by block from the far end, ``K~ <- K~ P_J^T`` (fla's naive walks the queries
instead, ``q <- q - q H_mat``), so that for each query block the keys of the other blocks stand
carried to its edge; one product ``[q^ | q^'] [K~ | K~']^T`` (inner width ``2d``) of the chunk's
rows in that block then gives the scores across blocks of both sides at once, and the in-block
scores are copied onto its diagonal block. A chunk of R query rows costs ``O(R T d + T^2 d^2 /
C)`` time and ``O(R T)`` memory (the carried keys of its ``R / C + 2`` blocks), under autograd
too, against the plain recurrence's ``O(T^2 d)`` stored per head. A training batch (n <= 64
tokens) is one block: no walk, no product across blocks. Everything is exact, the same sums in
another order (float32 rounding; ``T`` stays bounded, every partial product of ``H``'s having
norm <= 1 for beta in [0, 2]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from che_bench.encodings.common import autocast_off, chunk_length, query_positions, running_sum

#: Most tokens per block of the UT transform (fla's naive reference uses 64). The in-block work
#: grows as ``T C^2``, the walk of the keys across blocks as ``T^2 d^2 / C``; a training batch
#: of up to 64 tokens is one block.
BLOCK = 64


class Householders(NamedTuple):
    """The factors ``H_t = I - beta_t w_t w_t^T`` of one direction: ``w [..., T, d]`` (unit rows),
    ``beta [..., T]``, in natural time order for either direction."""

    w: Tensor
    beta: Tensor


@dataclass
class Side:
    """One side's tensors prepared once per layer, the padded sequence cut into ``n`` blocks of
    ``C``, with more than one block (else all None): ``queries`` q^ and ``keys`` k^ ``[..., n, C,
    d]`` and the block products ``transitions`` P ``[..., n, d, d]``. The left side's
    (``right=False``) q^ is carried to its block's start and k^ to its block's end, the right
    side's the other way."""

    right: bool
    queries: Tensor | None
    keys: Tensor | None
    transitions: Tensor | None


class _UnitTriangularSolve(torch.autograd.Function):
    """``A^-1 B`` for a unit lower (``upper``: upper) triangular ``A`` given by its strict
    triangle (the rest is not read). Backward as torch's ``solve_triangular``'s, ``dB = A^-T dX``
    and ``dA = -dB X^T`` on the strict triangle, with the sign and the triangle one product
    (torch's takes a negation and a ``tril`` pass over the map)."""

    @staticmethod
    def forward(ctx: Any, matrix: Tensor, rhs: Tensor, upper: bool) -> Tensor:
        solution = torch.linalg.solve_triangular(matrix, rhs, upper=upper, unitriangular=True)
        ctx.save_for_backward(matrix, solution)
        ctx.upper = upper
        return solution

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        matrix, solution = ctx.saved_tensors
        grad_rhs = torch.linalg.solve_triangular(
            matrix.transpose(-1, -2), grad, upper=not ctx.upper, unitriangular=True
        )
        size = matrix.shape[-1]
        ones = -torch.ones(size, size, dtype=matrix.dtype, device=matrix.device)
        negated_triangle = ones.triu(1) if ctx.upper else ones.tril(-1)
        grad_matrix = (grad_rhs @ solution.transpose(-1, -2)).mul_(negated_triangle)
        return grad_matrix, grad_rhs, None


def unit_triangular_solve(matrix: Tensor, rhs: Tensor, upper: bool) -> Tensor:
    """``A^-1 B`` for ``A`` unit lower (upper) triangular, read from its strict triangle only."""
    return cast(Tensor, _UnitTriangularSolve.apply(matrix, rhs, upper))


def prepare_side(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, right: bool, local: Tensor) -> Side:
    """``Side`` of ``q, k, w [..., n, C, d]`` and ``beta [..., n, C, 1]`` (module docstring; the
    right side is its mirror image: ``I + U``, ``U_sr = beta_s w_s.w_r`` for ``r > s``, upper);
    adds the side's in-block terms to ``local [..., n, C, C]`` in place."""
    size, dim = q.shape[-2:]
    weighted = beta * w  # beta_s w_s
    ones = torch.ones(size, size, dtype=q.dtype, device=q.device)
    # Masks as products: torch.tril on these small batched maps costs 3x a multiplication. The
    # minus sign rides on the mask, so that the side's terms are added (no negation in backward).
    own, negated_strict = (ones.triu(), -ones.triu(1)) if right else (ones.tril(), -ones.tril(-1))
    # I + L (left) or I + U (right): the solves read its strict lower (upper) triangle only.
    gram = weighted @ w.transpose(-1, -2)
    w_keys = (weighted @ k.transpose(-1, -2)).mul_(negated_strict)  # -beta_r w_r.k_j, r between
    negated = unit_triangular_solve(gram, w_keys, right)  # -V
    del w_keys  # (without gradients: one [T, C] map fewer at the peak)
    query_w = (q @ w.transpose(-1, -2)).mul_(own)  # q_i.w_s, s on the query's side
    flat = (-1, size, size)
    local.view(flat).baddbmm_(query_w.reshape(flat), negated.reshape(flat))
    if q.shape[-3] == 1:
        return Side(right, None, None, None)
    carry = unit_triangular_solve(gram, weighted, right)  # Y
    transitions = torch.eye(dim, dtype=q.dtype, device=q.device) - w.transpose(-1, -2) @ carry
    keys = k + negated.transpose(-1, -2) @ w
    return Side(right, q - query_w @ carry, keys, transitions)


def carried_keys(sides: tuple[Side, ...], first: int, last: int, room: int = 1) -> Tensor:
    """``[..., last - first + 1, n C, S d]``: for each query block ``I`` in ``first..last`` every
    key of a block ``J`` on each of the ``S`` sides carried to block I's edge (left: ``P_{I-1}
    ... P_{J+1} k^_j``, right: ``P_{I+1} ... P_{J-1} k^_j``), zero for the other keys; the sides
    side by side along the last axis, written into one zero map as they are walked (no padded
    copy per block, no stacked or joined copies). The map has room for ``room`` blocks (at
    least ``last - first + 1``), so that every chunk of rows asks for one size: maps of
    changing sizes fragmented the allocator's heap."""
    assert sides[0].keys is not None
    *leading, count, size, dim = sides[0].keys.shape
    blocks = last - first + 1
    room = max(room, blocks)
    carried = sides[0].keys.new_empty(*leading, room, count, size, dim * len(sides))
    carried = carried[..., :blocks, :, :, :].zero_()
    for index, side in enumerate(sides):
        _walk(side, first, last, carried[..., index * dim : (index + 1) * dim])
    return carried.flatten(-3, -2)


def _walk(side: Side, first: int, last: int, target: Tensor) -> None:
    """Writes ``carried_keys``' part of one side into ``target [..., last - first + 1, n, C,
    d]``. Walks the blocks from the far end: ``O(n^2 C d^2)``."""
    assert side.keys is not None and side.transitions is not None
    keys, transitions = side.keys, side.transitions
    count = keys.shape[-3]
    order = range(count - 1, first - 1, -1) if side.right else range(last + 1)
    walked = keys[..., :0, :, :]  # the keys beyond `block`, carried to its edge
    for block in order:
        source = block + 1 if side.right else block - 1  # the block just passed
        if 0 <= source < count:
            moved = walked @ transitions[..., source, None, :, :].transpose(-1, -2)
            passed = keys[..., source : source + 1, :, :]
            walked = torch.cat([passed, moved] if side.right else [moved, passed], dim=-3)
        if first <= block <= last:
            beyond = slice(block + 1, None) if side.right else slice(0, block)
            target[..., block - first, beyond, :, :] = walked


def product_into(target: Tensor, left: Tensor, right: Tensor) -> None:
    """``target[...] = (left @ right)[..., :width]`` (without gradients; ``width`` the
    target's columns) for a ``target`` of some rows of a map, written into it. One row goes
    through a map of its own over all of ``right``'s columns, as autograd's form computes
    it: MKL's product of one row rounds otherwise written among other rows (the Intel Xeon)
    and over fewer columns (the AMD EPYC Zen 3, two keys of padding fewer)."""
    width = target.shape[-1]
    if target.shape[-2] == 1:
        target.copy_((left @ right)[..., :width])
    else:
        torch.matmul(left, right[..., :width], out=target)


@dataclass
class PreparedPath:
    """What ``prepare_path`` returns (from ``q d^-1/2``): ``local [..., n, C, C]``, each block's
    scores over its own keys (zero right of the diagonal unless bidirectional), and the
    ``Side``s whose carried queries and keys give the scores across blocks."""

    length: int
    local: Tensor
    sides: tuple[Side, ...]

    def scores(self, rows: slice) -> Tensor:
        """Scaled PaTH scores of query ``rows`` (a slice of step 1) over all keys, ``[..., R, T]``
        (fp32): causal ones zero right of the diagonal (the caller masks them)."""
        start, stop, _ = rows.indices(self.length)
        count, size = self.local.shape[-3:-1]
        first, last = start // size, (stop - 1) // size
        local = self.local[..., first : last + 1, :, :]
        if count == 1:
            offset = first * size
            return local.flatten(-3, -2)[..., start - offset : stop - offset, : self.length]
        # One product for both sides per query block, of the rows asked for only (a chunk
        # smaller than a block forms no other block rows), the in-block scores put on it.
        queries = torch.cat([self._queries(side, first, last) for side in self.sides], -1)
        room = -(-(stop - start - 1) // size) + 1  # the most blocks a chunk's rows span
        keys = carried_keys(self.sides, first, last, room)
        blocks = [
            (index, block, max(start - block * size, 0), min(stop - block * size, size))
            for index, block in enumerate(range(first, last + 1))
        ]
        if torch.is_grad_enabled() and (queries.requires_grad or keys.requires_grad):
            parts = []
            for index, block, low, high in blocks:
                part = queries[..., index, low:high, :] @ keys[..., index, :, :].mT
                part.unflatten(-1, (count, size))[..., block, :] = local[..., index, low:high, :]
                parts.append(part)
            return torch.cat(parts, -2)[..., : self.length]
        # Without gradients each block's rows are written into one map over the keys (no
        # padding's columns: the softmax takes it as it is), with no map of their own: the
        # chunks' products, of as many sizes as rows fall into a block, and the softmax's
        # contiguous copy fragmented the allocator's heap.
        scores = queries.new_empty(*queries.shape[:-3], stop - start, self.length)
        for index, block, low, high in blocks:
            part = scores[..., block * size + low - start : block * size + high - start, :]
            product_into(part, queries[..., index, low:high, :], keys[..., index, :, :].mT)
            own = slice(block * size, min(block * size + size, self.length))
            part[..., own] = local[..., index, low:high, : own.stop - own.start]
        return scores

    @staticmethod
    def _queries(side: Side, first: int, last: int) -> Tensor:
        assert side.queries is not None
        return side.queries[..., first : last + 1, :, :]


def prepare_path(
    q: Tensor,
    k: Tensor,
    left: Householders,
    right: Householders | None = None,
    block: int = BLOCK,
) -> PreparedPath:
    """PaTH's prepared state for ``q, k [..., T, d]`` (any leading axes, e.g. ``[M, B, H]``) and
    the factors of keys left of the query (``left``) and, for the bidirectional form, right of
    it (``right``); blocks of at most ``block`` tokens (as few as fit, of equal length).
    Computed in fp32 (fp64 stays fp64) with autocast off; ``.scores(rows)`` per row chunk."""
    length, dim = q.shape[-2:]
    size = chunk_length(length, block)
    count = -(-length // size)
    dtype = torch.promote_types(q.dtype, torch.float32)

    def blocked(x: Tensor) -> Tensor:  # [..., T, m] -> [..., count, C, m], zero-padded
        return F.pad(x.to(dtype), (0, 0, 0, count * size - length)).unflatten(-2, (count, size))

    with autocast_off(q.device.type):
        q_b, k_b = blocked(q / math.sqrt(dim)), blocked(k)  # the scores are linear in q
        local = q_b @ k_b.transpose(-1, -2)
        if right is None:
            local.mul_(torch.ones(size, size, dtype=dtype, device=q.device).tril())
        sides = tuple(
            prepare_side(
                q_b, k_b, blocked(factors.w), blocked(factors.beta[..., None]), is_right, local
            )
            for factors, is_right in ((left, False), (right, True))
            if factors is not None
        )
    return PreparedPath(length, local, sides)


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
