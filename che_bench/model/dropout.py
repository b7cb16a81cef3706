"""Dropout whose evaluation masks do not depend on how a batch is split.

Training draws its masks from torch's global RNG, as ``nn.Dropout`` does (the numbers of every
stored run stay what they were). Evaluating with dropout on (``--dropout-at-eval``, as the
reference code does) draws one seed per member and sequence instead (``sequence_seeds``), and
each mask element is a hash of (seed, dropout site, position, channel): a sequence gets the same
masks whether it is evaluated with the whole sub-batch or in a smaller piece of it (a tight
memory budget, an out-of-memory retry), as the randomized positions do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: splitmix64's constants, as signed 64-bit integers (torch has no unsigned int64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
#: Bits of each hash that make the uniform number compared with the dropout rate.
_UNIFORM_BITS = 24


def sequence_seeds(members: int, batch: int) -> torch.Tensor:
    """One seed per member and sequence (``[M, B]``, int64), from torch's global RNG: the one
    draw of a sub-batch's evaluation dropout, however the forward pass splits it."""
    return torch.randint(0, 1 << 62, (members, batch), dtype=torch.int64)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def keep_mask(
    seeds: torch.Tensor, site: int, positions: int, channels: int, rate: float
) -> torch.Tensor:
    """Which elements of ``[M, B, positions, channels]`` a dropout at ``site`` keeps, a
    function of each sequence's seed (``[M, B]``) and the element's place only."""
    device = seeds.device
    position = torch.arange(positions, device=device, dtype=torch.int64)[:, None]
    channel = torch.arange(channels, device=device, dtype=torch.int64)[None, :]
    place = _mix((site * positions + position) * channels + channel + 1)
    z = _mix(seeds[:, :, None, None] * _GOLDEN + place)
    uniform = _shift_right(z, 64 - _UNIFORM_BITS).to(torch.float32) / (1 << _UNIFORM_BITS)
    return uniform >= rate


class SequenceDropout(nn.Module):
    """``nn.Dropout`` (rate ``p``) that, given each sequence's seed, masks by ``keep_mask``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(
        self, x: torch.Tensor, seeds: torch.Tensor | None = None, site: int = 0
    ) -> torch.Tensor:
        """``x`` is ``[M, B, T, D]``; ``seeds`` (``[M, B]``) select the per-sequence masks."""
        if not self.training or self.p == 0:
            return x
        if seeds is None:
            return F.dropout(x, self.p, True)
        keep = keep_mask(seeds, site, x.shape[2], x.shape[3], self.p)
        return x * keep / (1 - self.p)
