"""The DAPE / DAPE V2 processor of a layer's attention scores, its options' checks and the
``convolution`` implementation of f (the GPU default). See ``che_bench.model.dape``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.errors import CheBenchError
from che_bench.model.dape import native
from che_bench.model.dape.inference import TileFilter
from che_bench.model.dape.kernel import NEGATIVE_SLOPE
from che_bench.model.dape.score_filter import ScoreFilter
from che_bench.model.fused_attention import future_keys

VARIANTS = ("concat_residual", "concat", "add_residual")
IMPLEMENTATIONS = ("auto", "chunks", "convolution")


def auto_implementation(device: torch.device) -> str:
    """The filter ``implementation = "auto"`` picks on ``device``."""
    return "convolution" if device.type == "cuda" else "chunks"


def describe_filter(device: torch.device) -> str:
    """How DAPE's filter runs on ``device`` in this process, for a run's record: on a CPU
    ``native.describe()`` (which compiles the kernel on first use); elsewhere what "auto"
    picks, with nothing compiled."""
    return native.describe() if device.type == "cpu" else auto_implementation(device)


def check_kernel(kernel: object) -> int:
    """Validate a DAPE kernel size (1 = DAPE, odd >= 3 = DAPE V2) and return it."""
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise CheBenchError(
            "DAPE kernel must be a positive odd integer (1 = DAPE, 3/5/7 = DAPE V2), got "
            f"{kernel!r}"
        )
    return kernel


def check_variant(variant: str) -> str:
    """Validate a DAPE variant name and return it."""
    if variant not in VARIANTS:
        raise CheBenchError(f"unknown dape_variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return variant


def _filter_by_convolution(
    content: torch.Tensor,
    bias: torch.Tensor | None,
    weight1: torch.Tensor,
    bias1: torch.Tensor,
    weight2: torch.Tensor,
) -> torch.Tensor:
    """f of every member as grouped ``conv2d`` calls (members are the groups), autograd's
    backward: ``[M, B, C, R, T]`` content and ``[M or 1, 1 or B, C_b, R, T]`` bias ->
    ``[M, B, H, R, T]`` (without f's output bias ``bias2``, which the residual carries)."""
    if bias is not None and bias.shape[1] > 1:  # per sequence: more channels of the content
        content = torch.cat([content, bias.expand(content.shape[0], -1, -1, -1, -1)], 2)
        bias = None
    members, batch, channels, rows, length = content.shape
    kernel, heads = weight1.shape[-1], weight2.shape[1]
    padding = (0, kernel // 2)

    def grouped(weight: torch.Tensor) -> torch.Tensor:  # [M, O, C, k] -> [M*O, C, 1, k]
        return weight.reshape(-1, weight.shape[2], 1, kernel)

    # [B, M*C, R, T]: the members side by side in the channel axis.
    stacked = content.transpose(0, 1).reshape(batch, members * channels, rows, length)
    hidden = F.conv2d(stacked, grouped(weight1[:, :, :channels]), padding=padding, groups=members)
    addend = bias1.reshape(1, -1, 1, 1)
    if bias is not None:  # batch-free: through the first convolution once
        bias_channels = bias.expand(members, -1, -1, -1, -1).reshape(1, -1, rows, length)
        addend = addend + F.conv2d(
            bias_channels, grouped(weight1[:, :, channels:]), padding=padding, groups=members
        )
    hidden = F.leaky_relu(hidden + addend, NEGATIVE_SLOPE)
    out = F.conv2d(hidden, grouped(weight2), padding=padding, groups=members)
    return out.view(batch, members, heads, rows, length).transpose(0, 1)


class DapeProcessor(nn.Module):
    """Per-layer DAPE (``kernel=1``) or DAPE V2 (odd ``kernel >= 3``) score processor.

    Args:
        heads: number of attention heads H (the score channels).
        kernel: key-axis kernel size k.
        width: hidden channels D_DAPE of f.
        variant: ``concat_residual`` (S + Bias + f([S; Bias])), ``concat`` (S + f([S; Bias]))
            or ``add_residual`` (S + Bias + f(S + Bias)).
        with_bias: the encoding carries an additive bias, so f sees it (2H channels for the
            concat variants); without it every variant is ``S + f(S)``.
        tril: zero the entries with key j > query i of f's input (the residual keeps them);
            this is what makes DAPE V2 leak-free in a causal model.
        sequence_bias: the bias has a batch axis, ``[M or 1, B, H, R, T]`` (one per
            sequence); f then always runs as convolutions (the chunks and the native kernel
            take a bias shared by the batch).
        members: the leading axis of every parameter (the models of a pack).

    ``implementation`` (an attribute, "auto" by default) picks how f is computed: "chunks"
    (cache-sized products, the faster on a CPU), "convolution" (grouped cuDNN convolutions,
    the faster on a GPU), or "auto" (by the scores' device).
    """

    def __init__(
        self,
        heads: int,
        kernel: int,
        width: int = 32,
        variant: str = "concat_residual",
        with_bias: bool = False,
        tril: bool = False,
        members: int = 1,
        sequence_bias: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.kernel, self.width = heads, check_kernel(kernel), width
        self.variant, self.with_bias, self.tril = check_variant(variant), with_bias, tril
        self.sequence_bias = with_bias and sequence_bias
        if width < 1:
            raise CheBenchError(f"dape_width must be >= 1, got {width!r}")
        self.concat_bias = with_bias and variant != "add_residual"
        self.implementation = "auto"
        in_channels = 2 * heads if self.concat_bias else heads
        self.weight1 = nn.Parameter(torch.empty(members, width, in_channels, kernel))
        self.bias1 = nn.Parameter(torch.empty(members, width))
        self.weight2 = nn.Parameter(torch.empty(members, heads, width, kernel))
        self.bias2 = nn.Parameter(torch.empty(members, heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default Conv2d/Linear initialisation (uniform, fan-in = channels * k),
        member by member."""
        with torch.no_grad():
            for weights, biases in ((self.weight1, self.bias1), (self.weight2, self.bias2)):
                for weight, bias in zip(weights, biases, strict=False):
                    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
                    bound = 1 / math.sqrt(weight.shape[1] * weight.shape[2])
                    nn.init.uniform_(bias, -bound, bound)

    @property
    def filter_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """f's parameters but its output bias: ``weight1``, ``bias1``, ``weight2``."""
        return self.weight1, self.bias1, self.weight2

    def uses_convolution(self, device: torch.device) -> bool:
        if self.implementation not in IMPLEMENTATIONS:
            raise CheBenchError(
                f"unknown DAPE implementation {self.implementation!r}; valid: "
                + ", ".join(IMPLEMENTATIONS)
            )
        if self.sequence_bias:
            return True
        if self.implementation == "auto":
            return auto_implementation(device) == "convolution"
        return self.implementation == "convolution"

    def transient_channels(self, device: torch.device) -> int:
        """Full-size maps ``[M, B, ., R, T]`` alive at once per row chunk (an estimate: scores,
        filter input, residual, filter output, logits, probabilities; with convolutions also
        f's hidden map before and after its activation and the members-in-channels copies).
        In the chunked filter the hidden map only ever exists for a few sequences at a time."""
        if self.uses_convolution(device):
            # A per-sequence bias joins f's input: its copies as content channels.
            return (12 if self.sequence_bias else 8) * self.heads + 2 * self.width
        return 6 * self.heads

    def _prepared(
        self, bias: torch.Tensor | None, rows: slice | None, num_rows: int, length: int, device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What f and the residual take besides the scores, for ``num_rows`` query ``rows``:
        the residual's batch-free terms (summed first, so that one full-size map is built),
        f's bias channels (or None) and, with ``tril``, the keys j > i zeroed in f's input
        (``[R, T]``, else None)."""
        if (bias is not None) != self.with_bias:
            raise CheBenchError(
                f"DAPE processor built with with_bias={self.with_bias} got bias={bias is not None}"
            )
        residual_terms = self.bias2[:, None, :, None, None]
        if bias is not None and self.variant != "concat":
            residual_terms = residual_terms + bias
        hidden = None
        if self.tril:
            start = 0 if rows is None or rows.start is None else rows.start
            hidden = future_keys(slice(start, start + num_rows), length, device)
        bias_channels = bias if self.concat_bias else None
        if hidden is not None and bias_channels is not None:
            bias_channels = bias_channels.masked_fill(hidden, 0.0)
        return residual_terms, bias_channels, hidden

    def tile_filter(
        self, member: int, bias: torch.Tensor | None, rows: slice, shape: torch.Size
    ) -> TileFilter:
        """Member ``member``'s logits of the query ``rows`` of a ``[B, H, R, T]`` (``shape``)
        score map, tile by tile in place (evaluation on a CPU: ``TileFilter``)."""
        prepared = self._prepared(bias, rows, shape[2], shape[3], self.bias2.device)
        residual_terms, bias_channels, hidden = prepared
        added_bias = bias if self.variant == "add_residual" else None
        return TileFilter(
            member, shape, self.filter_weights, residual_terms, bias_channels, added_bias, hidden
        )

    def forward(
        self, scores: torch.Tensor, bias: torch.Tensor | None = None, rows: slice | None = None
    ) -> torch.Tensor:
        """Logits ``[M, B, H, R, T]`` from scores ``[M, B, H, R, T]`` and bias
        ``[M or 1, 1, H, R, T]`` (``[M or 1, B, H, R, T]`` with ``sequence_bias``); ``rows``
        locates the chunk's query rows (needed only by ``tril``)."""
        num_rows, length = scores.shape[-2:]
        prepared = self._prepared(bias, rows, num_rows, length, scores.device)
        residual_terms, bias_channels, hidden = prepared
        content = scores + bias if self.variant == "add_residual" and bias is not None else scores
        if hidden is not None:
            content = content.masked_fill(hidden, 0.0)
        if self.uses_convolution(scores.device):
            filtered = _filter_by_convolution(
                content, bias_channels, self.weight1, self.bias1, self.weight2
            )
            return filtered + (scores + residual_terms)
        return ScoreFilter.apply(
            scores,
            residual_terms,
            None if content is scores else content,
            bias_channels,
            self.weight1,
            self.bias1,
            self.weight2,
            torch.is_grad_enabled(),  # (inside the Function grad mode is always off)
        )
