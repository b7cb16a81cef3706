"""The narrow interface between the encoder and every positional encoding.

An encoding is built once per model (``PositionalEncoding``). It may add a vector
to the token embeddings (absolute encodings) and it owns one ``AttentionHook`` per
layer (possibly the same module for every layer when parameters are shared). The
attention of ``che_bench.model`` calls, in every layer and forward pass::

    q, k, ctx = hook.prepare(q, k)          # once: RoPE rotation, random draws
    for rows in row_chunks:                 # query rows; one chunk while training
        S = hook.scores(q, k, rows, ctx)    # [B, H, R, T], already scaled by 1/sqrt(d_h)
        bias = hook.bias(rows, T, ctx)      # [1, H, R, T] or None, added after scaling
        logits = S + bias  (or the DAPE processor applied to S and bias)

Every hook is local to a query row, so chunking over rows is exact. Nothing in a
hook may depend on the chunking (random draws happen in ``prepare``).

Encodings with constrained parameters (Kerple) project them back into their valid
range in ``prepare``; the trainer should also call ``encoding.project_()`` after every
optimizer step (a no-op for every other encoding).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

import torch
from torch import nn

from che_bench.errors import CheBenchError

KINDS = ("none", "absolute", "relative")


class AttentionHook(nn.Module):
    """Per-layer part of an encoding. The default is plain scaled dot-product scores."""

    #: True when ``bias`` returns a data-independent additive map (DAPE then sees 2H channels).
    carries_bias: ClassVar[bool] = False
    #: Estimated peak number of float ``[B, H, R, T]`` maps alive inside ``scores`` (for
    #: sizing row chunks from a memory budget; int64 index maps count twice).
    score_maps: ClassVar[int] = 1

    def prepare(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Called once per forward with q, k ``[B, H, T, d_h]``; returns (q, k, ctx)."""
        return q, k, None

    def scores(self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: Any) -> torch.Tensor:
        """Scaled scores of query ``rows`` against all keys: ``[B, H, R, T]``."""
        return torch.matmul(q[:, :, rows], k.transpose(-1, -2)) / math.sqrt(q.shape[-1])

    def bias(self, rows: slice, length: int, ctx: Any) -> torch.Tensor | None:
        """Additive bias ``[1, H, R, T]`` for query ``rows`` (None when there is none)."""
        return None


class PositionalEncoding(nn.Module):
    """One encoding family. Subclasses set the class attributes and build ``hooks``.

    Constructor keywords: ``dim``, ``heads``, ``layers``, ``train_max_tokens`` (the longest
    model input seen in training, T_train_max, used by FIRE's L0 and CoPE's npos) and the
    encoding's own options (documented by each subclass; unknown options are an error).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    kind: ClassVar[str]
    randomized: ClassVar[bool] = False
    carries_bias: ClassVar[bool] = False
    #: Absolute encodings add to the embeddings, which are then dropped out (reference).
    adds_to_embedding: ClassVar[bool] = False

    def __init__(self, *, dim: int, heads: int, layers: int, train_max_tokens: int) -> None:
        super().__init__()
        self.dim, self.heads, self.layers = dim, heads, layers
        self.head_dim = dim // heads
        self.train_max_tokens = train_max_tokens
        self.hooks = nn.ModuleList([AttentionHook() for _ in range(layers)])
        #: Resolved options (defaults filled in); subclasses record theirs here.
        self.resolved_options: dict[str, Any] = {}

    @classmethod
    def option_names(cls) -> list[str]:
        """The encoding-specific keyword options this class accepts."""
        common = {"self", "dim", "heads", "layers", "train_max_tokens"}
        return [p for p in inspect.signature(cls.__init__).parameters if p not in common]

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, T, D]`` (already scaled by sqrt(D)) plus the encoding."""
        return x

    def options(self) -> dict[str, Any]:
        """The options this instance was built with, recorded with every run."""
        return dict(self.resolved_options)

    def project_(self) -> None:
        """Put constrained parameters back into their valid range (call after each optimizer
        step). Only Kerple has such parameters; for every other encoding this does nothing."""
        for hook in self.hooks:
            project = getattr(hook, "project_", None)
            if project is not None:
                project()


_REGISTRY: dict[str, type[PositionalEncoding]] = {}
_ALIASES: dict[str, str] = {}


def register(*aliases: str):
    """Class decorator: make an encoding available under its ``name`` and ``aliases``."""

    def decorate(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if cls.kind not in KINDS:
            raise TypeError(f"{cls.__name__}.kind must be one of {KINDS}")
        for key in (cls.name, *aliases):
            if key in _REGISTRY or key in _ALIASES:
                raise TypeError(f"encoding name {key!r} registered twice")
        _REGISTRY[cls.name] = cls
        _ALIASES.update({alias: cls.name for alias in aliases})
        return cls

    return decorate


def canonical_encoding_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise CheBenchError(
            f"unknown positional encoding {name!r}; valid: {', '.join(sorted(_REGISTRY))}"
        )
    return key


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    return _REGISTRY[canonical_encoding_name(name)]


def list_encodings() -> list[type[PositionalEncoding]]:
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def build_encoding(
    name: str, *, dim: int, heads: int, layers: int, train_max_tokens: int, **options: Any
) -> PositionalEncoding:
    """Build encoding ``name``; an option it does not take is a ``CheBenchError``."""
    cls = get_encoding_class(name)
    unknown = sorted(set(options) - set(cls.option_names()))
    if unknown:
        accepted = ", ".join(cls.option_names()) or "none"
        raise CheBenchError(
            f"encoding {cls.name!r} does not take option(s) {', '.join(unknown)}; "
            f"its options: {accepted}"
        )
    if dim % heads:
        raise CheBenchError(f"model width {dim} is not divisible by {heads} heads")
    return cls(dim=dim, heads=heads, layers=layers, train_max_tokens=train_max_tokens, **options)
