"""The gated delta product as a plain step-by-step recurrence: the oracle the chunkwise form
(``delta_rule.delta_product``) must equal, kept as the equations read (spec state_tracking.md
1.b-1.d; fla-core keeps its naive recurrences beside its kernels likewise).

Per head, state ``S`` (``d_k x d_v``, ``S_0 = 0``), for each token t:

    S <- exp(g_t) S                                          (Gated DeltaNet, arXiv 2412.06464)
    S <- (I - b_{t,j} k_{t,j} k_{t,j}^T) S + b_{t,j} k_{t,j} v_{t,j}^T,   j = 1..n
                                                             (DeltaProduct, arXiv 2502.10297)
    o_t = S^T q_t

With ``n = 1`` and no gate this is DeltaNet's delta rule (arXiv 2406.06484).
"""

from __future__ import annotations

import torch


def recurrent_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Outputs ``[..., T, d_v]``, token by token; arguments as ``delta_rule.delta_product``
    (``chunk`` is accepted for the same signature and unused)."""
    steps = q.shape[-2]
    n = k.shape[-2] // steps if steps else 1
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(steps):
        if log_decay is not None:
            state = state * log_decay[..., t].exp()[..., None, None]
        for j in range(t * n, t * n + n):
            key, rate = k[..., j, :], beta[..., j, None]
            # (I - b k k^T) S + b k v^T  =  S + k (b (v - S^T k))^T
            error = v[..., j, :] - (key.unsqueeze(-1) * state).sum(-2)
            state = state + key.unsqueeze(-1) * (rate * error).unsqueeze(-2)
        outs.append((q[..., t, :].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outs, dim=-2)
