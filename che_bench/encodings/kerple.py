"""KERPLE kernelized relative biases (log and power kernels), two-sided for an encoder."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import check_choice, layer_hooks, toeplitz_rows, two_sided
from che_bench.members import init_members_

if TYPE_CHECKING:
    from typing_extensions import Unpack

BIDIRECTIONAL = ("two_sided", "symmetric_offset")
#: Lower bound of every Kerple parameter (the KERPLE code's projection).
MIN_PARAM = 0.01
#: Upper bound of the power kernel's exponent.
MAX_EXPONENT = 2.0


class KerpleHook(AttentionHook):
    """Kerple bias for distance ``d = |i - j|`` with per-head ``r1, r2 > 0`` (``[M, sides, H]``):

    * log kernel: ``-r1 * log(1 + r2 * d)``;
    * power kernel: ``-r1 * d ** r2`` with ``r2 <= 2``.

    ``two_sided`` keeps separate ``(r1, r2)`` for keys left (``j < i``) and right (``j > i``)
    of the query; ``symmetric_offset`` uses one set with ``d - 0.5`` for left keys (ALiBi's
    trick). The diagonal gets 0. Positivity is kept by projection (``project_``), not by a
    reparameterization.
    """

    def __init__(self, heads: int, kernel: str, bidirectional: str, members: int) -> None:
        super().__init__()
        self.kernel, self.bidirectional = kernel, bidirectional
        sides = 2 if bidirectional == "two_sided" else 1
        # Init of the KERPLE code: log r1 ~ U(0, 2), r2 ~ U(0, 1); power r1 ~ U(0, 1), r2 ~ U(0, 2).
        r1_high, r2_high = (2.0, 1.0) if kernel == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.empty(members, sides, heads))
        self.r2 = nn.Parameter(torch.empty(members, sides, heads))
        init_members_(self.r1, lambda r: nn.init.uniform_(r, 0.0, r1_high))
        init_members_(self.r2, lambda r: nn.init.uniform_(r, 0.0, r2_high))

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp the parameters into their valid range in place. Edits ``.data`` so that a
        module shared by several layers does not invalidate the autograd graph of the
        layers that already used it in this forward pass."""
        self.r1.data.clamp_(min=MIN_PARAM)
        max_r2 = MAX_EXPONENT if self.kernel == "power" else None
        self.r2.data.clamp_(min=MIN_PARAM, max=max_r2)

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        draw: None = None,
        x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        self.project_()
        return q, k, None

    def side_bias(self, distance: torch.Tensor, side: int) -> torch.Tensor:
        """``[M, H, len(distance)]`` kernel values of one parameter set (distances > 0)."""
        r1, r2 = self.r1[:, side, :, None], self.r2[:, side, :, None]
        if self.kernel == "log":
            return -r1 * torch.log1p(r2 * distance)
        return -r1 * distance.pow(r2)

    def bias(self, rows: slice, length: int, ctx: None) -> torch.Tensor:
        distance = torch.arange(1, length, device=self.r1.device, dtype=torch.float32)
        if self.bidirectional == "two_sided":
            left, right = self.side_bias(distance, 0), self.side_bias(distance, 1)
        else:
            left, right = self.side_bias(distance - 0.5, 0), self.side_bias(distance, 0)
        return toeplitz_rows(two_sided(left, right), rows, length)[:, None]


class _KerpleEncoding(PositionalEncoding):
    """Shared construction of the two Kerple kernels."""

    kind = "relative"
    carries_bias = True
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {"kerple_bidir": BIDIRECTIONAL}
    kernel: str

    def __init__(
        self,
        *,
        kerple_bidir: str = "two_sided",
        share_across_layers: bool = False,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        check_choice("kerple_bidir", kerple_bidir, BIDIRECTIONAL)
        # Shared: the KERPLE repo; per layer: the DAPE repo (which produced the DAPE tables).
        self.hooks = layer_hooks(
            lambda: KerpleHook(self.heads, self.kernel, kerple_bidir, self.members),
            self.layers,
            share_across_layers,
        )
        self.resolved_options = {
            "kerple_bidir": kerple_bidir,
            "share_across_layers": share_across_layers,
        }


@register("kerple_log")
class KerpleLogEncoding(_KerpleEncoding):
    """Kerple logarithmic kernel ``-r1 log(1 + r2 |i - j|)``, per layer, two-sided.

    Options: ``kerple_bidir`` ("two_sided" (default): separate parameters for left and right
    keys; "symmetric_offset": one set, left distances reduced by 0.5),
    ``share_across_layers`` (False). Call ``project_()`` after each optimizer step.
    """

    name = "kerple"
    description = "Kerple log kernel bias -r1*log(1 + r2*|i-j|), separate left/right parameters."
    kernel = "log"


@register()
class KerplePowerEncoding(_KerpleEncoding):
    """Kerple power kernel ``-r1 |i - j|^r2`` (``0 < r2 <= 2``), per layer, two-sided.

    Options as for ``kerple``.
    """

    name = "kerple_power"
    description = "Kerple power kernel bias -r1*|i-j|^r2, separate left/right parameters."
    kernel = "power"
