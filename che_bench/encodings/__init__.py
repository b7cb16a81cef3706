"""Positional encodings; importing this package registers every built-in family (plugins
register theirs with the same ``register`` decorator, see ``che_bench.plugins``).

``list_encodings()`` gives the classes; each has ``name``, a one-line ``description``,
``kind`` ("none" | "absolute" | "relative"), ``randomized``, ``carries_bias`` (an additive
map, data-independent or per sequence, that DAPE consumes as extra channels) and
``option_names()``.
"""

# Each module registers its encodings on import.
from che_bench.encodings import (  # noqa: F401
    alibi,
    cope,
    fire,
    fox,
    kerple,
    learned,
    nope,
    path,
    relative,
    rope,
    sin_cos,
    stick_breaking,
    t5,
)
from che_bench.encodings.base import (
    AttentionHook,
    PositionalEncoding,
    build_encoding,
    canonical_encoding_name,
    get_encoding_class,
    given_options,
    list_encodings,
    register,
)

__all__ = [
    "AttentionHook",
    "PositionalEncoding",
    "build_encoding",
    "canonical_encoding_name",
    "get_encoding_class",
    "given_options",
    "list_encodings",
    "register",
]
