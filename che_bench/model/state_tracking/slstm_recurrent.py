"""The sLSTM cell step by step, literally as published: the stabilised recurrence of Beck et
al. (NeurIPS 2024, eqs. 8-17 and App. A.2; NX-AI/xlstm ``slstm_forward_pointwise``), the
oracle ``slstm.slstm_scan`` is tested against.

Per head, with gate pre-activations ``a~ = W_a x_t + R_a h_{t-1} + b_a`` for a in i, f, z, o
(given here as ``pre`` = the input part with its bias, and ``recurrent`` = R, block-diagonal
per head):
``m_t = max(i~, log sigmoid(f~) + m_{t-1})`` (``m_t = i~`` at the first step, while ``n = 0``),
``i' = min(exp(i~ - m_t), 1)``, ``f' = min(exp(log sigmoid(f~) + m_{t-1} - m_t), 1)``,
``c_t = f' c_{t-1} + i' tanh(z~)``, ``n_t = f' n_{t-1} + i'``, ``h_t = sigmoid(o~) c_t / n_t``;
``c, n, m, h`` start at 0. The reference tests ``n == 0`` over the whole batch (a host
synchronisation); ``n_t >= 1`` after the first step, so that test is "t == 0" here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slstm_recurrent(pre: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
    """``slstm_scan``'s result, literally: ``pre [N, T, B, 4d]`` (gates i, f, z, o, each d
    wide; N = members x heads), ``recurrent [N, d, 4d]`` -> ``h [N, T, B, d]``."""
    batch_heads, steps, batch, gates = pre.shape
    size = gates // 4
    h, c, n, m = (pre.new_zeros(batch_heads, batch, size) for _ in range(4))
    outputs = []
    for t in range(steps):
        i, f, z, o = (pre[:, t] + torch.bmm(h, recurrent)).chunk(4, dim=-1)
        log_forget = F.logsigmoid(f) + m
        m_new = i if t == 0 else torch.maximum(i, log_forget)
        write = torch.minimum(torch.exp(i - m_new), torch.ones_like(i))
        forget = torch.minimum(torch.exp(log_forget - m_new), torch.ones_like(i))
        c = forget * c + write * torch.tanh(z)
        n = forget * n + write
        h = torch.sigmoid(o) * c / n
        m = m_new
        outputs.append(h)
    return torch.stack(outputs, dim=1)
