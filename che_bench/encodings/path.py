"""PaTH (Yang et al., NeurIPS 2025): keys seen through an accumulated product of data-dependent
Householder-like matrices ``H_t = I - beta_t w_t w_t^T``; no other position signal (no RoPE: the
transform is the encoding). The mathematics is ``path_transform``, the parameters that read the
layer's input ``x`` are ``path_parameters`` (fla's ``PaTHAttention``: ``w`` from a low-rank map,
a short convolution, SiLU and an L2 normalisation; ``beta = 2 sigmoid(.)``).

Causal (the paper's form, fla's)::

    s_ij = d^-1/2 q_i^T (H_i H_{i-1} ... H_{j+1}) k_j              for j <= i

Bidirectional (the CHE encoder's default; no source defines it, spec §2 [D]): the keys right of
the query go through a second set ``H'_t`` with its own parameters (``w'`` from an anti-causal
convolution, reading tokens ``t .. t+2``), mirrored: ``s_ij = d^-1/2 q_i^T (H'_i ... H'_{j-1})
k_j`` for ``j > i`` (positions ``[i, j)``). A causal model (``build_encoding``'s ``causal``) has
no right side: its scores are exactly the causal form.

PaTH-FoX (``forget_gate``): FoX's forget bias ``D_ij = sum_{s=j+1..i} log f_s`` (mirrored with
a second gate ``f'`` on the right, as ``fox``), per sequence, added to the scores; scaled by
``d^-1/2`` as fla's PaTH-FoX does (``fox_bias_scaled``, the default) or unscaled as FoX. DAPE's
filter takes ``D`` as its bias channels; plain PaTH has no bias (DAPE sees the H score
channels only, as with RoPE).

Initialisation as fla (every weight N(0, 0.02^2), biases 0): at che-bench's width the 1e-6
epsilon of fla's L2 normalisation leaves ``|w|`` about 0.6 at the start (``path_parameters``);
che-bench keeps fla's choice.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from che_bench.encodings.base import AttentionHook, EncodingShape, PositionalEncoding, register
from che_bench.encodings.common import chunk_length, running_sum
from che_bench.encodings.fox import ForgetBias
from che_bench.encodings.path_parameters import PathProjections
from che_bench.encodings.path_transform import (
    BLOCK,
    Householders,
    PreparedPath,
    Side,
    prepare_path,
)
from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Floats of one in-block map (``[., H, T, C]``) that an evaluation prepares at a time: its
#: sequences are prepared a few at a time, so that the transform's work maps (about five such
#: maps) stay small beside the prepared state, which the memory planner counts.
PREPARE_FLOATS = 1 << 22


class PathContext(NamedTuple):
    """What ``prepare`` computes once per forward: the prepared transform and, for PaTH-FoX,
    the forget gates' (scaled) log values ``[M, B, H, T]`` of each side and their running sums
    (``left``: up to t included; ``right``: before t), as ``fox``'s hook keeps them."""

    path: PreparedPath
    forget: dict[str, torch.Tensor] | None


class PathHook(AttentionHook):
    """PaTH's scores (module docstring) from the layer's input: ``prepare`` makes both sides'
    Householder factors and the prepared transform, ``scores`` the rows asked for."""

    reads_input = True
    # Per chunk: the rows' products across blocks, their join, and the keys carried to the
    # chunk's blocks (``4 d / C`` maps' worth per row, below one; ``state_floats`` has the rest).
    score_maps = 3

    def __init__(
        self,
        dim: int,
        heads: int,
        members: int,
        *,
        negative_eigenvalues: bool,
        forget_gate: bool,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads

        def side(anticausal: bool) -> PathProjections:
            return PathProjections(
                members,
                dim,
                heads,
                negative_eigenvalues=negative_eigenvalues,
                forget_gate=forget_gate,
                anticausal=anticausal,
            )

        # A causal model never sees the keys right of the query: no right side.
        self.left, self.right = side(False), None if causal else side(True)

    def prepare(
        self, q: torch.Tensor, k: torch.Tensor, draw: Any = None, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, PathContext]:
        assert x is not None  # reads_input: the attention passes it
        left = self.left(x)
        right = None if self.right is None else self.right(x)
        right_factors = None if right is None else right.householders
        if torch.is_grad_enabled():
            path = prepare_path(q, k, left.householders, right_factors)
        else:
            path = prepare_by_sequences(q, k, left.householders, right_factors)
        log_right = None if right is None else right.log_forget
        return q, k, PathContext(path, self.forget_sums(left.log_forget, log_right))

    def forget_sums(
        self, log_left: torch.Tensor | None, log_right: torch.Tensor | None
    ) -> dict[str, torch.Tensor] | None:
        """PaTH-FoX's context (None without the gate)."""
        return None

    def scores(self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: PathContext):
        return ctx.path.scores(rows).to(q.dtype)

    def state_floats(self, length: int) -> int:
        """Per head: the in-block scores ``T C``, both sides' carried queries and keys ``4 T d``
        and block products ``2 n d^2``; and the carried keys of the two blocks by which a chunk
        may overrun its rows, ``8 T d`` (stacked, then joined)."""
        size = chunk_length(length, BLOCK)
        blocks = -(-length // size)
        d = self.head_dim
        return self.heads * (length * (size + 12 * d) + 2 * blocks * d * d)


def prepare_by_sequences(
    q: torch.Tensor, k: torch.Tensor, left: Householders, right: Householders | None
) -> PreparedPath:
    """``prepare_path`` of ``q, k [M, B, H, T, d]`` a few sequences at a time (``PREPARE_FLOATS``),
    each part written into the whole's tensors (without gradients: evaluation)."""
    batch, heads, length = q.shape[1:4]
    step = max(1, PREPARE_FLOATS // (heads * length * min(length, BLOCK)))
    whole: list[torch.Tensor | None] = []
    first = None
    for start in range(0, batch, step):
        sequences = slice(start, start + step)
        part = prepare_path(
            q[:, sequences],
            k[:, sequences],
            Householders(left.w[:, sequences], left.beta[:, sequences]),
            None
            if right is None
            else Householders(right.w[:, sequences], right.beta[:, sequences]),
        )
        tensors = _tensors(part)
        if first is None:
            first = part
            whole = [
                None if t is None else t.new_empty(t.shape[0], batch, *t.shape[2:]) for t in tensors
            ]
        for target, tensor in zip(whole, tensors, strict=True):
            if target is not None and tensor is not None:
                target[:, sequences] = tensor
    assert first is not None and whole[0] is not None
    sides = tuple(
        Side(side.right, *whole[1 + 3 * index : 4 + 3 * index])
        for index, side in enumerate(first.sides)
    )
    return PreparedPath(first.length, whole[0], sides)


def _tensors(path: PreparedPath) -> list[torch.Tensor | None]:
    """The prepared tensors, the in-block scores first, then each side's three."""
    sides = [(side.queries, side.keys, side.transitions) for side in path.sides]
    return [path.local, *(tensor for side in sides for tensor in side)]


class ForgetPathHook(PathHook):
    """PaTH-FoX: PaTH's scores plus FoX's forget bias per sequence, ``[M, B, H, R, T]``."""

    sequence_bias = True
    extra_maps = 1  # the bias (``fox.ForgetBias``)

    def __init__(
        self,
        dim: int,
        heads: int,
        members: int,
        *,
        negative_eigenvalues: bool,
        scaled: bool,
        causal: bool = False,
    ) -> None:
        super().__init__(
            dim,
            heads,
            members,
            negative_eigenvalues=negative_eigenvalues,
            forget_gate=True,
            causal=causal,
        )
        # fla adds D before the scores' d^-1/2 scaling; the sums are linear in log f.
        self.bias_scale = 1 / math.sqrt(self.head_dim) if scaled else 1.0

    def forget_sums(
        self, log_left: torch.Tensor | None, log_right: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        assert log_left is not None  # built with the gates
        # (A causal model has no right side: nothing right of the query is seen.)
        log_right = torch.zeros_like(log_left) if log_right is None else log_right
        log_left, log_right = log_left * self.bias_scale, log_right * self.bias_scale
        return {
            "log_left": log_left,
            "log_right": log_right,
            "left": running_sum(log_left, from_the_right=False),
            "right": running_sum(log_right, from_the_right=False) - log_right,
        }

    def bias(self, rows: slice, length: int, ctx: PathContext) -> torch.Tensor:
        assert ctx.forget is not None
        return ForgetBias.apply(ctx.forget["left"], ctx.forget["right"], rows.start, rows.stop)

    def reference_bias(self, query: int, key: int, ctx: PathContext) -> torch.Tensor:
        """``[M, B, H]``: the (scaled) gates' logarithms summed over (key, query] or
        [query, key)."""
        assert ctx.forget is not None
        if key <= query:
            return ctx.forget["log_left"][..., key + 1 : query + 1].sum(-1)
        return ctx.forget["log_right"][..., query:key].sum(-1)

    def state_floats(self, length: int) -> int:
        return super().state_floats(length) + 4 * self.heads * length  # the gates' four maps


@register("path_attention")
class PathEncoding(PositionalEncoding):
    """PaTH in every layer, each layer its own parameters (module docstring).

    Options: ``negative_eigenvalues`` (default true: ``beta`` in (0, 2), eigenvalues of ``H_t``
    in (-1, 1); false: ``beta`` in (0, 1), DeltaNet's range, in no PaTH source),
    ``forget_gate`` (default false; true: PaTH-FoX) and ``fox_bias_scaled`` (PaTH-FoX only;
    default true: the forget bias times ``d^-1/2`` as fla; false: unscaled as FoX).
    Parameters per layer and side (left and right): ``64 D + 3 D`` for ``w``, ``(D + 1) H``
    for ``beta``, and with the gate ``(D + 1) H`` more.
    """

    name = "path"
    description = "PaTH: keys through products of data-dependent Householders (no RoPE)."
    # Not "relative": a logit also reads the tokens next to the key's and the query's end
    # through w's short convolution, so check-encoding's translation check (sequences rolled,
    # other tokens in front) does not hold at the sequence's ends.
    kind = "none"

    def __init__(
        self,
        *,
        causal: bool = False,
        negative_eigenvalues: bool = True,
        forget_gate: bool = False,
        fox_bias_scaled: bool = True,
        **shape: Unpack[EncodingShape],
    ) -> None:
        super().__init__(**shape)
        if not (forget_gate or fox_bias_scaled):
            raise CheBenchError("fox_bias_scaled applies to PaTH-FoX only (forget_gate true)")
        dim, heads, members = self.dim, self.heads, self.members
        self.hooks = nn.ModuleList(
            _hook(dim, heads, members, negative_eigenvalues, forget_gate, fox_bias_scaled, causal)
            for _ in range(self.layers)
        )
        # PaTH-FoX carries a bias per sequence (DAPE's bias channels); plain PaTH none.
        self.carries_bias = forget_gate  # type: ignore[misc]
        self.resolved_options = {
            "negative_eigenvalues": negative_eigenvalues,
            "forget_gate": forget_gate,
            "fox_bias_scaled": fox_bias_scaled,
        }


def _hook(
    dim: int,
    heads: int,
    members: int,
    negative: bool,
    forget_gate: bool,
    scaled: bool,
    causal: bool,
) -> PathHook:
    if forget_gate:
        return ForgetPathHook(
            dim, heads, members, negative_eigenvalues=negative, scaled=scaled, causal=causal
        )
    return PathHook(
        dim, heads, members, negative_eigenvalues=negative, forget_gate=False, causal=causal
    )
