"""The CHE transformer encoder: post-LN, bidirectional, with a pluggable positional encoding
and an optional DAPE / DAPE V2 score processor in every attention layer.

Non-autoregressive format (spec tasks.md 3.2): the model appends ``output_length(n)``
placeholder tokens (id ``task.input_size``) to the input and reads the logits of those last
positions; a task whose ``output_layout`` is "in_place" (MQAR) gets the logits of its input
positions instead, with no placeholders. Defaults follow the reference: 5 layers, width 64,
8 heads, FFN 256 (ReLU), dropout 0.1 after the attention output and after the FFN, embedding
dropout only for encodings that add to the embeddings, Haiku-style initialisation.

Members: every parameter and activation has a leading member axis (``che_bench.members``):
one ``Encoder`` holds ``M`` models that differ only in their weights and compute them side by
side. ``build_model`` makes one member; ``stack_members`` packs several, each built from its
own seed, into one model, and ``member_state_dict`` takes one back out.

Memory: without gradients (evaluation) attention runs over chunks of query rows, and if need
be over sub-batches, sized from ``memory_budget_bytes``, so that no ``[M, B, ., T, T]`` map of
the whole sequence is ever materialised. With gradients everything is one chunk.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from che_bench.encodings import PositionalEncoding, build_encoding
from che_bench.encodings.base import Draws
from che_bench.errors import CheBenchError
from che_bench.members import (
    MemberEmbedding,
    MemberLinear,
)
from che_bench.model.attention import FLOAT_BYTES, Attention, Block
from che_bench.model.base import BenchModel
from che_bench.model.dape import DapeProcessor, check_kernel, check_variant
from che_bench.model.dropout import SequenceDropout, sequence_seeds
from che_bench.settings import BY_NAME, DAPE, MODEL, settings_where
from che_bench.tasks.base import Task

#: Model options of ``build_model`` and their defaults (every other option goes to the encoding):
#: the model and DAPE settings of the published protocol (``che_bench.settings``), plus
#: what only the model knows.
MODEL_DEFAULTS: dict[str, Any] = {
    **{
        setting.name: setting.default_for("paper")
        for setting in (*settings_where(MODEL), *settings_where(DAPE))
    },
    "causal": BY_NAME["causal"].default,
    "train_length": BY_NAME["train_max_length"].default_for("paper"),
    "memory_budget_bytes": 1 << 30,
}


class Encoder(BenchModel):
    """The CHE encoder for one task, ``members`` models side by side; ``forward(inputs)``
    returns the output logits ``[M, B, output_length, output_size]`` (at the placeholders, or
    at the input positions for an in-place task).

    Randomized encodings draw from ``draw_generators`` (one CPU generator per member, seeded
    by ``seed_draws``), never from the global RNG that dropout uses.
    """

    name = "transformer"
    label = "Transformer"

    def __init__(
        self,
        task: Task,
        encoding: PositionalEncoding,
        *,
        kernel: int | None,
        layers: int,
        dim: int,
        heads: int,
        ffn: int,
        dropout: float,
        dape_width: int,
        dape_variant: str,
        dape_tril: bool,
        causal: bool,
        memory_budget_bytes: int,
        train_length: int,
        train_max_tokens: int,
        members: int,
        build_options: dict[str, Any],
    ) -> None:
        super().__init__()
        self.task, self.encoding, self.kernel, self.members = task, encoding, kernel, members
        self.dim, self.causal, self.memory_budget_bytes = dim, causal, memory_budget_bytes
        #: What ``build_model`` was given besides task, pe and kernel (to build a pack alike).
        self.build_options = build_options
        self.dape_options = (
            None
            if kernel is None
            else {"width": dape_width, "variant": dape_variant, "tril": dape_tril}
        )
        self._sizes = {"layers": layers, "dim": dim, "heads": heads, "ffn": ffn}
        self._training_options = {
            "dropout": dropout,
            "train_length": train_length,
            "train_max_tokens": train_max_tokens,
        }
        # + the placeholder id
        self.embedding = MemberEmbedding(members, task.input_size + 1, dim, std=0.02)
        self.embedding_dropout = SequenceDropout(dropout if encoding.adds_to_embedding else 0.0)
        self.blocks = nn.ModuleList(
            Block(
                Attention(
                    dim,
                    heads,
                    encoding.layer_hooks()[layer],
                    _dape(encoding, kernel, heads, dape_width, dape_variant, dape_tril, members),
                    causal,
                    memory_budget_bytes,
                    members,
                ),
                dim,
                ffn,
                dropout,
                members,
            )
            for layer in range(layers)
        )
        self.head = MemberLinear(members, dim, task.output_size)
        self.seed_draws([0] * members)

    # -- random draws ----------------------------------------------------------------------

    def seed_draws(self, seeds: Sequence[int]) -> None:
        """Seed each member's generator of random positions."""
        if len(seeds) != self.members:
            raise ValueError(f"{len(seeds)} seeds for {self.members} members")
        self.draw_generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]

    def draw_states(self) -> list[torch.Tensor]:
        return [generator.get_state() for generator in self.draw_generators]

    def set_draw_states(self, states: Sequence[torch.Tensor]) -> None:
        for generator, state in zip(self.draw_generators, states, strict=True):
            generator.set_state(state)

    def sample_draws(self, input_tokens: int, *, evaluating: bool | None = None) -> Draws | None:
        """The random sample of one forward pass over inputs of ``input_tokens`` tokens (None
        for a non-randomized encoding, or when it is not drawing). ``evaluating`` (default:
        not in training mode) decides whether ``randomize_at_eval`` applies, whatever the
        dropout mode: pass True when evaluating with dropout on."""
        evaluating = not self.training if evaluating is None else evaluating
        if not self.encoding.draws_active(evaluating):
            return None
        length = input_tokens + self.placeholders(input_tokens)
        draws = self.encoding.sample_draws(length, self.draw_generators)
        return draws.to(self.embedding.weight.device)

    # -- forward ---------------------------------------------------------------------------

    def placeholders(self, input_tokens: int) -> int:
        """Number of placeholders for an input of ``input_tokens`` tokens."""
        if self.task.output_layout == "in_place":
            return 0
        if self.task.input_length(input_tokens) != input_tokens:
            raise CheBenchError(
                f"task {self.task.name!r} never produces inputs of {input_tokens} tokens"
            )
        return self.task.output_length(input_tokens)

    def sample_dropout_seeds(self, batch: int) -> torch.Tensor | None:
        """Evaluation dropout's one draw for a batch of ``batch`` sequences (``[M, B]`` seeds,
        on the model's device), or None when dropout is off (``che_bench.model.dropout``)."""
        if not self.training or self._training_options["dropout"] == 0:
            return None
        return sequence_seeds(self.members, batch).to(self.embedding.weight.device)

    def forward(
        self,
        inputs: torch.Tensor,
        draws: Draws | None = None,
        *,
        evaluating: bool | None = None,
        dropout_seeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[M, B, output_length(n), output_size]`` for int64 ``inputs`` ``[B, n]``
        (the same sequences for every member) or ``[M, B, n]`` (each member its own).

        ``draws``: the randomized encodings' sample for this batch (default: drawn now with
        ``sample_draws(evaluating=evaluating)``); however the batch is split, one sample serves
        all of it.
        """
        if inputs.dim() == 2:
            inputs = inputs.expand(self.members, -1, -1)
        elif inputs.dim() != 3 or inputs.shape[0] != self.members:
            raise CheBenchError(
                f"inputs must be [B, n] or [{self.members}, B, n], got {list(inputs.shape)}"
            )
        input_tokens = inputs.shape[-1]
        # Ids index the members' stacked embedding tables, so a bad id must never get through.
        # Checked here for host tensors only (free); on a GPU the check would wait for the
        # device, so batches are checked where they are made
        # (``che_bench.train.metrics.check_token_ids``).
        if (
            input_tokens
            and not inputs.is_cuda
            and (int(inputs.min()) < 0 or int(inputs.max()) >= self.task.input_size)
        ):
            raise CheBenchError(f"input ids must lie in 0..{self.task.input_size - 1}")
        if draws is None:
            draws = self.sample_draws(input_tokens, evaluating=evaluating)
        batch = inputs.shape[1]
        sub_batch = self._sub_batch_size(batch, input_tokens, inputs.device)
        if sub_batch < batch:
            seeds = (
                dropout_seeds.split(sub_batch, 1)
                if dropout_seeds is not None
                else [None] * math.ceil(batch / sub_batch)
            )
            return torch.cat(
                [
                    self._forward(part, draws, part_seeds)
                    for part, part_seeds in zip(inputs.split(sub_batch, 1), seeds, strict=True)
                ],
                1,
            )
        return self._forward(inputs, draws, dropout_seeds)

    def _sub_batch_size(self, batch: int, input_tokens: int, device: torch.device) -> int:
        """Without gradients, split the batch when one query row of it exceeds the budget."""
        if torch.is_grad_enabled():
            return batch
        row_bytes = self.query_row_bytes(input_tokens, device)
        return max(1, min(batch, self.memory_budget_bytes // row_bytes))

    def attentions(self) -> list[Attention]:
        """Every layer's attention, in order."""
        return [cast(Block, block).attention for block in self.blocks]

    def set_memory_budget(self, budget_bytes: int) -> None:
        """The memory budget of the row chunks and sub-batches (exact whatever it is)."""
        self.memory_budget_bytes = budget_bytes
        for attention in self.attentions():
            attention.memory_budget_bytes = budget_bytes

    def query_row_bytes(self, input_tokens: int, device: torch.device | None = None) -> int:
        """Bytes of the maps of one query row of one sequence (every member) on ``device``
        (default: the model's): the least memory an evaluation's forward pass can be split
        down to."""
        device = device or self.embedding.weight.device
        length = input_tokens + self.placeholders(input_tokens)
        floats = max(attention.query_row_floats(length, device) for attention in self.attentions())
        return FLOAT_BYTES * self.members * floats

    def _forward(
        self, inputs: torch.Tensor, draws: Draws | None, dropout_seeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        input_tokens = inputs.shape[-1]
        placeholders = inputs.new_full(
            (*inputs.shape[:2], self.placeholders(input_tokens)), self.task.input_size
        )
        tokens = torch.cat([inputs, placeholders], dim=-1)
        h = self.embedding(tokens) * math.sqrt(self.dim)
        h = self.embedding_dropout(self.encoding.embed(h, draws), dropout_seeds, site=0)
        for layer, block in enumerate(self.blocks):
            h = block(h, None if draws is None else draws.layer(layer), dropout_seeds, layer)
        in_place = self.task.output_layout == "in_place"
        outputs = input_tokens if in_place else placeholders.shape[-1]
        return self.head(h[:, :, h.shape[2] - outputs :])

    # -- inspection ------------------------------------------------------------------------

    @contextmanager
    def capture_attention(self) -> Iterator[list[list[dict[str, torch.Tensor | None]]]]:
        """Record every layer's attention maps during the forward passes inside the block:
        yields one list per layer, to which each row chunk appends its ``scores`` (q.k scaled,
        plus the encoding's bias), ``logits`` (after DAPE; None without it) and
        ``probabilities`` (the layer's weights: softmax or its own), each ``[M, B, H, R, T]``."""
        captured: list[list[dict[str, torch.Tensor | None]]] = [[] for _ in self.blocks]
        for attention, maps in zip(self.attentions(), captured, strict=True):
            attention.capture = maps
        try:
            yield captured
        finally:
            for attention in self.attentions():
                attention.capture = None

    def max_input_tokens(self) -> int | None:
        return self.encoding.max_tokens()

    def with_members(self, members: int) -> Encoder:
        return build_model(
            self.task, self.encoding.name, self.kernel, members=members, **self.build_options
        )

    def build_key(self) -> str:
        return json.dumps(
            [super().build_key(), self.encoding.name, self.kernel], sort_keys=True, default=repr
        )

    def describe(self) -> dict[str, Any]:
        """The fully resolved configuration of one member, for recording with results."""
        return {
            "task": self.task.name,
            "task_params": self.task.params(),
            "pe": self.encoding.name,
            "pe_options": self.encoding.options(),
            "kernel": self.kernel,
            "dape": self.dape_options,
            **self._sizes,
            **self._training_options,
            "causal": self.causal,
            "memory_budget_bytes": self.memory_budget_bytes,
            "parameters": sum(p.numel() for p in self.parameters()) // self.members,
        }


def _dape(
    encoding: PositionalEncoding,
    kernel: int | None,
    heads: int,
    width: int,
    variant: str,
    tril: bool,
    members: int,
) -> DapeProcessor | None:
    """A layer's DAPE processor (None without a kernel); it sees the encoding's bias as
    extra channels when the encoding carries one (per sequence when its hooks say so)."""
    if kernel is None:
        return None
    return DapeProcessor(
        heads,
        kernel,
        width=width,
        variant=variant,
        with_bias=encoding.carries_bias,
        sequence_bias=any(hook.sequence_bias for hook in encoding.layer_hooks()),
        tril=tril,
        members=members,
    )


def build_model(
    task: Task, pe: str = "none", kernel: int | None = None, *, members: int = 1, **options: Any
) -> Encoder:
    """The encoder for ``task`` with encoding ``pe`` and DAPE kernel ``kernel`` (None = off),
    initialised from torch's global RNG; ``members`` models side by side (each drawn in turn).

    ``options``: the keys of ``MODEL_DEFAULTS``; everything else is passed to the encoding,
    which rejects what it does not know. Invalid combinations raise ``CheBenchError``.
    """
    build_options = dict(options)
    settings = {name: options.pop(name, default) for name, default in MODEL_DEFAULTS.items()}
    for name in ("layers", "dim", "heads", "ffn", "dape_width", "train_length"):
        value = settings[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheBenchError(f"{name} must be a positive integer, got {value!r}")
    if settings["dim"] % settings["heads"]:
        raise CheBenchError(f"dim {settings['dim']} is not divisible by heads {settings['heads']}")
    if not 0.0 <= settings["dropout"] < 1.0:
        raise CheBenchError(f"dropout must lie in [0, 1), got {settings['dropout']!r}")
    if int(settings["memory_budget_bytes"]) < 1:
        raise CheBenchError("memory_budget_bytes must be positive")
    if kernel is not None:
        check_kernel(kernel)
        check_variant(settings["dape_variant"])
    tril = settings["dape_tril"]
    if tril not in ("auto", True, False):
        raise CheBenchError(f"dape_tril must be 'auto', True or False, got {tril!r}")
    settings["dape_tril"] = settings["causal"] if tril == "auto" else tril
    if settings["train_length"] < task.min_length:
        raise CheBenchError(
            f"train_length {settings['train_length']} is below the task's minimum "
            f"length {task.min_length}"
        )
    train_max_tokens = max(
        task.model_length(n) for n in range(task.min_length, settings["train_length"] + 1)
    )
    encoding = build_encoding(
        pe,
        dim=settings["dim"],
        heads=settings["heads"],
        layers=settings["layers"],
        train_max_tokens=train_max_tokens,
        members=members,
        causal=settings["causal"],
        **options,
    )
    return Encoder(
        task,
        encoding,
        kernel=kernel,
        train_max_tokens=train_max_tokens,
        members=members,
        build_options=build_options,
        **settings,
    )
