"""The mLSTM cell step by step: the plain stabilised recurrence (Beck et al., NeurIPS 2024,
eqs. 19-27 with the stabiliser of App. B.3; NX-AI/xlstm
``recurrent_step_stabilized_simple``), the oracle ``mlstm.mlstm_parallel`` is tested against.

State per head: ``C [d, d]``, ``n [d]``, ``m`` (all 0 at the start); per token:
``m_t = max(log sigmoid(f~_t) + m_{t-1}, i~_t)``, ``f' = exp(log sigmoid(f~_t) + m_{t-1} - m_t)``,
``i' = exp(i~_t - m_t)``, ``C_t = f' C_{t-1} + i' k^_t v_t^T``, ``n_t = f' n_{t-1} + i' k^_t``
(``k^ = k / sqrt d``), ``h~_t = C_t^T q_t / (max(|n_t . q_t|, exp(-m_t)) + 1e-6)``.

The two forms differ in the stabiliser only (this one's ``m`` includes the empty initial
state): both normalisers are ``exp(-m_t) max(|n-bar_t . q_t|, 1)`` with the unstabilised
``n-bar``, so the outputs differ by the ``1e-6`` term, ``1e-6 exp(m_t)`` in unstabilised
units: they agree to float32 tolerance while ``m_t`` is moderate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from che_bench.model.state_tracking.mlstm import EPS


def mlstm_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
) -> torch.Tensor:
    """``mlstm_parallel``'s result, one token at a time: ``q, k, v [..., T, d]``, gate
    pre-activations ``igate, fgate [..., T]`` -> ``h~ [..., T, d]``."""
    size = q.shape[-1]
    memory = q.new_zeros(*q.shape[:-2], size, size)
    normaliser = q.new_zeros(*q.shape[:-2], size)
    stabiliser = q.new_zeros(q.shape[:-2])
    outputs = []
    for t in range(q.shape[-2]):
        log_forget = F.logsigmoid(fgate[..., t])
        new_stabiliser = torch.maximum(log_forget + stabiliser, igate[..., t])
        forget = torch.exp(log_forget + stabiliser - new_stabiliser)[..., None]
        write = torch.exp(igate[..., t] - new_stabiliser)[..., None]
        key = k[..., t, :] * size**-0.5
        memory = forget[..., None] * memory + write[..., None] * (
            key[..., :, None] * v[..., t, None, :]
        )
        normaliser = forget * normaliser + write * key
        query = q[..., t, :]
        numerator = (query[..., :, None] * memory).sum(-2)
        denominator = torch.maximum((normaliser * query).sum(-1).abs(), torch.exp(-new_stabiliser))
        outputs.append(numerator / (denominator + EPS)[..., None])
        stabiliser = new_stabiliser
    return torch.stack(outputs, dim=-2)
