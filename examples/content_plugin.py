"""Three encodings that read the content, one of each kind the attention hooks allow beyond a
data-independent bias (the documentation's snippet; tests/test_plugins.py checks that
``che-bench check-encoding`` passes each).

From this folder: ``che-bench --plugin content_plugin check-encoding gated_distance``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings import AttentionHook, PositionalEncoding, register
from che_bench.encodings.base import scaled_scores
from che_bench.members import MemberLinear


class GatedDistance(AttentionHook):
    """A bias per sequence read from the layer's input: bias[m, b, h, i, j] =
    log sigmoid(w_h . x_j + c_h) * |i - j|, each key's own decay rate."""

    reads_input = True  # prepare(q, k, draw, x=x), x the layer's input [M, B, T, D]
    sequence_bias = True  # bias() has a batch axis: [M or 1, B, H, R, T]
    extra_maps = 1  # the bias map, for the memory plan

    def __init__(self, dim, heads, members):
        super().__init__()
        self.gate = MemberLinear(members, dim, heads)  # parameters lead with the member axis

    def prepare(self, q, k, draw=None, x=None):
        rate = F.logsigmoid(self.gate(x)).transpose(-1, -2)  # [M, B, H, T], once per forward
        return q, k, rate

    def bias(self, rows, length, ctx):
        positions = torch.arange(length, device=ctx.device)
        distance = (positions[rows, None] - positions[None, :]).abs().to(ctx.dtype)
        return ctx[..., None, :] * distance  # [M, B, H, R, T]

    def reference_bias(self, query, key, ctx):  # [M, B, H]
        return ctx[..., key] * abs(query - key)


class QueryTemperature(AttentionHook):
    """Its own scores: q_i . k_j / sqrt(d_h) times softplus(u_h . x_i), a temperature per query
    computed once from x and read per chunk of query rows."""

    reads_input = True

    def __init__(self, dim, heads, members):
        super().__init__()
        self.temperature = MemberLinear(members, dim, heads)

    def prepare(self, q, k, draw=None, x=None):
        return q, k, F.softplus(self.temperature(x)).transpose(-1, -2)  # [M, B, H, T]

    def scores(self, q, k, rows, ctx):
        return scaled_scores(q, k, rows) * ctx[..., rows, None]  # [M, B, H, R, T]


class SigmoidWeights(AttentionHook):
    """Its own normalisation: each key weighed by sigmoid(logit) on its own, no softmax."""

    def normalise(self, logits, rows, future, ctx):
        weights = torch.sigmoid(logits)  # row by row: chunking stays exact
        return weights if future is None else weights.masked_fill(future, 0.0)


class _ContentEncoding(PositionalEncoding):
    hook_class: type

    def __init__(self, **shape):  # no options of its own
        super().__init__(**shape)
        self.hooks = nn.ModuleList(self.make_hook(self.dim, self.heads, self.members)
                                   for _ in range(self.layers))

    def make_hook(self, dim, heads, members):
        return self.hook_class(dim, heads, members)


@register
class GatedDistanceEncoding(_ContentEncoding):
    name, kind, description = "gated_distance", "relative", "log-gate of key j's input x |i - j|"
    carries_bias = True  # DAPE sees the bias per sequence as its bias channels (2H)
    hook_class = GatedDistance


@register
class QueryTemperatureEncoding(_ContentEncoding):
    name, kind, description = "query_temperature", "none", "scores times a temperature from x_i"
    hook_class = QueryTemperature


@register
class SigmoidAttention(_ContentEncoding):
    name, kind, description = "sigmoid_attention", "none", "sigmoid of each logit, no softmax"

    def make_hook(self, dim, heads, members):
        return SigmoidWeights()
