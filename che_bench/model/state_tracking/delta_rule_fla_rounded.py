"""DeltaNet's delta rule with the roundings of fla's chunk kernel in half precision: the
numerics of the xLSTM harness's DeltaNet, which trains under bf16 autocast through fla's
Triton ``chunk_delta_rule`` (Grazzi et al.'s fork of fla: ``fla/ops/delta_rule/wy_fast.py``,
``fwd_prepare_wy_repr_kernel``; ``fla/ops/delta_rule/chunk.py``,
``chunk_delta_rule_fwd_kernel_h`` and ``chunk_linear_attn_fwd_kernel_o``).

That kernel multiplies in float32 but stores each intermediate in its inputs' dtype. Per chunk
of 64 tokens, with ``r(x)`` the rounding to that dtype and the state ``S`` (``S = 0`` at the
start) kept in float32 from chunk to chunk:

    K_b = r(diag(b) K),   T = r((I + strictly_lower(K_b K^T))^-1),
    W = r(T K_b),   U = r(T r(diag(b) V)),   U~ = r(U - W r(S)),
    O = r(Q r(S) + r(lower(Q K^T)) U~),   S <- S + K^T U~.

This is the chunkwise form of ``delta_rule`` with those roundings; the in-chunk inverse is
computed by a triangular solve (fla: forward substitution), whose float32 roundings differ.
The backward pass is autograd through the same roundings (each also rounds the gradient that
flows back through it), not fla's backward kernels. With float32 inputs nothing is rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from che_bench.encodings.common import autocast_off
from che_bench.model.state_tracking.delta_rule import chunked, unit_lower_inverse

#: fla's chunk: 64 tokens (the harness's DeltaNet layer, ``chunk_size``), the last one short.
FLA_CHUNK = 64


def fla_rounded_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outputs ``[..., T, d_v]`` of the delta rule (``delta_rule``'s module docstring, no gate,
    one step a token) for ``q, k [..., T, d_k]``, ``v [..., T, d_v]``, ``beta [..., T]``, with
    fla's chunk kernel's roundings to the inputs' dtype (module docstring)."""
    if log_decay is not None or k.shape[-2] != q.shape[-2]:
        raise ValueError("fla's rounded delta rule is DeltaNet's: no gate, one step a token")
    *lead, steps, width = v.shape
    dtype = v.dtype
    if steps == 0:
        return v.new_zeros(*lead, 0, width)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).float()

    size = min(steps, FLA_CHUNK)
    pad = -steps % size
    with autocast_off(k.device.type):  # every product in float32, as the kernel's
        # Padding rows (k = v = beta = 0) leave the state alone; their outputs are cut off.
        q, k, v = (chunked(x.float(), pad, size) for x in (q, k, v))
        beta = chunked(beta.float().unsqueeze(-1), pad, size)
        upper = torch.ones(size, size, dtype=torch.bool, device=k.device).triu(1)
        keys, values = rounded(k * beta), rounded(v * beta)
        inverse = rounded(unit_lower_inverse(keys @ k.transpose(-1, -2)))
        w, u = rounded(inverse @ keys), rounded(inverse @ values)
        scores = rounded((q @ k.transpose(-1, -2)).masked_fill_(upper, 0.0))
        out = torch.stack(list(_chunk_outputs(q, k, w, u, scores, rounded)), dim=1)
    return out.flatten(1, 2)[:, :steps].reshape(*lead, steps, width).to(dtype)


def _chunk_outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    scores: torch.Tensor,
    rounded: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[torch.Tensor]:
    """Each chunk's outputs ``r(Q r(S) + scores U~)``, the float32 state carried across
    chunks (``[batch, chunks, C, d]`` operands; module docstring)."""
    state: torch.Tensor | None = None
    for index in range(u.shape[1]):
        if state is None:  # S = 0: U~ = U
            fresh = u[:, index]
            out = scores[:, index] @ fresh
        else:
            stored = rounded(state)
            fresh = rounded(u[:, index] - w[:, index] @ stored)
            out = q[:, index] @ stored + scores[:, index] @ fresh
        yield rounded(out)
        update = k[:, index].transpose(-1, -2) @ fresh
        state = update if state is None else state + update
