"""CHE's autoregressive transformer (CHE models/transformer.py ``make_transformer``): an
encoder over the input tokens and a decoder with causal self-attention and cross-attention to
the encoded input, trained with teacher forcing and decoded greedily at test time.

Training (``forward(inputs, targets=...)``): the decoder reads the targets shifted right by
one, a start token (id ``output_size``) first (CHE ``shift_right``), and returns the logits of
every output position at once. Without targets (evaluation) the decoder is fed its own
argmax outputs, one position at a time (CHE experiments/utils.py
``add_sampling_to_autoregressive_model``, which reruns the model on the whole prediction per
position; here each step runs only the new position over the keys and values cached from the
earlier ones, which gives the same logits since position t sees positions <= t only).

Positional encodings (``pe``, any che-bench encoding whose scores are a function of the
query and key positions): absolute ones add to the encoder's and the decoder's embeddings;
relative ones act in every attention, the cross-attention's queries at the output positions
0..T_out-1 and keys at the input positions 0..T_in-1 (as CHE applies RoPE, ALiBi and
Transformer-XL in its cross-attention). Refused: FIRE and CoPE (positions normalised by, or
counted over, the keys of one sequence, which cross-attention between two does not define),
randomized encodings (a draw per sequence length, not per decoding step), encodings that read
the layer's input or replace the softmax (FoX, stick-breaking) and DAPE.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.encodings import AttentionHook, PositionalEncoding, build_encoding
from che_bench.encodings.base import (
    canonical_encoding_name,
    get_encoding_class,
    own_normalisation,
)
from che_bench.errors import CheBenchError
from che_bench.members import MemberEmbedding, MemberLayerNorm, MemberLinear
from che_bench.model.attention import Attention, Block, rows_per_chunk
from che_bench.model.base import BenchModel, positive_int
from che_bench.model.dropout import SequenceDropout, keep_mask, sequence_seeds
from che_bench.model.recurrent import PRESETS as CHE_PRESETS
from che_bench.tasks.base import Task

#: Encodings this model refuses, and why (randomized ones are refused as a family).
REFUSED_ENCODINGS = {
    "fire": "FIRE normalises by the keys on a query's side of one sequence, which "
    "cross-attention between the output and the input does not define",
    "cope": "CoPE counts positions over the keys between query and key in one sequence, "
    "which cross-attention between the output and the input does not define",
}


def _drop(dropout: SequenceDropout, x: torch.Tensor, seeds: Any, site: int, row: Any) -> Any:
    """``dropout(x)``; for one decoding step (``row`` = (position, length)) with evaluation
    seeds, the mask row of that position in the whole output, as teacher forcing draws it."""
    if row is None or seeds is None or not dropout.training or dropout.p == 0:
        return dropout(x, seeds, site)
    position, length = row
    keep = keep_mask(seeds, site, length, x.shape[-1], dropout.p)[:, :, position : position + 1]
    return x * keep / (1 - dropout.p)


class CrossAttention(nn.Module):
    """Attention of the decoder's positions to the encoded input, through an encoding's hook:
    queries at output positions ``first..first+R-1``, keys at input positions ``0..T_in-1``,
    both laid out in one square of side ``max`` so that the hook's (self-attention) interface
    applies unchanged; the padding rows and keys are never read."""

    def __init__(
        self, dim: int, heads: int, hook: AttentionHook, budget: int, members: int
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.hook = heads, dim // heads, hook
        self.memory_budget_bytes = budget
        self.query, self.key, self.value, self.output = (
            MemberLinear(members, dim, dim, bias=False) for _ in range(4)
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:3], self.heads, self.head_dim).transpose(2, 3)

    def keys(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[M, B, H, T_in, d_h]`` of the encoded input (once per sequence)."""
        return self._heads(self.key(memory)), self._heads(self.value(memory))

    def forward(
        self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], first: int = 0
    ) -> torch.Tensor:
        """The output ``[M, B, R, D]`` of ``x``'s R positions (output positions ``first``..)
        over ``kv`` (``keys``)."""
        k, v = kv
        rows, inputs = x.shape[2], k.shape[-2]
        side = max(first + rows, inputs)
        q = self._heads(self.query(x))
        q_square = F.pad(q, (0, 0, first, side - first - rows))
        q_square, k_square, ctx = self.hook.prepare(q_square, F.pad(k, (0, 0, 0, side - inputs)))
        step = rows
        if not torch.is_grad_enabled():
            channels = (self.hook.score_maps + 2) * self.heads
            step = rows_per_chunk(q.shape[0] * q.shape[1], side, channels, self.memory_budget_bytes)
        parts = []
        for start in range(first, first + rows, step):
            chunk = slice(start, min(start + step, first + rows))
            scores = self.hook.scores(q_square, k_square, chunk, ctx)[..., :inputs]
            bias = self.hook.bias(chunk, side, ctx)
            if bias is not None:
                scores = scores + bias[..., :inputs]
            parts.append(torch.matmul(torch.softmax(scores, dim=-1), v))
        out = torch.cat(parts, dim=-2).transpose(2, 3)
        return self.output(out.reshape(*x.shape))


def attend_step(attention: Attention, x: torch.Tensor, cache: list[Any], t: int) -> torch.Tensor:
    """``attention`` (causal) of position ``t`` (``x`` ``[M, B, 1, D]``) over positions
    ``0..t``, whose raw keys and values ``cache`` holds (``[M, B, H, t, d_h]`` each, empty
    before the first step; position t's are appended here), through the hook as a forward
    pass over positions ``0..t`` computes its last row."""
    members, batch, _, dim = x.shape
    q, k, v = (
        proj(x).view(members, batch, 1, attention.heads, attention.head_dim).transpose(2, 3)
        for proj in (attention.query, attention.key, attention.value)
    )
    # Appended by copy, not written in place: the earlier steps' graph may hold the old ones.
    cache[:] = [k, v] if t == 0 else [torch.cat([cache[0], k], -2), torch.cat([cache[1], v], -2)]
    q, k, ctx = attention.hook.prepare(F.pad(q, (0, 0, t, 0)), cache[0])
    row = slice(t, t + 1)
    scores = attention.hook.scores(q, k, row, ctx)
    bias = attention.hook.bias(row, t + 1, ctx)
    if bias is not None:
        scores = scores + bias
    out = torch.matmul(torch.softmax(scores, dim=-1), cache[1])
    return attention.output(out.transpose(2, 3).reshape(members, batch, 1, dim))


class DecoderBlock(nn.Module):
    """Post-LN decoder layer (CHE ``TransformerDecoder``): causal self-attention, then
    cross-attention to the encoded input, then the ReLU feed-forward network, each followed
    by dropout, the residual and a LayerNorm."""

    def __init__(self, attention: Attention, cross: CrossAttention, sizes: dict, members: int):
        super().__init__()
        dim, ffn = sizes["dim"], sizes["ffn"]
        self.attention, self.cross = attention, cross
        self.norms = nn.ModuleList(MemberLayerNorm(members, dim) for _ in range(3))
        self.ffn = nn.Sequential(
            MemberLinear(members, dim, ffn), nn.ReLU(), MemberLinear(members, ffn, dim)
        )
        self.dropout = SequenceDropout(sizes["dropout"])

    def forward(self, h, kv, seeds, site: int, step: Any = None) -> torch.Tensor:
        """``step``: None (every position at once) or (cache, t, length) for position t."""
        if step is None:
            attended, row, first = self.attention(h), None, 0
        else:
            cache, first, length = step
            attended, row = attend_step(self.attention, h, cache, first), (first, length)
        h = self.norms[0](h + _drop(self.dropout, attended, seeds, site, row))
        crossed = self.cross(h, kv, first)
        h = self.norms[1](h + _drop(self.dropout, crossed, seeds, site + 1, row))
        return self.norms[2](h + _drop(self.dropout, self.ffn(h), seeds, site + 2, row))


def check_encoding(pe: str) -> str:
    """``pe``'s canonical name if this model takes it, else a one-line CheBenchError."""
    name = canonical_encoding_name(pe)
    if name in REFUSED_ENCODINGS:
        raise CheBenchError(
            f"autoregressive_transformer cannot use --pe {name}: {REFUSED_ENCODINGS[name]}"
        )
    if get_encoding_class(name).randomized:
        raise CheBenchError(
            f"autoregressive_transformer cannot use --pe {name}: a randomized encoding draws "
            "positions per sequence length, not per decoding step"
        )
    return name


class AutoregressiveTransformer(BenchModel):
    """CHE's autoregressive transformer: an encoder and a decoder (causal self-attention,
    cross-attention to the input) trained with teacher forcing and decoded greedily, with a
    positional encoding (pe).

    Options (CHE's ``TransformerConfig`` defaults): ``layers`` (5, each of encoder and
    decoder), ``dim`` (64), ``heads`` (8), ``ffn`` (256: widening factor 4), ``dropout``
    (0.1), ``pe`` and ``pe_options`` (the encoding and its options, as the transformer's
    ``--pe`` / ``--pe-option``), ``memory_budget_bytes`` (attention's row chunks in
    evaluation)."""

    name = "autoregressive_transformer"
    label = "AR Transformer"
    uses_targets = True
    defaults: ClassVar[dict[str, Any]] = {
        "pe": "none",
        "pe_options": {},
        "layers": 5,
        "dim": 64,
        "heads": 8,
        "ffn": 256,
        "dropout": 0.1,
        "memory_budget_bytes": 1 << 30,
    }
    #: A few of the encodings it takes, for ``check-model``'s option check.
    option_choices: ClassVar[dict[str, tuple[Any, ...]]] = {
        "pe": ("none", "sin_cos", "rope", "alibi")
    }
    presets = CHE_PRESETS  # CHE trains every model of its paper alike

    def __init__(self, task: Task, members: int = 1, **options: Any) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise CheBenchError(f"{self.name} takes no option {', '.join(unknown)}")
        self.task, self.members, self.build_options = task, members, dict(options)
        sizes = _checked_sizes({**self.defaults, **options})
        self.sizes, self.memory_budget_bytes = sizes, sizes["memory_budget_bytes"]
        dim, heads, layers = sizes["dim"], sizes["heads"], sizes["layers"]
        self.encoder_embedding = MemberEmbedding(members, task.input_size, dim, std=0.02)
        # + the start token that precedes the first output (CHE shift_right)
        self.decoder_embedding = MemberEmbedding(members, task.output_size + 1, dim, std=0.02)
        self.encoder_encoding, self.decoder_encoding = (_encoding(sizes, members) for _ in range(2))
        _check_hooks(self.encoder_encoding)
        relative = self.encoder_encoding.kind == "relative"
        self.cross_encoding = _encoding(sizes, members) if relative else None
        cross_hooks = (
            self.cross_encoding.layer_hooks()
            if self.cross_encoding is not None
            else [AttentionHook() for _ in range(layers)]
        )
        adds = self.encoder_encoding.adds_to_embedding
        self.embedding_dropout = SequenceDropout(sizes["dropout"] if adds else 0.0)
        budget = self.memory_budget_bytes
        self.encoder = nn.ModuleList(
            Block(
                Attention(dim, heads, hook, None, False, budget, members),
                dim,
                sizes["ffn"],
                sizes["dropout"],
                members,
            )
            for hook in self.encoder_encoding.layer_hooks()
        )
        self.decoder = nn.ModuleList(
            DecoderBlock(
                Attention(dim, heads, hook, None, True, budget, members),
                CrossAttention(dim, heads, cross, budget, members),
                sizes,
                members,
            )
            for hook, cross in zip(self.decoder_encoding.layer_hooks(), cross_hooks, strict=True)
        )
        self.head = MemberLinear(members, dim, task.output_size)

    def _site(self, layer: int) -> int:
        """The first of decoder layer ``layer``'s three dropout sites; the one before layer 0's
        is the decoder embeddings', after the encoder's (0 for its embeddings, two a layer)."""
        return 2 * self.sizes["layers"] + 2 + 3 * layer

    def forward(
        self,
        inputs: torch.Tensor,
        draws: Any = None,
        *,
        evaluating: bool | None = None,
        dropout_seeds: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[M, B, output_length(n), output_size]`` for inputs ``[B, n]`` or
        ``[M, B, n]``: teacher-forced on ``targets`` (``[B, L]`` or ``[M, B, L]``) when given,
        else of greedy decoding. ``draws`` and ``evaluating``: unused (nothing is drawn)."""
        inputs = self.member_inputs(inputs)
        outputs = _output_length(self.task, inputs.shape[-1])
        memory = self.encode(inputs, dropout_seeds)
        kvs = [cast(DecoderBlock, block).cross.keys(memory) for block in self.decoder]
        if targets is None:
            return self._decode(kvs, outputs, dropout_seeds)
        if targets.dim() == 2:
            targets = targets.expand(self.members, -1, -1)
        if tuple(targets.shape) != (*inputs.shape[:2], outputs):
            raise CheBenchError(
                f"targets must be [{inputs.shape[1]}, {outputs}] or "
                f"[{self.members}, {inputs.shape[1]}, {outputs}], got {list(targets.shape)}"
            )
        start = targets.new_full((*targets.shape[:2], 1), self.task.output_size)
        h = self._embed_outputs(torch.cat([start, targets[..., :-1]], -1), dropout_seeds)
        for layer, block in enumerate(self.decoder):
            h = block(h, kvs[layer], dropout_seeds, self._site(layer))
        return self.head(h)

    def encode(self, inputs: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        """The encoder's output ``[M, B, n, D]`` (CHE ``TransformerEncoder``, not causal)."""
        h = self.encoder_embedding(inputs) * math.sqrt(self.sizes["dim"])
        h = self.embedding_dropout(self.encoder_encoding.embed(h), seeds, site=0)
        for layer, block in enumerate(self.encoder):
            h = block(h, None, seeds, layer)
        return h

    def _embed_outputs(self, tokens: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        h = self.decoder_embedding(tokens) * math.sqrt(self.sizes["dim"])
        return self.embedding_dropout(self.decoder_encoding.embed(h), seeds, self._site(0) - 1)

    def _decode(self, kvs: list, outputs: int, seeds: torch.Tensor | None) -> torch.Tensor:
        """Greedy decoding (CHE's sampling: each position reads the argmax of the previous
        one), one position per step over cached keys and values; stays on the device."""
        reference = kvs[0][0]
        members, batch = reference.shape[:2]
        # The absolute encoding of every output position (they add to the embeddings).
        zeros = reference.new_zeros(members, 1, outputs, self.sizes["dim"])
        positions = self.decoder_encoding.embed(zeros)
        caches: list[list[Any]] = [[] for _ in self.decoder]
        token = torch.full((members, batch, 1), self.task.output_size, device=reference.device)
        logits = []
        for t in range(outputs):
            h = self.decoder_embedding(token) * math.sqrt(self.sizes["dim"])
            h = h + positions[:, :, t : t + 1]
            h = _drop(self.embedding_dropout, h, seeds, self._site(0) - 1, (t, outputs))
            for layer, block in enumerate(self.decoder):
                h = block(h, kvs[layer], seeds, self._site(layer), (caches[layer], t, outputs))
            logits.append(self.head(h))
            token = logits[-1].argmax(-1)
        return torch.cat(logits, dim=2)

    def sample_dropout_seeds(self, batch: int) -> torch.Tensor | None:
        """Evaluation dropout's per-sequence seeds ``[M, B]`` (None when dropout is off)."""
        if not self.training or self.sizes["dropout"] == 0:
            return None
        return sequence_seeds(self.members, batch).to(self.head.weight.device)

    def set_memory_budget(self, budget_bytes: int) -> None:
        self.memory_budget_bytes = budget_bytes
        for module in self.modules():
            if isinstance(module, (Attention, CrossAttention)):
                module.memory_budget_bytes = budget_bytes

    def max_input_tokens(self) -> int | None:
        limits = [e.max_tokens() for e in (self.encoder_encoding, self.decoder_encoding)]
        known = [limit for limit in limits if limit is not None]
        return min(known) if known else None

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            **{key: self.sizes[key] for key in self.defaults if key != "pe_options"},
            "pe_options": self.encoder_encoding.options(),
        }


def _output_length(task: Task, input_tokens: int) -> int:
    if task.output_layout != "in_place" and task.input_length(input_tokens) != input_tokens:
        raise CheBenchError(f"task {task.name!r} never produces inputs of {input_tokens} tokens")
    return input_tokens if task.output_layout == "in_place" else task.output_length(input_tokens)


def _checked_sizes(options: dict[str, Any]) -> dict[str, Any]:
    """The resolved options, checked (a bad one is a one-line CheBenchError)."""
    for name in ("layers", "dim", "heads", "ffn", "memory_budget_bytes"):
        positive_int(name, options[name])
    if options["dim"] % options["heads"]:
        raise CheBenchError(f"dim {options['dim']} is not divisible by heads {options['heads']}")
    dropout = options["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise CheBenchError(f"dropout must lie in [0, 1), got {dropout!r}")
    if not isinstance(options["pe_options"], dict):
        raise CheBenchError(f"pe_options must be a mapping, got {options['pe_options']!r}")
    return {**options, "pe": check_encoding(str(options["pe"]))}


def _check_hooks(encoding: PositionalEncoding) -> None:
    """Refuse an encoding whose hooks read the layer's input, carry a bias per sequence or
    replace the softmax: cross-attention and one-step decoding give them neither."""
    if any(
        hook.reads_input or hook.sequence_bias or own_normalisation(hook)
        for hook in encoding.layer_hooks()
    ):
        raise CheBenchError(
            f"autoregressive_transformer cannot use --pe {encoding.name}: its attention reads "
            "the layer's input or replaces the softmax, which the cross-attention and the "
            "step-by-step decoding do not define"
        )


def _encoding(sizes: dict[str, Any], members: int) -> PositionalEncoding:
    # train_max_tokens feeds FIRE's and CoPE's defaults only, both refused here.
    return build_encoding(
        sizes["pe"],
        dim=sizes["dim"],
        heads=sizes["heads"],
        layers=sizes["layers"],
        train_max_tokens=1,
        members=members,
        **sizes["pe_options"],
    )
