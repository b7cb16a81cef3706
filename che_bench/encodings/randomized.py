"""Random draws of the randomized positional encodings (Ruoss et al., 2023).

Positions are replaced by a sorted sample of distinct integers from a larger range
``[0, L)`` with ``L = noise_max_length``; relative methods sample sorted distinct
offset magnitudes from ``[1, L)`` instead. One sample serves every sequence of a batch.

Draws come from generators of their own, one per member of a pack, never from torch's
global RNG (which dropout uses: changing the dropout rate must not move the positions),
and they are made once per forward pass of a whole batch (``Encoder.sample_draws``), so
splitting a batch into sub-batches or row chunks never changes them. Samples are drawn
on the CPU and handed to the hooks as ``Draws``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from che_bench.encodings.base import Draws
from che_bench.errors import CheBenchError

DEFAULT_NOISE_MAX_LENGTH = 2048

#: ``sample(length, limit, generators)`` -> one layer's sample, a tensor or a tuple of them.
Sampler = Callable[[int, int, list[torch.Generator]], Any]


def sample_sorted(
    count: int, limit: int, generators: list[torch.Generator], *, start: int = 0
) -> torch.Tensor:
    """``count`` distinct integers from ``[start, limit)``, ascending, for each member's
    generator: ``[M, count]`` (long, CPU)."""
    available = limit - start
    if count > available:
        raise CheBenchError(
            f"randomized encoding: cannot draw {count} distinct positions from "
            f"[{start}, {limit}); raise noise_max_length above the longest sequence"
        )
    drawn = torch.stack([torch.randperm(available, generator=g)[:count] for g in generators])
    return drawn.sort(dim=1).values + start


#: A layer's randomized (left, right) distances, each ``[M, T-1]`` (see ``sample_distances``).
Distances = tuple[torch.Tensor, torch.Tensor]


def sample_distances(
    length: int, limit: int, generators: list[torch.Generator], both_sides: bool
) -> Distances:
    """Randomized distances for the offset-sampling variants (relative, ALiBi): sorted
    ``s_1 < ... < s_{T-1}`` from ``[1, limit)`` replace token distances ``1..T-1``. Returns
    (left, right), each ``[M, T-1]``: the same draw mirrored, or two independent draws with
    ``both_sides``."""
    right = sample_sorted(length - 1, limit, generators, start=1)
    left = sample_sorted(length - 1, limit, generators, start=1) if both_sides else right
    return left, right


@dataclass(frozen=True)
class RandomOptions:
    """The switches shared by the randomized encodings."""

    noise_max_length: int = DEFAULT_NOISE_MAX_LENGTH
    #: Also draw when evaluating (the reference does); False uses plain positions there,
    #: whether or not dropout stays on.
    randomize_at_eval: bool = True

    def __post_init__(self) -> None:
        if self.noise_max_length < 2:
            raise CheBenchError(f"noise_max_length must be >= 2; got {self.noise_max_length}")

    def active(self, evaluating: bool) -> bool:
        """Whether a forward pass in this phase uses random positions."""
        return not evaluating or self.randomize_at_eval

    def recorded(self) -> dict[str, Any]:
        """These options under their option names, for ``resolved_options``."""
        return {
            "noise_max_length": self.noise_max_length,
            "randomize_at_eval": self.randomize_at_eval,
        }


class RandomPositions:
    """Mixin for an absolute encoding (before it in the bases): the positions added to the
    embeddings become a sorted draw ``[M, T]`` from ``[0, noise_max_length)``, one per
    forward pass (all layers, all sequences of the batch)."""

    randomized: ClassVar[bool] = True
    #: Set by the constructor of the encoding.
    random: RandomOptions

    def draws_active(self, evaluating: bool) -> bool:
        return self.random.active(evaluating)

    def max_tokens(self) -> int:
        return self.random.noise_max_length

    def sample_draws(self, length: int, generators: list[torch.Generator]) -> Draws:
        return Draws(embedding=sample_sorted(length, self.random.noise_max_length, generators))


class LayerDraws:
    """The samples of the attention layers of one forward pass.

    Per layer (the reference): every layer draws its own sample. Shared: one sample serves
    every layer of the forward pass.
    """

    def __init__(
        self, random: RandomOptions, per_layer: bool, layers: int, sampler: Sampler
    ) -> None:
        self.random, self.per_layer, self.layers, self.sampler = random, per_layer, layers, sampler

    def recorded(self) -> dict[str, Any]:
        """The options of the draws under their option names, for ``resolved_options``."""
        return {**self.random.recorded(), "random_per_layer": self.per_layer}

    def sample(self, length: int, generators: list[torch.Generator]) -> Draws:
        limit = self.random.noise_max_length
        if not self.per_layer:
            return Draws(layers=[self.sampler(length, limit, generators)] * self.layers)
        return Draws(layers=[self.sampler(length, limit, generators) for _ in range(self.layers)])


class DistanceDraws(LayerDraws):
    """The layers' draws of a randomized relative bias (ALiBi, Transformer-XL): sorted
    distances (``sample_distances``), the right side's mirrored to the left or, with
    ``both_sides``, drawn again."""

    def __init__(
        self, random: RandomOptions, per_layer: bool, layers: int, both_sides: bool
    ) -> None:
        super().__init__(
            random, per_layer, layers, partial(sample_distances, both_sides=both_sides)
        )
        self.both_sides = both_sides

    def recorded(self) -> dict[str, Any]:
        return {**super().recorded(), "randomize_both_sides": self.both_sides}


class RandomizedLayers:
    """Mixin for an attention-side encoding (before it in the bases) whose hooks take a
    random sample per layer from ``layer_draws``."""

    randomized: ClassVar[bool] = True
    #: Set by the constructor of the encoding.
    layer_draws: LayerDraws

    def draws_active(self, evaluating: bool) -> bool:
        return self.layer_draws.random.active(evaluating)

    def max_tokens(self) -> int:
        return self.layer_draws.random.noise_max_length

    def sample_draws(self, length: int, generators: list[torch.Generator]) -> Draws:
        return self.layer_draws.sample(length, generators)
