"""Log-length-scaled attention without positions.

Chiang & Cholak, "Overcoming a Theoretical Limitation of Self-Attention" (ACL 2022), scale
the attention logits by log n, n the sequence length, so that attention stays as sharp on
long inputs as on short ones:

    logits_ij = log(T) * q_i . k_j / sqrt(d_h)

Without positional information (NoPE) this only changes the softmax temperature with the
length. ``normalise=true`` divides by log(T_train), T_train the longest training input, so
that the scale is 1 at the longest training length and grows slowly past it.
"""

from __future__ import annotations

import math

import torch

from che_bench.encodings import AttentionHook, PositionalEncoding, register


class LogLengthHook(AttentionHook):
    """Scaled dot-product scores times log(T) / divisor; T = the number of keys."""

    def __init__(self, divisor: float) -> None:
        super().__init__()
        self.divisor = divisor

    def scores(self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx) -> torch.Tensor:
        length = k.shape[-2]
        scale = max(math.log(length), 1.0) / self.divisor  # log 1 = 0 would erase attention
        return super().scores(q, k, rows, ctx) * scale


@register("loglength", "log_n_scaled")
class LogLengthNoPE(PositionalEncoding):
    """NoPE with attention logits scaled by log T (Chiang & Cholak 2022).

    Option: ``normalise`` (false): divide the scale by log(T_train).
    """

    name = "log_length_nope"
    description = "No positions; attention logits scaled by log(length) (Chiang & Cholak 2022)."
    kind = "none"

    def __init__(self, *, dim: int, heads: int, layers: int, train_max_tokens: int,
                 members: int = 1, normalise: bool = False) -> None:
        super().__init__(dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens,
                         members=members)
        divisor = max(math.log(train_max_tokens), 1.0) if normalise else 1.0
        hook = LogLengthHook(divisor)
        self.hooks = torch.nn.ModuleList([hook] * layers)  # no parameters: one hook serves all
        self.resolved_options = {"normalise": bool(normalise)}
