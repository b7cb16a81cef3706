"""Mamba-1's mixer as its plain recurrence, one token at a time: the oracle the fast form
(``mamba.selective_scan``, ``mamba.MambaMixer``) must equal. Equations of spec
state_tracking.md 1.a (Gu & Dao 2023, arXiv 2312.00752, Algorithm 2; mamba-ssm's
``selective_scan_ref``; mambapy's ``selective_scan_seq``) and 1.f (Grazzi et al., ICLR 2025,
arXiv 2411.12537, Table 2: ``a_t = 2 exp(dt_t A) - 1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from che_bench.members import per_member

if TYPE_CHECKING:
    from che_bench.model.state_tracking.mamba import MambaMixer


def selective_scan_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    negative: bool = False,
) -> torch.Tensor:
    """``y_t = sum_n C_t[n] h_t[:, n]`` ``[M, Bt, T, ED]``, stepping
    ``h_t[c, n] = a_t[c, n] h_{t-1}[c, n] + dt_t[c] x_t[c] B_t[n]`` from ``h_0 = 0`` with
    ``a_t = exp(dt_t[c] A[c, n])``, or ``2 exp(dt_t[c] A[c, n]) - 1`` if ``negative``:
    ``x``, ``dt`` ``[M, Bt, T, ED]``, ``A [M, ED, N]``, ``B``, ``C`` ``[M, Bt, T, N]``."""
    members, batch, steps, inner = x.shape
    state = x.new_zeros(members, batch, inner, A.shape[-1])
    outputs = []
    for t in range(steps):
        a = torch.exp(dt[:, :, t, :, None] * A[:, None])
        if negative:
            a = 2 * a - 1
        state = a * state + (dt[:, :, t] * x[:, :, t])[..., None] * B[:, :, t, None, :]
        outputs.append((state * C[:, :, t, None, :]).sum(-1))
    return torch.stack(outputs, dim=2)


def mixer_recurrent(mixer: MambaMixer, u: torch.Tensor) -> torch.Tensor:
    """``mixer``'s output for ``u [M, B, T, E]``, token by token: the causal convolution over
    a window of the last ``d_conv`` inputs (zeros before the first), then the SSM step."""
    members, batch, steps, _ = u.shape
    x_in, z = mixer.in_proj(u).chunk(2, dim=-1)
    kernel = mixer.conv.weight.shape[-1]
    window = x_in.new_zeros(members, batch, kernel, x_in.shape[-1])
    A = -torch.exp(mixer.A_log)
    state = x_in.new_zeros(members, batch, x_in.shape[-1], A.shape[-1])
    outputs = []
    for t in range(steps):
        window = torch.cat([window[:, :, 1:], x_in[:, :, t, None]], dim=2)
        x = torch.einsum("mbkc,mck->mbc", window, mixer.conv.weight)
        if mixer.conv.bias is not None:
            x = x + per_member(mixer.conv.bias, x.dim())
        x = F.silu(x)
        delta, B, C = mixer.x_proj(x).split([mixer.rank, mixer.d_state, mixer.d_state], dim=-1)
        dt = F.softplus(mixer.dt_proj(delta))
        a = torch.exp(dt[..., None] * A[:, None])
        if mixer.negative:
            a = 2 * a - 1
        state = a * state + (dt * x)[..., None] * B[..., None, :]
        y = (state * C[..., None, :]).sum(-1) + x * per_member(mixer.D, x.dim())
        outputs.append(mixer.out_proj(y * F.silu(z[:, :, t])))
    return torch.stack(outputs, dim=2)
