"""NoPE: no positional information at all (the sanity baseline)."""

from __future__ import annotations

from che_bench.encodings.base import PositionalEncoding, register


@register("nope")
class NoPositionalEncoding(PositionalEncoding):
    """Nothing is added anywhere; a bidirectional encoder is then permutation-equivariant."""

    name = "none"
    description = "No positional encoding (permutation-equivariant encoder)."
    kind = "none"
