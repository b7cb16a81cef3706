"""The chunkwise (WY) form of the gated delta rule, and DeltaProduct's Householder products
mapped onto it: the fast form DeltaNet, Gated DeltaNet and DeltaProduct train and evaluate with
(spec state_tracking.md 1.b-1.d). Its plain step-by-step recurrence, the tests' oracle, is
``delta_rule_recurrent``.

Recurrence (per head; state ``S`` is ``d_k x d_v``, ``S_0 = 0``), gated delta rule (Yang, Kautz
& Hatamizadeh 2024, arXiv 2412.06464), with ``g_t = log alpha_t <= 0``:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t.

DeltaNet (Yang et al. 2024, arXiv 2406.06484) is ``g = 0``. With ``||k_t|| = 1`` the transition
has eigenvalue ``1 - beta_t`` along ``k_t`` and 1 elsewhere: ``beta in (0, 1)`` keeps it in
[0, 1], Grazzi et al.'s ``beta in (0, 2)`` reaches (-1, 1) (arXiv 2411.12537). Nothing here is
computed in log space but the gate, which is positive by construction, so both ranges are exact.

Chunkwise form (Yang et al. 2024, Section 3; fla's ``delta_rule_chunkwise`` and
``naive_chunk_gated_delta_rule``): for a chunk of C tokens with rows K, Q, V, betas b, in-chunk
log-decay prefix ``G_i = sum_{j<=i} g_j`` and ``D_ij = exp(G_i - G_j)`` (i >= j):

    A = strictly_lower(diag(b) K K^T * D),   (I + A) [W U] = [diag(b e^G) K, diag(b) V]
    U~ = U - W S_in,   O = (Q * e^G) S_in + lower(Q K^T * D) U~,
    S_out = e^{G_C} S_in + (K * e^{G_C - G})^T U~.

The triangular solve and every in-chunk product run for all chunks at once; only the state is
carried by a loop over chunks.

DeltaProduct (Siems et al. 2025, arXiv 2502.10297): each token takes ``n`` Householder
sub-steps after the gate; interleaving them gives a delta rule over ``T * n`` positions with
the gate on each token's first sub-step and the query on its last (spec 1.d). Only the
query rows form the query terms (``Q K^T``, ``Q e^G``) and outputs: n times fewer than rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from che_bench.encodings.common import autocast_off, chunk_length, running_sum
from che_bench.model.state_tracking.delta_rule_native import native_delta_rule

#: Longest chunk, in rows: the in-chunk matrices grow as C^2 per chunk, the loop over chunks
#: as T / C. At training lengths (41 tokens) DeltaNet's and Gated DeltaNet's chunk is the
#: whole sequence; their committed results were computed with this chunking.
MAX_CHUNK = 64
#: DeltaProduct's longest chunk, in rows (n sub-steps per token): with n = 2 its training step
#: and its evaluation at n = 500 measured fastest on a CPU at 12-16 rows, 64 about 8% and 30%
#: slower (docs/benchmarks.md).
PRODUCT_CHUNK = 16


def chunk_limit(n: int) -> int:
    """The longest chunk, in rows, of a delta product with ``n`` sub-steps per token."""
    return MAX_CHUNK if n == 1 else PRODUCT_CHUNK


def delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Outputs ``[..., T, d_v]`` of the gated delta product: per token t, ``S <- exp(g_t) S``,
    then ``n`` sub-steps ``S <- (I - b k k^T) S + b k v^T``, then ``o_t = S^T q_t``.

    ``q [..., T, d_k]`` (any scale already applied), ``k [..., T*n, d_k]`` (unit rows),
    ``v [..., T*n, d_v]``, ``beta [..., T*n]``, ``log_decay [..., T]`` (<= 0; None: no gate);
    the sub-steps of token t are rows ``t*n .. t*n+n-1``. ``n = 1`` is the gated delta rule.
    ``chunk``: the longest chunk in rows (default ``chunk_limit(n)``).

    On a CPU, a gated rule or a product (``n > 1``) runs the native recurrence
    (``delta_rule_native``) unless ``chunk`` is given; the plain rule (DeltaNet's) keeps the
    chunkwise form, whose roundings its committed results have."""
    steps = q.shape[-2]
    n = k.shape[-2] // steps if steps else 1
    # The device first: the kernel is compiled on first use, for a CPU only.
    if chunk is None and (n > 1 or log_decay is not None) and q.device.type == "cpu":
        native = native_delta_rule()
        if native is not None and native.usable(q, k, v):
            return native.apply(q, k, v, beta, log_decay)
    chunk = chunk_limit(n) if chunk is None else chunk
    if n > 1 and log_decay is not None:  # the gate acts before the token's first sub-step
        still = log_decay.new_zeros(*log_decay.shape, n - 1)
        log_decay = torch.cat([log_decay.unsqueeze(-1), still], dim=-1).flatten(-2)
    return gated_delta_rule(q, k, v, beta, log_decay, chunk)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk: int = MAX_CHUNK,
) -> torch.Tensor:
    """Outputs ``[..., T, d_v]`` of the gated delta rule (module docstring) over ``T * n`` rows
    ``k [..., T*n, d_k]``, ``v [..., T*n, d_v]``, ``beta``, ``log_decay [..., T*n]`` or None,
    read by ``q [..., T, d_k]`` after every n-th row (query t after row ``t*n + n-1``; n = 1:
    a query per row). A chunk holds whole tokens, at most ``chunk`` rows when n divides it."""
    *lead, rows, _ = k.shape
    steps, dtype = q.shape[-2], v.dtype
    if steps == 0:
        return v.new_zeros(*lead, 0, v.shape[-1])
    n = rows // steps
    tokens = chunk_length(steps, max(1, chunk // n))
    pad = -steps % tokens
    # float32 throughout, as autocast would not keep it (the triangular solve has no half
    # precision kernel, and the chunk products accumulate).
    with autocast_off(k.device.type):
        # Padding rows (k = v = beta = 0) leave the state alone; their outputs are cut off.
        q = chunked(q.float(), pad, tokens)
        k, v = (chunked(x.float(), pad * n, tokens * n) for x in (k, v))
        beta = chunked(beta.float().unsqueeze(-1), pad * n, tokens * n).squeeze(-1)
        gate = None
        if log_decay is not None:
            gate = chunked(log_decay.float().unsqueeze(-1), pad * n, tokens * n).squeeze(-1)
        out = _chunkwise(q, k, v, beta, gate)
    return out.flatten(1, 2)[:, :steps].reshape(*lead, steps, v.shape[-1]).to(dtype)


def chunked(x: torch.Tensor, pad: int, size: int) -> torch.Tensor:
    """``[..., T, d]`` as ``[batch, chunks, size, d]``, padded with zeros at the end."""
    x = x.reshape(-1, *x.shape[-2:])
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[-1])], dim=1)
    return x.view(x.shape[0], -1, size, x.shape[-1])


def _chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """The chunkwise form (module docstring) on ``[batch, chunks, C, d]`` rows, read by
    ``q [batch, chunks, C / n, d]`` after every n-th row."""
    # One unbind per operand, not an index per chunk: each index's backward would write a
    # zero-filled operand-size gradient.
    terms = _in_chunk(q, k, v, beta, gate)
    scores, w, u, q_in, k_out = (x.unbind(1) for x in terms[:5])
    decays = None if terms[5] is None else terms[5].unbind(1)
    fresh = u[0]  # the first chunk starts from S = 0
    outs = [scores[0] @ fresh]
    state: torch.Tensor | None = None
    for index in range(1, len(u)):
        update = k_out[index - 1].transpose(-1, -2) @ fresh
        if state is None:
            state = update
        else:
            state = update + (state if decays is None else state * decays[index - 1])
        fresh = u[index] - w[index] @ state
        outs.append(q_in[index] @ state + scores[index] @ fresh)
    return torch.stack(outs, dim=1)


def _solve(
    inner: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inverse_first: bool
) -> tuple[Tensor, Tensor]:
    """``W, U = (I + inner)^-1 [keys, values]`` for the strictly lower ``inner``. Either one
    solve with both right-hand sides, or (``inverse_first``) the chunk's inverse by a solve
    against the identity, then two products: 1.2-1.3x faster for DeltaProduct's chunks of
    at most 16 rows (fla's chunk kernels also form the inverse), but other roundings, so
    DeltaNet and Gated DeltaNet keep the one solve their committed results were computed
    with (docs/benchmarks.md)."""
    # unitriangular: the solve reads only the strictly lower part (the diagonal is 1).
    if inverse_first:
        inverse = unit_lower_inverse(inner)
        return inverse @ keys, inverse @ values
    # Right-hand sides laid out column-major, as LAPACK's solve takes them (no transposing copy).
    rhs = torch.cat([keys.mT, values.mT], dim=-2).mT
    solved = torch.linalg.solve_triangular(inner, rhs, upper=False, unitriangular=True)
    w, u = solved.split([keys.shape[-1], values.shape[-1]], dim=-1)
    return w, u


def unit_lower_inverse(inner: torch.Tensor) -> torch.Tensor:
    """``(I + strictly_lower(inner))^-1`` for each matrix of ``inner``: a unitriangular solve
    against the identity, which reads only the strictly lower part."""
    identity = torch.eye(inner.shape[-1], dtype=inner.dtype, device=inner.device)
    return torch.linalg.solve_triangular(
        inner, identity.expand_as(inner), upper=False, unitriangular=True
    )


def _in_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    gate: torch.Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Every chunk's own terms at once: ``lower(Q K^T * D)``, W, U, ``Q * e^G``,
    ``K * e^{G_C - G}`` and ``e^{G_C}`` (None without a gate), the query terms at the query
    rows alone (every n-th, ``n = C / len(q)``: DeltaProduct's sub-steps have no query). The
    temporaries (``A``, ``D``) are freed on return: an evaluation's peak memory holds fewer
    C x C matrices."""
    size, n = k.shape[-2], k.shape[-2] // q.shape[-2]
    query_rows = slice(n - 1, None, n)
    upper = torch.ones(size, size, dtype=torch.bool, device=k.device).triu(1)
    keys = k * beta.unsqueeze(-1)
    # In place on fresh products, whose backward needs only the mask.
    inner = (keys @ k.transpose(-1, -2)).masked_fill_(upper, 0.0)
    q_in, k_out, chunk_decay, decay = q, k, None, None
    if gate is not None:
        prefix = running_sum(gate, from_the_right=False)
        # Masked before exp: above the diagonal G_i - G_j > 0 could overflow.
        relative = prefix.unsqueeze(-1) - prefix.unsqueeze(-2)
        decay = relative.masked_fill_(upper, -torch.inf).exp_()
        inner = inner * decay
        growth = prefix.exp().unsqueeze(-1)
        q_in, keys = q * growth[..., query_rows, :], keys * growth
        k_out = k * (prefix[..., -1:] - prefix).exp().unsqueeze(-1)
        chunk_decay = prefix[..., -1].exp()[..., None, None]
    w, u = _solve(inner, keys, v * beta.unsqueeze(-1), inverse_first=n > 1)
    del inner
    scores = (q @ k.transpose(-1, -2)).masked_fill_(upper[query_rows], 0.0)
    if decay is not None:
        scores = scores * decay[..., query_rows, :]
    return scores, w, u, q_in, k_out, chunk_decay
