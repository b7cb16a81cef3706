"""DeltaNet, Gated DeltaNet and DeltaProduct (spec state_tracking.md 1.b-1.d): one block
stack, one mixer, one kernel (``delta_rule.delta_product``); the three differ in the forget
gate, the output gate and the number of Householder sub-steps per token.

Block (fla's ``DeltaNetBlock``, pre-norm): ``x += Mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x))``,
final RMSNorm before the read-out; every norm eps 1e-6 (fla's model ``norm_eps``, passed to
the layer's output norm too). Mixer, per token (``d_k = d_v = width / heads``):

1. q, k, v = SiLU(conv4(W x)) (causal depthwise short convolutions, no bias; without them,
   ``short_conv=false``, SiLU(W x), as DeltaProduct's word-problem runs, spec word_problems.md 2.2);
2. q, k L2-normalised per head (fla's ``l2_norm``: ``x / sqrt(|x|^2 + 1e-6)``), q scaled by
   ``d_k^-1/2``; beta = sigmoid(W_b x), doubled under ``negative_eigenvalues`` (Grazzi et al.,
   arXiv 2411.12537: beta in (0, 2), transition eigenvalues in (-1, 1));
3. forget gate (Gated DeltaNet, DeltaProduct): ``g = -exp(A_log) softplus(W_a x + dt_bias)``;
4. the gated delta product (``delta_rule``); per-head RMSNorm of the output, gated by
   ``SiLU(W_g x)`` where the model has an output gate; heads concatenated; ``W_o``.

Departures, chosen for the small formal-language models: ``d_v = d_k = width / heads`` for all
three (fla's Gated DeltaNet and DeltaProduct layers default to ``expand_v = 2`` and head_dim
256); ``negative_eigenvalues`` defaults to false for DeltaProduct too (fla's layer defaults to
true) so that every model's default is the original [0, 1] range.

Initialisation: Grazzi et al.'s fork of fla (GR ``fla/layers/delta_net.py``
``_initialize_weights``, ``fla/models/delta_net/modeling_delta_net.py``), the code behind their
DeltaNet results: the mixer's linear maps xavier-uniform with gain 2^-2.5 (each map with its
own fan-out), short convolutions as ``nn.Conv1d``; embedding, MLP and read-out N(0, 0.02), the
MLP's down-projection divided by sqrt(2 * layers); norms 1. The fork marks the mixer as
initialised before the model's rescaling runs, so its ``o_proj`` keeps xavier unscaled. The
gate's ``A_log``, ``dt_bias`` follow fla's Gated DeltaNet (Mamba-2's): ``A ~ U(0, 16)``,
``dt = exp(U(log 1e-3, log 0.1))`` clamped at 1e-4, ``dt_bias = softplus^-1(dt)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.members import MemberLinear, init_members_, per_member
from che_bench.model.base import positive_int, switch
from che_bench.model.state_tracking.delta_rule import chunk_limit, delta_product
from che_bench.model.state_tracking.delta_rule_fla_rounded import fla_rounded_delta_rule
from che_bench.model.state_tracking.delta_rule_native import native_delta_rule
from che_bench.model.state_tracking.delta_rule_recurrent import recurrent_delta_product
from che_bench.model.state_tracking.layers import MemberCausalConv1d, MemberRMSNorm
from che_bench.model.state_tracking.position_wise import (
    EVERY_POSITION,
    INIT_STD,
    PositionWise,
    SwiGLU,
    at_read_positions,
    read_out_positions,
)
from che_bench.model.state_tracking.stack import COMMON_DEFAULTS, StateTrackingModel

#: fla's model ``norm_eps`` (block norms, final norm and the mixer's output norm).
NORM_EPS = 1e-6
#: The GR fork's xavier gain for the mixer's linear maps.
MIXER_GAIN = 2**-2.5
CONV_SIZE = 4


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + 1e-6)`` over the last axis (fla's ``l2_norm``; finite gradient at 0)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


class DeltaMixer(nn.Module):
    """The delta-rule token mixer ``[M, B, T, width] -> [M, B, T, width]`` (module docstring).
    ``householder``: sub-steps per token; ``forget_gate``, ``output_gate``: whether it has
    them; ``negative_eigenvalues``: beta in (0, 2) instead of (0, 1); ``short_conv``: whether
    it has the short convolution, ``channels_last_conv`` its layout (``MemberCausalConv1d``);
    ``fla_roundings``: inputs in half precision (autocast) take the rule with fla's chunk
    kernel's roundings (``delta_rule_fla_rounded``), the harness's numerics."""

    def __init__(
        self,
        members: int,
        width: int,
        heads: int,
        *,
        householder: int = 1,
        forget_gate: bool = False,
        output_gate: bool = False,
        negative_eigenvalues: bool = False,
        channels_last_conv: bool = False,
        short_conv: bool = True,
        fla_roundings: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.householder = heads, width // heads, householder
        self.fla_roundings = fla_roundings
        self.beta_scale = 2.0 if negative_eigenvalues else 1.0
        self.forget_gate, self.output_gate = forget_gate, output_gate
        n = householder
        # q, k, v (through the short conv), beta, the forget gate's input, the output gate.
        self.sizes = [width, n * width, n * width, n * heads]
        self.sizes += [heads if forget_gate else 0, width if output_gate else 0]
        self.project = MemberLinear(members, width, sum(self.sizes), bias=False, init="torch")
        init_members_(self.project.weight, self._init_projection)
        channels = sum(self.sizes[:3])
        self.conv: nn.Module = nn.Identity()
        if short_conv:
            self.conv = MemberCausalConv1d(
                members, channels, CONV_SIZE, bias=False, channels_last=channels_last_conv
            )
        self.norm = MemberRMSNorm(members, self.head_dim, eps=NORM_EPS)
        self.out = MemberLinear(members, width, width, bias=False, init="torch")
        init_members_(self.out.weight, lambda w: nn.init.xavier_uniform_(w, gain=MIXER_GAIN))
        if forget_gate:
            self.a_log = nn.Parameter(torch.empty(members, heads))
            self.dt_bias = nn.Parameter(torch.empty(members, heads))
            init_members_(self.a_log, lambda a: a.copy_(torch.empty_like(a).uniform_(0, 16).log()))
            init_members_(self.dt_bias, _init_dt_bias)

    def _init_projection(self, weight: torch.Tensor) -> None:
        # One xavier draw per map fla keeps separate (q, k, v, b, a, g): each its own fan-out.
        for part in weight.split(self.sizes):
            if part.shape[0]:
                nn.init.xavier_uniform_(part, gain=MIXER_GAIN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mixer's output at every position."""
        return self.output(*self.recurrence(x), EVERY_POSITION)

    def recurrence(
        self, x: torch.Tensor, rule: Callable[..., torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta product's outputs ``[M, B, T, H, d]`` and the output gate's input (steps
        1-3 and the rule of step 4, ``rule``: the plain recurrence, or by default the fast
        kernels, ``delta_product``, looked up at each call)."""
        members, batch, steps, _ = x.shape
        heads, d = self.heads, self.head_dim
        qkv, beta, gate_in, out_gate = self.project(x).split(
            [sum(self.sizes[:3]), *self.sizes[3:]], dim=-1
        )
        q, k, v = F.silu(self.conv(qkv)).split(self.sizes[:3], dim=-1)
        q = l2_normalise(q.view(members, batch, steps, heads, d)).transpose(2, 3) * d**-0.5
        # Token t's sub-step j is row t * n + j (fla's ``(n h d)`` channel order).
        k = l2_normalise(self._sub_steps(k, d))
        v = self._sub_steps(v, d)
        beta = self._sub_steps(beta, 1).squeeze(-1).sigmoid() * self.beta_scale
        log_decay = None
        if self.forget_gate:
            rate = F.softplus(gate_in + per_member(self.dt_bias, 4))
            log_decay = (-per_member(self.a_log, 4).exp() * rate).transpose(2, 3)
        if rule is None:  # looked up here: tests replace them
            rounded = self.fla_roundings and v.dtype != torch.float32
            rule = fla_rounded_delta_rule if rounded else delta_product
        return rule(q, k, v, beta, log_decay).transpose(2, 3), out_gate

    def output(self, o: torch.Tensor, out_gate: torch.Tensor, ops: PositionWise) -> torch.Tensor:
        """The position-wise output stage (step 4): the per-head norm, the output gate, W_o."""
        members, batch, steps, heads, d = o.shape
        o = ops.norm(self.norm, o)
        if self.output_gate:
            o = o * F.silu(out_gate).view(members, batch, steps, heads, d)
        return ops.linear(self.out, o.reshape(members, batch, steps, heads * d))

    def _sub_steps(self, x: torch.Tensor, d: int) -> torch.Tensor:
        """``[M, B, T, n * H * d]`` as ``[M, B, H, T * n, d]``."""
        members, batch, steps, _ = x.shape
        x = x.view(members, batch, steps, self.householder, self.heads, d)
        return x.permute(0, 1, 4, 2, 3, 5).reshape(members, batch, self.heads, -1, d)


def _init_dt_bias(bias: torch.Tensor) -> None:
    low, high = math.log(1e-3), math.log(0.1)
    dt = (torch.rand_like(bias) * (high - low) + low).exp().clamp(min=1e-4)
    bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


class DeltaBlock(nn.Module):
    """``x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x))``. With ``read``, the output at the
    last ``read`` positions only: the recurrence runs over every position, the position-wise
    stage after it (the mixer's output stage, the residuals and the MLP) at those alone, its
    weight gradients summed over those rows (``every_position_weight_gradients`` false) or,
    bit for bit, as the stage at every position sums them (``position_wise``)."""

    def __init__(
        self,
        members: int,
        width: int,
        layers: int,
        mixer: DeltaMixer,
        every_position_weight_gradients: bool = False,
    ) -> None:
        super().__init__()
        self.mixer_norm = MemberRMSNorm(members, width, eps=NORM_EPS)
        self.mixer = mixer
        self.mlp_norm = MemberRMSNorm(members, width, eps=NORM_EPS)
        self.mlp = SwiGLU(members, width, layers)
        self.every_position_weight_gradients = every_position_weight_gradients

    def forward(self, x: torch.Tensor, read: int | None = None) -> torch.Tensor:
        if read is None:  # the mixer's temporaries are freed before the MLP's
            return self.mlp_residual(x + self.mixer(self.mixer_norm(x)), EVERY_POSITION)
        inputs = (x, *self.mixer.recurrence(self.mixer_norm(x)))
        if self.every_position_weight_gradients:
            return at_read_positions(self.position_wise, inputs, read)
        x, o, out_gate = (read_out_positions(y, read) for y in inputs)
        return self.position_wise(x, o, out_gate, EVERY_POSITION)

    def position_wise(
        self, x: torch.Tensor, o: torch.Tensor, out_gate: torch.Tensor, ops: PositionWise
    ) -> torch.Tensor:
        """The block after its recurrence, for the residual stream ``x`` and the rule's
        outputs ``o`` and output gate's input."""
        return self.mlp_residual(x + self.mixer.output(o, out_gate, ops), ops)

    def mlp_residual(self, x: torch.Tensor, ops: PositionWise) -> torch.Tensor:
        """``x + SwiGLU(RMSNorm(x))``."""
        return x + self.mlp(ops.norm(self.mlp_norm, x), ops)


class DeltaRuleModel(StateTrackingModel):
    """What the three delta-rule models share; a subclass says which gates it has."""

    defaults: ClassVar[dict[str, Any]] = {
        **COMMON_DEFAULTS,
        "negative_eigenvalues": False,
        "short_conv": True,
    }
    #: Whether the last block's weight gradients are summed over every position, as the
    #: block run at every position sums them, bit for bit (``DeltaBlock``), or over the
    #: read-out positions alone, which skips the position-wise stage's forward at the other
    #: positions too but rounds the weight gradients otherwise. The last block's stage runs
    #: at the read-out positions either way. DeltaNet, whose committed results were trained
    #: at every position, keeps their roundings.
    every_position_weight_gradients: ClassVar[bool] = False
    #: The last block's residual stream, rule output and gate input at every position while
    #: its norm, gate and SwiGLU run at the read ones (measured on word_problem at n = 512,
    #: every position read: 1.0 to 1.9 MB a sequence above parity's one read position).
    read_out_widths: ClassVar[int] = 6

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        switch("negative_eigenvalues", settings["negative_eigenvalues"])
        switch("short_conv", settings["short_conv"])
        return super().check_options(settings)

    @classmethod
    def mixer_options(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """The ``DeltaMixer`` keywords that tell the models apart, for a model's ``settings``.
        DeltaNet's short convolution stays channels-first, the layout its committed results
        were trained with."""
        return {
            "householder": 1,
            "forget_gate": False,
            "output_gate": False,
            "channels_last_conv": False,
        }

    def make_block(self, layer: int) -> nn.Module:
        mixer = DeltaMixer(
            self.members,
            self.width,
            self.heads,
            negative_eigenvalues=self.settings["negative_eigenvalues"],
            short_conv=self.settings["short_conv"],
            **self.mixer_options(self.settings),
        )
        return DeltaBlock(
            self.members, self.width, self.layers, mixer, self.every_position_weight_gradients
        )

    def make_final_norm(self) -> nn.Module:
        return MemberRMSNorm(self.members, self.width, eps=NORM_EPS)

    def last_block(self, block: nn.Module, x: torch.Tensor, read: int) -> torch.Tensor:
        return block(x, read)

    def reference_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits with every mixer's rule run as its plain recurrence, one token at a
        time (``recurrent_delta_product``), every block at every position: what
        ``check-model`` compares the chunked and native kernels with."""
        tokens, read = self.with_output_tokens(self.member_inputs(inputs))
        x = self.embedding(tokens)
        for block in self.blocks:
            assert isinstance(block, DeltaBlock)
            o, out_gate = block.mixer.recurrence(block.mixer_norm(x), recurrent_delta_product)
            x = block.position_wise(x, o, out_gate, EVERY_POSITION)
        x = read_out_positions(x, read)
        return self.head(x if self.norm is None else self.norm(x))

    def init_embedding(self, weight: torch.Tensor) -> None:
        nn.init.normal_(weight, std=INIT_STD)

    def init_head(self, weight: torch.Tensor) -> None:
        nn.init.normal_(weight, std=INIT_STD)

    def no_weight_decay(self) -> set[str]:
        """The forget gate's ``a_log`` and ``dt_bias`` only: the harness decays every parameter
        not flagged ``_no_weight_decay`` (GR ``xlstm/experiments/main.py``), and fla flags
        these two (DeltaNet: none; embedding, norms, convolutions and read-out decay)."""
        exempt = ("a_log", "dt_bias")
        return {name for name, _ in self.named_parameters() if name.rsplit(".", 1)[-1] in exempt}

    def extra_floats(self, tokens: int) -> int:
        householder = self.mixer_options(self.settings)["householder"]
        if self.runs_natively():
            # The native kernel's contiguous float32 copies of q, k, v and its output, per
            # sub-step (its saved states, d^2 / 16 a token and head, are smaller).
            return tokens * householder * 4 * self.width
        # Per sub-step: the in-chunk C x C matrices (4 per head at the solve) and about 12
        # width-vectors of keys, values and the solve's operands (measured at n = 500 with the
        # profiler's memory events: 5.2 MB a row for deltanet, 6.5 gated, 11.5 deltaproduct in
        # chunks of 64 rows; with the 16 widths a token of the base estimate this gives 9.2,
        # 9.2 and, in DeltaProduct's chunks of 16 rows, 11.3 MB).
        return tokens * householder * (4 * self.heads * chunk_limit(householder) + 12 * self.width)

    @classmethod
    def has_native_rule(cls, settings: dict[str, Any]) -> bool:
        """Whether the model with ``settings`` has a forget gate or Householder products: the
        rule ``delta_product`` runs natively on a CPU where the kernel is built."""
        options = cls.mixer_options(settings)
        return bool(options["forget_gate"] or options["householder"] > 1)

    def runs_natively(self) -> bool:
        """Whether this model's delta rule runs the native kernel here."""
        on_cpu = next(self.parameters()).device.type == "cpu"
        return self.has_native_rule(self.settings) and on_cpu and native_delta_rule() is not None


class DeltaNet(DeltaRuleModel):
    """DeltaNet (Yang et al. 2024): short convs, L2-normalised q/k, the delta rule per head,
    per-head output RMSNorm, SwiGLU MLP; option negative_eigenvalues (beta in (0, 2)). Trained
    in the chunkwise (WY) form (``delta_rule``); option fla_roundings: under bf16 autocast,
    with the roundings of fla's chunk kernel (``delta_rule_fla_rounded``)."""

    name = "deltanet"
    label = "DeltaNet"
    every_position_weight_gradients = True
    defaults: ClassVar[dict[str, Any]] = {**DeltaRuleModel.defaults, "fla_roundings": False}
    #: fla_roundings rounds the same function otherwise under bf16 autocast, nowhere else.
    inert_options = frozenset({*DeltaRuleModel.inert_options, "fla_roundings"})

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        switch("fla_roundings", settings["fla_roundings"])
        return super().check_options(settings)

    @classmethod
    def mixer_options(cls, settings: dict[str, Any]) -> dict[str, Any]:
        return {**super().mixer_options(settings), "fla_roundings": settings["fla_roundings"]}


class GatedDeltaNet(DeltaRuleModel):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): DeltaNet with a forget gate per head
    and a SiLU output gate; option negative_eigenvalues (beta in (0, 2)). Trained in the
    chunkwise (WY) form with the gate's in-chunk decay (``delta_rule``)."""

    name = "gated_deltanet"
    label = "Gated DeltaNet"

    @classmethod
    def mixer_options(cls, settings: dict[str, Any]) -> dict[str, Any]:
        return {
            "householder": 1,
            "forget_gate": True,
            "output_gate": True,
            "channels_last_conv": True,
        }


class DeltaProduct(DeltaRuleModel):
    """DeltaProduct (Siems et al. 2025): Gated DeltaNet with `householder` delta-rule
    sub-steps per token (default 2); options negative_eigenvalues, forget_gate. Trained as a
    delta rule over the interleaved sub-steps (``delta_rule``)."""

    name = "deltaproduct"
    label = "DeltaProduct"
    defaults: ClassVar[dict[str, Any]] = {
        **DeltaRuleModel.defaults,
        "householder": 2,
        "forget_gate": True,
    }

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        positive_int("householder", settings["householder"])
        switch("forget_gate", settings["forget_gate"])
        return super().check_options(settings)

    @classmethod
    def mixer_options(cls, settings: dict[str, Any]) -> dict[str, Any]:
        # fla's ``use_forget_gate`` (default true) is an option here.
        return {
            "householder": settings["householder"],
            "forget_gate": settings["forget_gate"],
            "output_gate": True,
            "channels_last_conv": True,
        }
