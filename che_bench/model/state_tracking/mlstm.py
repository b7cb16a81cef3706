"""mLSTM, the xLSTM cell with a matrix memory (Beck et al., NeurIPS 2024, section 2.3; spec
state_tracking.md 1.e), in its stabilised parallel form, the form the formal-language runs
train with (NX-AI/xlstm ``parallel_stabilized_simple``), computed in chunks of 64 tokens
(``mlstm_chunkwise``: the same numbers; a training input of 40 tokens is one chunk, longer
evaluation inputs cost O(T) memory instead of O(T^2)). Its step-by-step recurrence, the
tests' oracle, is ``mlstm_recurrent.py``.

Block ("pre-up-projection", no feed-forward): ``x + W_down(h)`` with, from ``LN(x)``:
``[x_m, z] = W_up LN(x)`` (E -> 2 Ei, Ei = roundup64(2E)); ``x_c = SiLU(conv4(x_m))``;
``q, k = P_q x_c, P_k x_c``; ``v = P_v x_m`` (block-diagonal, 4x4 blocks); gate
pre-activations ``[i~; f~] = W_g [q; k; v] + b_g``, one pair per head; ``h~`` the cell;
``h = (headnorm(h~) + s * x_c) * SiLU(z)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings.common import running_sum
from che_bench.errors import CheBenchError
from che_bench.members import MemberLinear, init_members_
from che_bench.model.base import positive_int
from che_bench.model.state_tracking.layers import MemberCausalConv1d
from che_bench.model.state_tracking.position_wise import read_out_positions
from che_bench.model.state_tracking.stack import COMMON_DEFAULTS
from che_bench.model.state_tracking.xlstm import (
    HeadwiseLinear,
    ScaledLayerNorm,
    XLSTMModel,
    head_norm,
    round_up,
    small_init_,
    wang_init_,
)

#: Side of the q, k, v projections' diagonal blocks (xlstm ``qkv_proj_blocksize``).
QKV_BLOCK = 4
#: The normaliser's epsilon (xlstm's backends).
EPS = 1e-6
#: Tokens per chunk of ``mlstm_chunkwise`` (a training length of 40 is one chunk).
CHUNK = 64
#: [C, C] float tensors per chunk and head the memory budget counts (3 live at once).
CHUNK_MATRICES = 4
#: [d, d] float tensors per chunk and head it counts (the chunk's state and its increment).
STATE_MATRICES = 3


def mlstm_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
) -> torch.Tensor:
    """The mLSTM cell over a whole sequence, stabilised parallel form: ``q, k, v
    [..., T, d]``, gate pre-activations ``igate, fgate [..., T]`` -> ``h~ [..., T, d]``.

    With ``F_t = sum_{s<=t} log sigmoid(f~_s)``: ``l_ts = F_t - F_s + i~_s`` (s <= t),
    ``m_t = max_s l_ts``, ``C_ts = (q_t . k_s / sqrt d) exp(l_ts - m_t)``,
    ``h~_t = sum_s C_ts v_s / (max(|sum_s C_ts|, exp(-m_t)) + 1e-6)`` (Beck et al. 2024,
    App. B.3; NX-AI/xlstm ``parallel_stabilized_simple``): ``mlstm_chunkwise`` with one
    chunk. Log-space sums are safe here: the forget gates are sigmoids, in (0, 1).
    """
    return mlstm_chunkwise(q, k, v, igate, fgate, chunk=q.shape[-2])


def mlstm_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """``mlstm_parallel``'s result (the same stabiliser ``m_t``, so the same numbers up to
    rounding) in chunks of ``chunk`` tokens: the parallel form within each chunk, plus each
    chunk's read of the state its predecessors left (``sum_{s<b} exp(l_bs - m_b) k_s v_s^T``
    at the chunk's start b, carried chunk to chunk). Memory and work O(T chunk) per head
    instead of O(T^2). ``m_t = F_t + max_{s<=t} (i~_s - F_s)``, a running maximum."""
    steps, size = q.shape[-2:]
    cumulative = running_sum(F.logsigmoid(fgate), from_the_right=False)
    stabiliser = cumulative + (igate - cumulative).cummax(-1).values
    chunk = max(1, min(chunk, steps))
    chunks = -(-steps // chunk)
    pad = chunks * chunk - steps  # after the last token: causal, so it changes nothing
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(-2, (chunks, chunk)) for x in (q, k, v))
    k = k * size**-0.5  # scaled before the products, as the reference does
    # The padding continues the last token (forget gate 1, no input: i~ = -inf), so every
    # exponent below stays <= 0 there too; zeros overflow exp(0 - F_s + i~_s) once the summed
    # log-forget passes -88, and the padding's inf times its zero gradient is NaN.
    cumulative, stabiliser = (_extended(x, pad) for x in (cumulative, stabiliser))
    igate = F.pad(igate, (0, pad), value=-math.inf)
    cumulative, igate, stabiliser = (
        x.unflatten(-1, (chunks, chunk)) for x in (cumulative, igate, stabiliser)
    )
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    log_decay = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(
        ~causal, -math.inf
    )
    decay = (log_decay + igate[..., None, :] - stabiliser[..., None]).exp()
    del log_decay  # each [C, C] stage released before the next (CHUNK_MATRICES)
    scores = (q @ k.transpose(-1, -2)) * decay
    del decay
    numerator, total = scores @ v, scores.sum(-1)
    if chunks > 1:
        inter_numerator, inter_total = _from_earlier_chunks(q, k, v, cumulative, igate, stabiliser)
        numerator, total = numerator + inter_numerator, total + inter_total
    normaliser = torch.maximum(total.abs(), torch.exp(-stabiliser)) + EPS
    return (numerator / normaliser[..., None]).flatten(-3, -2)[..., :steps, :]


def _extended(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``x [..., T]`` followed by ``pad`` copies of its last entry."""
    return torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)


def _from_earlier_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cumulative: torch.Tensor,
    igate: torch.Tensor,
    stabiliser: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each chunk reads from the tokens before it: ``q, k, v [..., N, C, d]`` (k
    scaled), ``cumulative, igate, stabiliser [..., N, C]`` -> numerator ``[..., N, C, d]``
    and normaliser sum ``[..., N, C]``, both stabilised by each token's ``m_t``.

    The state at the end of chunk c, stabilised by ``m`` there: ``S_c = a_c S_{c-1} + sum_s
    u_s k_s v_s^T`` with ``u_s = exp(F_end - F_s + i~_s - m_end)`` and the carry
    ``a_c = exp(F_end - F_prev_end + m_prev_end - m_end)``; token t of chunk c reads
    ``S_{c-1}`` scaled by ``exp(F_t - F_prev_end + m_prev_end - m_t)``. Every exponent is
    <= 0 (m is a running maximum); before the first chunk ``m = -inf``: weight 0."""
    last_cumulative, last_stabiliser = cumulative[..., -1], stabiliser[..., -1]
    previous_cumulative = F.pad(last_cumulative[..., :-1], (1, 0))
    previous_stabiliser = F.pad(last_stabiliser[..., :-1], (1, 0), value=-math.inf)
    offset = previous_stabiliser - previous_cumulative  # [..., N]
    inflow = torch.exp(last_cumulative[..., None] - cumulative + igate - last_stabiliser[..., None])
    increments = (k * inflow[..., None]).transpose(-1, -2) @ v  # [..., N, d, d]
    key_increments = (k * inflow[..., None]).sum(-2)  # [..., N, d]
    carry = torch.exp(last_cumulative + offset - last_stabiliser)
    states, key_states = (
        [torch.zeros_like(increments[..., 0, :, :])],
        [torch.zeros_like(key_increments[..., 0, :])],
    )
    # One unbind, not an index per chunk: each index's backward writes a whole-size zero.
    for a, increment, key_increment in zip(
        carry.unbind(-1)[:-1],
        increments.unbind(-3)[:-1],
        key_increments.unbind(-2)[:-1],
        strict=True,
    ):
        states.append(a[..., None, None] * states[-1] + increment)
        key_states.append(a[..., None] * key_states[-1] + key_increment)
    read = torch.exp(cumulative + offset[..., None] - stabiliser)  # [..., N, C]
    numerator = (q @ torch.stack(states, dim=-3)) * read[..., None]
    total = (q @ torch.stack(key_states, dim=-2)[..., None]).squeeze(-1) * read
    return numerator, total


class MLSTMLayer(nn.Module):
    """The mLSTM layer of one block (module docstring): ``[M, B, T, E] -> [M, B, T, E]``."""

    def __init__(self, members: int, width: int, heads: int, blocks: int, conv: int) -> None:
        super().__init__()
        self.inner = inner = round_up(2 * width)
        self.heads = heads
        self.up = MemberLinear(members, width, 2 * inner, bias=False)
        init_members_(self.up.weight, lambda w: small_init_(w, width))
        self.conv = MemberCausalConv1d(members, inner, conv)  # nn.Conv1d's init, with bias
        # The q, k, v blocks are small-initialised with the model width, not their own.
        self.q = HeadwiseLinear(members, inner // QKV_BLOCK, QKV_BLOCK, width)
        self.k = HeadwiseLinear(members, inner // QKV_BLOCK, QKV_BLOCK, width)
        self.v = HeadwiseLinear(members, inner // QKV_BLOCK, QKV_BLOCK, width)
        # Rows 0..H-1: input gates, H..2H-1: forget gates.
        self.gates = MemberLinear(members, 3 * inner, 2 * heads)
        init_members_(self.gates.weight, nn.init.zeros_)
        init_members_(self.gates.bias_parameter(), self._init_gate_bias)
        self.norm_weight = nn.Parameter(torch.zeros(members, inner))  # head norm's scale 1 + w
        self.skip = nn.Parameter(torch.ones(members, inner))
        self.down = MemberLinear(members, inner, width, bias=False)
        init_members_(self.down.weight, lambda w: wang_init_(w, width, blocks))

    def _init_gate_bias(self, bias: torch.Tensor) -> None:
        """Input gates ~ N(0, 0.1^2); forget gates linspace(3, 6) over the heads."""
        nn.init.normal_(bias[: self.heads], std=0.1)
        bias[self.heads :] = torch.linspace(3.0, 6.0, self.heads)

    def forward(
        self, x: torch.Tensor, cell: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The layer's output; ``cell`` the mLSTM's form: the plain recurrence of
        ``reference_forward``, or by default the chunkwise one, ``mlstm_chunkwise``, looked up
        at each call."""
        members, batch, steps, _ = x.shape
        x_m, z = self.up(x).split(self.inner, dim=-1)
        x_c = F.silu(self.conv(x_m))
        q, k, v = self.q(x_c), self.k(x_c), self.v(x_m)
        igate, fgate = self._gates(x_c, x_m).transpose(-1, -2).chunk(2, -2)
        shape = (members, batch, steps, self.heads, -1)
        q, k, v = (part.view(shape).transpose(2, 3) for part in (q, k, v))
        h = (mlstm_chunkwise if cell is None else cell)(q, k, v, igate, fgate)
        h = head_norm(h.transpose(2, 3), self.norm_weight)
        return self.down((h + self.skip[:, None, None] * x_c) * F.silu(z))

    def _gates(self, x_c: torch.Tensor, x_m: torch.Tensor) -> torch.Tensor:
        """``W_g [q; k; v] + b_g`` with ``W_g`` folded into the block-diagonal q, k, v maps:
        ``(W_gq P_q + W_gk P_k) x_c + W_gv P_v x_m`` (two products of width Ei, not one of
        3 Ei over a concatenation: the same gates, a third of the work)."""
        members, _, _, inner = x_c.shape
        weight_q, weight_k, weight_v = self.gates.weight.split(inner, dim=-1)
        from_c = self._fold(weight_q, self.q) + self._fold(weight_k, self.k)
        bias = self.gates.bias_parameter()[:, None]
        gates = torch.baddbmm(bias, x_c.reshape(members, -1, inner), from_c.transpose(1, 2))
        gates = gates.baddbmm_(
            x_m.reshape(members, -1, inner), self._fold(weight_v, self.v).transpose(1, 2)
        )
        return gates.view(*x_c.shape[:-1], -1)

    @staticmethod
    def _fold(weight: torch.Tensor, projection: HeadwiseLinear) -> torch.Tensor:
        """``weight [M, G, Ei]`` times the block-diagonal ``projection``: ``[M, G, Ei]``."""
        members, rows, inner = weight.shape
        by_block = weight.view(members, rows, projection.blocks, projection.size)
        folded = torch.einsum("mgbo,mboi->mgbi", by_block, projection.weight)
        return folded.reshape(members, rows, inner)


class MLSTMBlock(nn.Module):
    """``x + mLSTMLayer(LN(x))`` (xlstm ``mLSTMBlock``: no feed-forward)."""

    def __init__(self, members: int, width: int, heads: int, blocks: int, conv: int) -> None:
        super().__init__()
        self.norm = ScaledLayerNorm(members, width)
        self.layer = MLSTMLayer(members, width, heads, blocks, conv)

    def forward(
        self, x: torch.Tensor, cell: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        return x + self.layer(self.norm(x), cell)


class MLSTM(XLSTMModel):
    """mLSTM (xLSTM's matrix-memory cell, Beck et al. 2024): stacked pre-up-projection blocks,
    trained in the stabilised parallel form; Grazzi et al.'s formal-language config (xlstm10:
    2 blocks, width 128, 4 heads, conv 4).

    Options: ``layers``, ``width``, ``heads`` (dividing the inner width roundup64(2 width)),
    ``conv_kernel`` (the causal convolution before q and k, at least 1)."""

    name = "mlstm"
    label = "mLSTM"
    defaults: ClassVar[dict[str, Any]] = {**COMMON_DEFAULTS, "conv_kernel": 4}
    # Per token: x_m, z, x_c, q, k, v and their chunked copies (Ei = 2E each), h, the gated
    # output, the residual stream: 10.3-11.6 MB per sequence measured at n = 500 with the
    # default sizes, the chunks' matrices included; this estimates 11.3.
    activation_widths: ClassVar[int] = 32

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        settings = super().check_options(settings)
        # xlstm's CausalConv1d with kernel 0 cannot initialise: the mLSTM needs its conv.
        positive_int("conv_kernel", settings["conv_kernel"])
        inner = round_up(2 * settings["width"])
        if inner % settings["heads"]:
            raise CheBenchError(
                f"mlstm's inner width {inner} (2 x width rounded up to a multiple of 64) is "
                f"not a multiple of heads {settings['heads']}"
            )
        return settings

    def make_block(self, layer: int) -> nn.Module:
        settings = self.settings
        return MLSTMBlock(
            self.members, self.width, self.heads, self.layers, settings["conv_kernel"]
        )

    def reference_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits with every layer's mLSTM run as its plain recurrence, one token at a
        time (``mlstm_recurrent``): what ``check-model`` compares the chunkwise form with."""
        from che_bench.model.state_tracking.mlstm_recurrent import mlstm_recurrent

        tokens, read = self.with_output_tokens(self.member_inputs(inputs))
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, mlstm_recurrent)
        x = read_out_positions(x, read)
        return self.head(x if self.norm is None else self.norm(x))

    def extra_floats(self, tokens: int) -> int:
        """The chunkwise form's [C, C] matrices and [d, d] states, per chunk and head."""
        chunks, chunk = -(-tokens // CHUNK), min(tokens, CHUNK)
        size = round_up(2 * self.width) // self.heads
        per_chunk = CHUNK_MATRICES * chunk * chunk + STATE_MATRICES * size * size
        return self.heads * chunks * per_chunk
