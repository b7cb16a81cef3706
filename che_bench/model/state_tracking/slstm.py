"""sLSTM, the xLSTM cell with scalar memory and recurrent head-wise mixing (Beck et al.,
NeurIPS 2024, section 2.2; spec state_tracking.md 1.e). It has no parallel form (``R h_{t-1}``
enters the gates nonlinearly), so the fast form is a loop over time, vectorised over members,
batch and heads, with the input projections of all tokens computed at once and one batched
block-diagonal product per step (``slstm_scan``). The literal recurrence, the tests' oracle,
is ``slstm_recurrent.py``.

Block ("post-up-projection"): ``x + sLSTMLayer(LN(x))``, then ``x + GatedFFN(LN(x))``.
sLSTMLayer: ``x_c = SiLU(conv(x))`` (no conv when the kernel is 0); gate pre-activations
``i~, f~`` from ``x_c``, ``z~, o~`` from ``x`` (block-diagonal per head, no bias), plus
``R h_{t-1} + b``; the cell's ``h`` normalised per head.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.model.base import non_negative_int
from che_bench.model.state_tracking.layers import MemberCausalConv1d
from che_bench.model.state_tracking.stack import COMMON_DEFAULTS
from che_bench.model.state_tracking.xlstm import (
    GatedFeedForward,
    ScaledLayerNorm,
    XLSTMModel,
    head_norm,
    small_init_,
)

GATES = 4  # i, f, z, o


def slstm_scan(pre: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
    """The sLSTM cell over a sequence: ``pre [N, T, B, 4d]`` (input pre-activations of
    gates i, f, z, o with their bias; N = members x heads), ``recurrent [N, d, 4d]`` ->
    ``h [N, T, B, d]``.

    Computes the published recurrence (``slstm_recurrent``) through ``r_t = c_t / n_t`` and
    ``L_t = log n-bar_t`` (n-bar the unstabilised normaliser; the stabiliser cancels in the
    ratio, and the clamps at 1 never bind): with ``x = log sigmoid(f~) + L_{t-1} - i~``,
    ``a = sigmoid(x)`` is the old state's share ``f n-bar_{t-1} / n-bar_t``, so
    ``L_t = i~ + softplus(x)``, ``r_t = a r_{t-1} + (1 - a) tanh(z~)``,
    ``h_t = sigmoid(o~) r_t``; the first step is ``r = tanh(z~)``, ``L = i~``.
    """
    # One unbind, not an index per step: each index's backward writes a zero tensor of
    # the whole sequence (quadratic in T).
    first, *rest = pre.unbind(1)
    i, _, z, o = first.chunk(GATES, dim=-1)
    ratio, log_n = torch.tanh(z), i
    h = torch.sigmoid(o) * ratio
    outputs = [h]
    for step in rest:
        i, f, z, o = torch.baddbmm(step, h, recurrent).chunk(GATES, dim=-1)
        x = F.logsigmoid(f) + log_n - i
        log_n = i + F.softplus(x)
        ratio = torch.lerp(torch.tanh(z), ratio, torch.sigmoid(x))
        h = torch.sigmoid(o) * ratio
        outputs.append(h)
    return torch.stack(outputs, dim=1)


def powerlaw_forget_bias(size: int, block: int, blocks: int) -> torch.Tensor:
    """xlstm's "powerlaw_blockdependent" forget-gate bias of one head:
    ``5 - 12 (j / (size - 1))^(0.3 + 1.3 block / (blocks - 1))``, j = 0..size-1 (exponent
    0.3 with one block; a head of size 1 gets 5, where the reference divides 0 by 0)."""
    exponent = 0.3 + 1.3 * (block / (blocks - 1) if blocks > 1 else 0.0)
    return 5.0 - 12.0 * torch.linspace(0.0, 1.0, size) ** exponent


class SLSTMLayer(nn.Module):
    """The sLSTM layer (module docstring): ``[M, B, T, E] -> [M, B, T, E]``."""

    def __init__(
        self, members: int, width: int, heads: int, conv: int, block: int, blocks: int
    ) -> None:
        super().__init__()
        self.heads, self.size = heads, width // heads
        size = self.size
        self.conv = MemberCausalConv1d(members, width, conv) if conv else None
        # Per head, rows i, f, z, o (d each) of the input map; small init with the width.
        self.weight = nn.Parameter(torch.empty(members, heads, GATES * size, size))
        self.recurrent = nn.Parameter(torch.zeros(members, heads, size, GATES * size))
        self.bias = nn.Parameter(torch.zeros(members, heads, GATES, size))
        self.norm_weight = nn.Parameter(torch.zeros(members, width))  # head norm's 1 + w
        with torch.no_grad():
            for member in range(members):
                small_init_(self.weight[member], width)
            self.bias[:, :, 1] = powerlaw_forget_bias(size, block, blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members, batch, steps, _ = x.shape
        heads, size = self.heads, self.size
        weight = self.weight.reshape(members * heads, GATES * size, size).transpose(1, 2)
        bias = self.bias.reshape(members * heads, 1, GATES * size)
        inputs = self._by_head(x)
        if self.conv is None:
            pre = torch.baddbmm(bias, inputs, weight)
        else:  # i, f from the convolved input, z, o from the input
            convolved = self._by_head(F.silu(self.conv(x)))
            half = 2 * size
            pre = torch.cat(
                [
                    torch.baddbmm(bias[..., :half], convolved, weight[..., :half]),
                    torch.baddbmm(bias[..., half:], inputs, weight[..., half:]),
                ],
                dim=-1,
            )
        recurrent = self.recurrent.reshape(members * heads, size, GATES * size)
        h = slstm_scan(pre.view(members * heads, steps, batch, GATES * size), recurrent)
        h = h.view(members, heads, steps, batch, size).permute(0, 3, 2, 1, 4)
        return head_norm(h, self.norm_weight)

    def _by_head(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, B, T, H*d]`` as ``[M*H, T*B, d]`` (time-major rows: the scan reads a step's
        batch as one block)."""
        members, batch, steps, _ = x.shape
        by_head = x.view(members, batch, steps, self.heads, self.size).permute(0, 3, 2, 1, 4)
        return by_head.reshape(members * self.heads, steps * batch, self.size)


class SLSTMBlock(nn.Module):
    """``x + sLSTMLayer(LN(x))``, then ``x + GatedFFN(LN(x))`` (xlstm ``sLSTMBlock``)."""

    def __init__(
        self, members: int, width: int, heads: int, conv: int, block: int, blocks: int
    ) -> None:
        super().__init__()
        self.norm = ScaledLayerNorm(members, width)
        self.layer = SLSTMLayer(members, width, heads, conv, block, blocks)
        self.ffn_norm = ScaledLayerNorm(members, width)
        self.ffn = GatedFeedForward(members, width, blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.layer(self.norm(x))
        return x + self.ffn(self.ffn_norm(x))


class SLSTM(XLSTMModel):
    """sLSTM (xLSTM's scalar-memory cell with recurrent head-wise mixing, Beck et al. 2024):
    stacked post-up-projection blocks with a gated feed-forward; Grazzi et al.'s
    formal-language config (xlstm01: 2 blocks, width 128, 4 heads, no convolution).

    Options: ``layers``, ``width``, ``heads``, ``conv_kernel`` (the causal convolution before
    the input and forget gates; 0: none)."""

    name = "slstm"
    label = "sLSTM"
    # conv_kernel 0: Grazzi et al.'s parity_xlstm01.yaml and mod-arithmetic yamls set
    # conv1d_kernel_size 0; the xlstm package's default and NX-AI's parity config use 4.
    defaults: ClassVar[dict[str, Any]] = {**COMMON_DEFAULTS, "conv_kernel": 0}
    # Per token: the gates (4E), the cell's h, the FFN's 2 Ef + Ef (Ef ~ 1.5 E), the
    # residual stream and norms.
    activation_widths: ClassVar[int] = 16

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        settings = super().check_options(settings)
        non_negative_int("conv_kernel", settings["conv_kernel"])
        return settings

    def make_block(self, layer: int) -> nn.Module:
        conv = self.settings["conv_kernel"]
        return SLSTMBlock(self.members, self.width, self.heads, conv, layer, self.layers)
