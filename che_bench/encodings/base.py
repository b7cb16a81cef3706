"""The narrow interface between the encoder and every positional encoding.

An encoding is built once per model (``PositionalEncoding``). It may add a vector
to the token embeddings (absolute encodings) and it owns one ``AttentionHook`` per
layer (possibly the same module for every layer when parameters are shared). Every
tensor carries a leading member axis ``M`` (the models of a pack, see
``che_bench.members``): parameters are ``[M, ...]``, activations ``[M, B, ...]``.
The attention of ``che_bench.model.encoder`` calls, in every layer and forward pass:

    q, k, ctx = hook.prepare(q, k, draw)    # once: RoPE rotation; q, k [M, B, H, T, d_h]
                                            # (prepare(q, k, draw, x=x) if hook.reads_input)
    for rows in row_chunks:                 # query rows; one chunk while training
        S = hook.scores(q, k, rows, ctx)    # [M, B, H, R, T], already scaled by 1/sqrt(d_h)
        bias = hook.bias(rows, T, ctx)      # [M or 1, 1, H, R, T] or None, added after scaling
                                            # ([M or 1, B, H, R, T] if hook.sequence_bias)
        logits = S + bias  (or the DAPE processor applied to S and bias)
        weights = softmax(logits, future keys hidden in a causal model)
                  (or hook.normalise(logits, rows, future, ctx) where the hook defines it)
        out = weights @ v

Four kinds of hooks go beyond a data-independent bias (``docs/plugins.md`` shows one of
each): ``reads_input`` hooks get the attention sublayer's input ``x`` ``[M, B, T, D]`` in
``prepare`` (FoX's forget gates); ``sequence_bias`` hooks return a bias per sequence, with a
batch axis (DAPE takes it as its bias channels, as any bias); a hook may override ``scores``
with its own function of q, k and what ``prepare`` computed from x (PaTH's pair-dependent
transform, per row chunk); and a hook may override ``normalise`` to replace the masked
softmax (stick-breaking). ``extra_maps`` and ``state_floats`` tell the memory planner what
the bias, the normalisation and the per-sequence state hold.

Every hook is local to a query row, so chunking over rows is exact. Nothing in a
hook may depend on the chunking, nor draw random numbers: randomized encodings get
their sample (``draw``, one per forward pass of a whole batch, made by
``PositionalEncoding.sample_draws`` from generators of their own) as an argument.

Encodings with constrained parameters (Kerple) project them back into their valid
range in ``prepare``; the trainer should also call ``encoding.project_()`` after every
optimizer step (a no-op for every other encoding).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict, cast

import torch
from torch import nn

from che_bench.errors import CheBenchError, accepted_text
from che_bench.registry import Registry
from che_bench.setting_types import spelt_default

KINDS = ("none", "absolute", "relative")
#: A constructor's ``*args`` and ``**shape``: what it passes on, not options of its own.
PASSED_ON = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class _ModelShape(TypedDict):
    dim: int
    heads: int
    layers: int
    train_max_tokens: int


class EncodingShape(_ModelShape, total=False):
    """The keywords of the model's shape that every encoding's constructor takes and passes on
    to ``PositionalEncoding``'s (``**shape: Unpack[EncodingShape]``); ``members`` is 1 when not
    given."""

    members: int


@dataclass
class Draws:
    """The random sample of one forward pass: ``embedding`` for absolute encodings (positions
    ``[M, T]``), ``layers`` (one entry per layer) for attention-side ones."""

    embedding: torch.Tensor | None = None
    layers: list[Any] | None = None

    def layer(self, index: int) -> Any:
        return None if self.layers is None else self.layers[index]

    def to(self, device: torch.device) -> Draws:
        """The sample on ``device``; to a GPU from pinned memory, without waiting for it.
        A sample shared by several layers is moved once."""
        if device.type == "cpu":
            return self
        moved: dict[int, Any] = {}

        def move(item: Any) -> Any:
            if id(item) not in moved:
                if isinstance(item, tuple):
                    moved[id(item)] = tuple(move(part) for part in item)
                else:
                    moved[id(item)] = item.pin_memory().to(device, non_blocking=True)
            return moved[id(item)]

        return Draws(
            None if self.embedding is None else move(self.embedding),
            None if self.layers is None else [move(item) for item in self.layers],
        )


def scaled_scores(
    q: torch.Tensor, k: torch.Tensor, rows: slice, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``q[rows] k^T / sqrt(d_h)``, ``[M, B, H, R, T]`` (the default hook's scores), written
    into ``out`` when given."""
    # Scaled in place: the same values, without a second full-size map.
    return torch.matmul(q[..., rows, :], k.transpose(-1, -2), out=out).div_(math.sqrt(q.shape[-1]))


def biased_scores(
    q: torch.Tensor, k: torch.Tensor, rows: slice, bias: torch.Tensor
) -> torch.Tensor:
    """``bias + q[rows] k^T / sqrt(d_h)`` as one product, ``[M, B, H, R, T]`` for a bias that
    broadcasts to it (one map where the sum of the scores and the bias makes two)."""
    queries = q[..., rows, :]
    shape = (*queries.shape[:-1], k.shape[-2])
    out = torch.baddbmm(
        bias.expand(shape).reshape(-1, *shape[-2:]),
        queries.reshape(-1, *queries.shape[-2:]),
        k.reshape(-1, *k.shape[-2:]).transpose(1, 2),
        alpha=1 / math.sqrt(q.shape[-1]),
    )
    return out.view(shape)


class AttentionHook(nn.Module):
    """Per-layer part of an encoding. The default is plain scaled dot-product scores."""

    #: Estimated peak number of float ``[B, H, R, T]`` maps alive inside ``scores`` (for
    #: sizing row chunks from a memory budget; int64 index maps count twice).
    score_maps: ClassVar[int] = 1
    #: Float ``[B, H, R, T]`` maps alive beyond the scores' and the softmax's: a per-sequence
    #: bias (``sequence_bias``: one), the work maps of an own ``normalise``.
    extra_maps: ClassVar[int] = 0
    #: ``prepare`` takes the attention sublayer's input: called as
    #: ``prepare(q, k, draw, x=x)`` with ``x`` ``[M, B, T, D]`` (else without ``x``).
    reads_input: ClassVar[bool] = False
    #: ``bias`` has a batch axis, ``[M or 1, B, H, R, T]``: a bias per sequence (computed
    #: from ``x`` in ``prepare``); else it is ``[M or 1, 1, H, R, T]``.
    sequence_bias: ClassVar[bool] = False

    def prepare(
        self, q: torch.Tensor, k: torch.Tensor, draw: Any = None, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Called once per forward with q, k ``[M, B, H, T, d_h]``, this layer's random
        sample (None unless the encoding is randomized and drawing) and, for a hook that sets
        ``reads_input``, the layer's input ``x`` ``[M, B, T, D]``; returns (q, k, ctx)."""
        return q, k, None

    def scores(self, q: torch.Tensor, k: torch.Tensor, rows: slice, ctx: Any) -> torch.Tensor:
        """Scaled scores of query ``rows`` against all keys: ``[M, B, H, R, T]``."""
        return scaled_scores(q, k, rows)

    def bias(self, rows: slice, length: int, ctx: Any) -> torch.Tensor | None:
        """Additive bias ``[M or 1, 1, H, R, T]`` for query ``rows``: a member axis of M when
        it has learned parameters (each ``[M, ...]``), of 1 when every member has the same
        bias; with ``sequence_bias``, ``[M or 1, B, H, R, T]`` (one per sequence). None unless
        the encoding class sets ``carries_bias`` (che-bench reads that attribute of the
        encoding, before building the model, to give DAPE the extra channels;
        ``check-encoding`` checks that the two agree)."""
        return None

    def normalise(
        self, logits: torch.Tensor, rows: slice, future: torch.Tensor | None, ctx: Any
    ) -> torch.Tensor:
        """The attention weights ``[M, B, H, R, T]`` of the query ``rows`` from their logits
        (scores plus bias, or DAPE's): the softmax over the keys, with the keys where
        ``future`` (``[R, T]``, True where key j > query i; None in a bidirectional model) is
        True hidden. A hook that overrides it replaces the softmax (the attention calls it
        with the unmasked logits); it must stay local to each query row."""
        return torch.softmax(
            logits if future is None else logits.masked_fill(future, -math.inf), -1
        )

    def state_floats(self, length: int) -> int:
        """Floats per sequence (and member) that ``prepare`` keeps for the whole forward pass
        over ``length`` tokens (per-sequence state; 0 by default), for the memory planner."""
        return 0

    def reference_bias(self, query: int, key: int, ctx: Any) -> torch.Tensor | None:
        """The bias of query ``query`` over key ``key`` computed straight from its formula,
        one pair at a time: ``[M or 1, 1, H]`` (``[M or 1, B, H]`` with ``sequence_bias``), or
        None (the default): no reference. ``check-encoding`` compares ``bias`` with it at
        every (query, key): declare it to have a map with the right shape but the wrong
        (i, j) caught (transposed, say)."""
        return None


def prepare_hook(
    hook: AttentionHook, q: torch.Tensor, k: torch.Tensor, draw: Any, x: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``hook.prepare``, given the layer's input ``x`` when the hook reads it (a hook that
    does not is called as before, so its ``prepare`` need not take ``x``)."""
    if hook.reads_input:
        if x is None:
            raise CheBenchError(f"{type(hook).__name__} reads the layer's input, which is missing")
        return hook.prepare(q, k, draw, x=x)
    return hook.prepare(q, k, draw)


def own_scores(hook: AttentionHook) -> bool:
    """Whether the hook replaces the plain scaled scores."""
    return type(hook).scores is not AttentionHook.scores


def own_normalisation(hook: AttentionHook) -> bool:
    """Whether the hook replaces the masked softmax (``normalise``)."""
    return type(hook).normalise is not AttentionHook.normalise


class PositionalEncoding(nn.Module):
    """One encoding family. Subclasses set the class attributes and build ``hooks``.

    Constructor keywords: the model's shape, ``dim``, ``heads``, ``layers``,
    ``train_max_tokens`` (the longest model input seen in training, T_train_max, used by
    FIRE's L0 and CoPE's npos) and ``members`` (the leading axis of every parameter), which
    this constructor takes and keeps as attributes, and the encoding's own options (documented
    by each subclass; unknown options are an error). A subclass names its options and passes
    the shape on, then reads it from ``self``::

        def __init__(self, *, power: float = 1.0, **shape: Unpack[EncodingShape]) -> None:
            super().__init__(**shape)
            self.hooks = nn.ModuleList(MyHook(self.heads, power) for _ in range(self.layers))
    """

    name: ClassVar[str]
    description: ClassVar[str]
    kind: ClassVar[str]
    randomized: ClassVar[bool] = False
    #: True when the hooks' ``bias`` returns an additive map, data-independent or (hooks with
    #: ``sequence_bias``) per sequence (DAPE then sees 2H channels); the hooks themselves have
    #: no such attribute.
    carries_bias: ClassVar[bool] = False
    #: Absolute encodings add to the embeddings, which are then dropped out (reference).
    adds_to_embedding: ClassVar[bool] = False
    #: Options that change neither the parameters nor the logits (``check-encoding`` checks
    #: that every other option changes one of them).
    inert_options: ClassVar[frozenset[str]] = frozenset()
    #: Every value an option takes, where ``check-encoding`` cannot make one up (a string):
    #: ``{"alibi_mode": ("symmetric", "causal")}``; each must build and change the logits.
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def __init__(
        self, *, dim: int, heads: int, layers: int, train_max_tokens: int, members: int = 1
    ) -> None:
        super().__init__()
        self.dim, self.heads, self.layers, self.members = dim, heads, layers, members
        self.head_dim = dim // heads
        self.train_max_tokens = train_max_tokens
        self.hooks = nn.ModuleList([AttentionHook() for _ in range(layers)])
        #: Resolved options (defaults filled in); subclasses record theirs here.
        self.resolved_options: dict[str, Any] = {}

    @classmethod
    def option_names(cls) -> list[str]:
        """The encoding-specific keyword options this class accepts."""
        common = {"self", "dim", "heads", "layers", "train_max_tokens", "members", "causal"}
        return [
            name
            for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if name not in common and parameter.kind not in PASSED_ON
        ]

    def layer_hooks(self) -> list[AttentionHook]:
        """The attention hook of every layer, in order."""
        return [cast(AttentionHook, hook) for hook in self.hooks]

    def embed(self, x: torch.Tensor, draws: Draws | None = None) -> torch.Tensor:
        """Token embeddings ``[M, B, T, D]`` (already scaled by sqrt(D)) plus the encoding."""
        return x

    def draws_active(self, evaluating: bool) -> bool:
        """Whether a forward pass draws random positions (randomized encodings only)."""
        return False

    def max_tokens(self) -> int | None:
        """The longest model input this encoding can take (None: no limit)."""
        return None

    def sample_draws(self, length: int, generators: list[torch.Generator]) -> Draws:
        """One random sample for a forward pass over sequences of ``length`` tokens, one
        per member from its generator (randomized encodings only)."""
        raise NotImplementedError(f"encoding {self.name!r} draws nothing")

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


ENCODINGS: Registry[type[PositionalEncoding]] = Registry("positional encoding")


def register(*aliases: Any):
    """Class decorator: make an encoding available under its ``name`` and ``aliases``
    (``@register`` or ``@register("alias", ...)``; the built-ins and plugins alike; a name
    already taken is a CheBenchError)."""

    def decorate(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if getattr(cls, "kind", None) not in KINDS:
            raise CheBenchError(f"encoding class {cls.__name__}: kind must be one of {KINDS}")
        ENCODINGS.add(cls.name, cls, aliases)
        return cls

    if len(aliases) == 1 and isinstance(aliases[0], type):  # bare @register
        cls, aliases = aliases[0], ()
        return decorate(cls)
    return decorate


def canonical_encoding_name(name: str) -> str:
    return ENCODINGS.canonical(name)


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    return ENCODINGS.get(name)


def list_encodings() -> list[type[PositionalEncoding]]:
    """Every registered encoding class, by name."""
    return [ENCODINGS.get(name) for name in sorted(ENCODINGS.names())]


def given_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Encoding ``name``'s ``options`` less those spelt out at the default its constructor
    declares (``spelt_default``): an option given at its default is the run without it."""
    parameters = inspect.signature(get_encoding_class(name).__init__).parameters
    return {
        key: value
        for key, value in options.items()
        if key not in parameters or not spelt_default(value, parameters[key].default)
    }


def build_encoding(
    name: str,
    *,
    dim: int,
    heads: int,
    layers: int,
    train_max_tokens: int,
    members: int = 1,
    causal: bool = False,
    **options: Any,
) -> PositionalEncoding:
    """Build encoding ``name``; an option it does not take, or refuses (with a CheBenchError
    or a ValueError), is a ``CheBenchError``. ``causal``: whether the model's attention is
    causal, passed to an encoding whose constructor takes it (one with a bidirectional form
    builds no parameters for the keys right of the query in a causal model)."""
    cls = get_encoding_class(name)
    unknown = sorted(set(options) - set(cls.option_names()))
    if unknown:
        raise CheBenchError(
            f"encoding {cls.name!r} does not take option(s) {', '.join(unknown)}; "
            f"{accepted_text(cls.option_names())}"
        )
    if dim % heads:
        raise CheBenchError(f"model width {dim} is not divisible by {heads} heads")
    return ENCODINGS.instantiate(
        cls,
        dim=dim,
        heads=heads,
        layers=layers,
        train_max_tokens=train_max_tokens,
        members=members,
        **({"causal": causal} if "causal" in inspect.signature(cls.__init__).parameters else {}),
        **options,
    )
