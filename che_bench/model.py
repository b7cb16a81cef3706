"""The CHE transformer encoder: post-LN, bidirectional, with a pluggable positional encoding
and an optional DAPE / DAPE V2 score processor in every attention layer.

Non-autoregressive format (spec tasks.md 3.2): the model appends ``output_length(n)``
placeholder tokens (id ``task.input_size``) to the input and reads the logits of those last
positions. Defaults follow the reference: 5 layers, width 64, 8 heads, FFN 256 (ReLU),
dropout 0.1 after the attention output and after the FFN, embedding dropout only for
encodings that add to the embeddings, Haiku-style initialisation.

Memory: without gradients (evaluation) attention runs over chunks of query rows, and if need
be over sub-batches, sized from ``memory_budget_bytes``, so that no ``[B, ., T, T]`` map of the
whole sequence is ever materialised. With gradients everything is one chunk.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from che_bench.dape import DapeProcessor, check_kernel, check_variant
from che_bench.encodings import AttentionHook, PositionalEncoding, build_encoding
from che_bench.errors import CheBenchError
from che_bench.tasks.base import Task

#: Model options of ``build_model`` and their defaults (every other option goes to the encoding).
MODEL_DEFAULTS: dict[str, Any] = {
    "layers": 5,
    "dim": 64,
    "heads": 8,
    "ffn": 256,
    "dropout": 0.1,
    "dape_width": 32,
    "dape_variant": "concat_residual",
    "dape_tril": "auto",
    "train_length": 40,
    "memory_budget_bytes": 1 << 30,
    "causal": False,
}

FLOAT_BYTES = 4


def truncated_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Haiku's truncated normal: N(0, std^2) cut at +-2 std (no variance correction)."""
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def haiku_linear(fan_in: int, fan_out: int, bias: bool = True) -> nn.Linear:
    """A linear layer with Haiku's default init: std 1/sqrt(fan_in) weights, zero bias."""
    layer = nn.Linear(fan_in, fan_out, bias=bias)
    truncated_normal_(layer.weight, 1 / math.sqrt(fan_in))
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


def rows_per_chunk(batch: int, length: int, channels: int, budget_bytes: int) -> int:
    """Query rows whose ``[batch, channels, rows, length]`` float maps fit in the budget."""
    return max(1, budget_bytes // (FLOAT_BYTES * batch * channels * length))


class Attention(nn.Module):
    """Multi-head attention calling the encoding's hook and then, optionally, DAPE."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hook: AttentionHook,
        dape: DapeProcessor | None,
        causal: bool,
        memory_budget_bytes: int,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value, self.output = (
            haiku_linear(dim, dim, bias=False) for _ in range(4)
        )
        self.hook, self.dape, self.causal = hook, dape, causal
        self.memory_budget_bytes = memory_budget_bytes
        # Plain scores and no processor: the fused kernel can take the bias as a mask.
        self.fused = dape is None and type(hook).scores is AttentionHook.scores

    def transient_channels(self) -> int:
        """Float maps of shape ``[B, ., R, T]`` alive per row chunk (an estimate): those the
        encoding's ``scores`` holds (many for CoPE and Transformer-XL) plus those after it."""
        after_scores = self.dape.transient_channels() if self.dape is not None else 2 * self.heads
        return self.hook.score_maps * self.heads + after_scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        q, k, ctx = self.hook.prepare(q, k)
        if torch.is_grad_enabled():
            step = length
        else:
            step = rows_per_chunk(
                batch, length, self.transient_channels(), self.memory_budget_bytes
            )
        chunks = [
            self._attend(q, k, v, slice(start, min(start + step, length)), ctx)
            for start in range(0, length, step)
        ]
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
        return self.output(out.transpose(1, 2).reshape(batch, length, dim))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice, ctx: Any
    ) -> torch.Tensor:
        """Attention output ``[B, H, R, d_h]`` of the query ``rows``."""
        length = k.shape[2]
        bias = self.hook.bias(rows, length, ctx)
        if self.causal:
            query = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            future = torch.arange(length, device=q.device) > query
            if self.fused:
                mask = torch.zeros(future.shape, dtype=q.dtype, device=q.device)
                mask = mask.masked_fill(future, -math.inf)
                bias = mask if bias is None else bias + mask
        if self.fused:  # SDPA scales q.k by 1/sqrt(d_h), then adds the mask: same order
            return F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=bias)
        scores = self.hook.scores(q, k, rows, ctx)
        if self.dape is not None:
            logits = self.dape(scores, bias, rows)
        else:
            logits = scores if bias is None else scores + bias
        if self.causal:  # after every processor, never inside it
            logits = logits.masked_fill(future, -math.inf)
        return torch.matmul(torch.softmax(logits, dim=-1), v)


class Block(nn.Module):
    """Post-LN transformer block: ``LN(h + drop(attn(h)))`` then ``LN(h + drop(ffn(h)))``."""

    def __init__(self, attention: Attention, dim: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.attention = attention
        self.attention_norm = nn.LayerNorm(dim, eps=1e-5)
        self.ffn = nn.Sequential(haiku_linear(dim, ffn), nn.ReLU(), haiku_linear(ffn, dim))
        self.ffn_norm = nn.LayerNorm(dim, eps=1e-5)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(h + self.dropout(self.attention(h)))
        return self.ffn_norm(h + self.dropout(self.ffn(h)))


class Encoder(nn.Module):
    """The CHE encoder for one task; ``forward(inputs)`` returns the placeholder logits."""

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
    ) -> None:
        super().__init__()
        self.task, self.encoding, self.kernel = task, encoding, kernel
        self.dim, self.causal, self.memory_budget_bytes = dim, causal, memory_budget_bytes
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
        self.embedding = nn.Embedding(task.input_size + 1, dim)  # + the placeholder id
        truncated_normal_(self.embedding.weight, 0.02)
        self.embedding_dropout = nn.Dropout(dropout if encoding.adds_to_embedding else 0.0)
        self.blocks = nn.ModuleList(
            Block(
                Attention(
                    dim,
                    heads,
                    encoding.hooks[layer],
                    None
                    if kernel is None
                    else DapeProcessor(
                        heads,
                        kernel,
                        width=dape_width,
                        variant=dape_variant,
                        with_bias=encoding.carries_bias,
                        tril=dape_tril,
                    ),
                    causal,
                    memory_budget_bytes,
                ),
                dim,
                ffn,
                dropout,
            )
            for layer in range(layers)
        )
        self.head = haiku_linear(dim, task.output_size)

    def output_length(self, input_tokens: int) -> int:
        """Number of placeholders for an input of ``input_tokens`` tokens."""
        if self.task.input_length(input_tokens) != input_tokens:
            raise CheBenchError(
                f"task {self.task.name!r} never produces inputs of {input_tokens} tokens"
            )
        return self.task.output_length(input_tokens)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, output_length(n), output_size]`` for int64 ``inputs [B, n_in]``."""
        batch, input_tokens = inputs.shape
        if input_tokens and (int(inputs.min()) < 0 or int(inputs.max()) >= self.task.input_size):
            raise CheBenchError(f"input ids must lie in 0..{self.task.input_size - 1}")
        sub_batch = self._sub_batch_size(batch, input_tokens)
        if sub_batch < batch:
            return torch.cat([self._forward(part) for part in inputs.split(sub_batch)])
        return self._forward(inputs)

    def _sub_batch_size(self, batch: int, input_tokens: int) -> int:
        """Without gradients, split the batch when one query row of it exceeds the budget."""
        if torch.is_grad_enabled():
            return batch
        length = input_tokens + self.output_length(input_tokens)
        channels = max(block.attention.transient_channels() for block in self.blocks)
        row_bytes = FLOAT_BYTES * channels * length
        return max(1, min(batch, self.memory_budget_bytes // row_bytes))

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output_length = self.output_length(inputs.shape[1])
        placeholders = inputs.new_full((inputs.shape[0], output_length), self.task.input_size)
        tokens = torch.cat([inputs, placeholders], dim=1)
        h = self.embedding(tokens) * math.sqrt(self.dim)
        h = self.embedding_dropout(self.encoding.embed(h))
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, h.shape[1] - output_length :])

    def describe(self) -> dict[str, Any]:
        """The fully resolved configuration, for recording with results."""
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
            "parameters": sum(p.numel() for p in self.parameters()),
        }


def build_model(task: Task, pe: str = "none", kernel: int | None = None, **options: Any) -> Encoder:
    """The encoder for ``task`` with encoding ``pe`` and DAPE kernel ``kernel`` (None = off).

    ``options``: the keys of ``MODEL_DEFAULTS``; everything else is passed to the encoding,
    which rejects what it does not know. Invalid combinations raise ``CheBenchError``.
    """
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
        task.input_length(n) + task.output_length(n)
        for n in range(task.min_length, settings["train_length"] + 1)
    )
    encoding = build_encoding(
        pe,
        dim=settings["dim"],
        heads=settings["heads"],
        layers=settings["layers"],
        train_max_tokens=train_max_tokens,
        **options,
    )
    return Encoder(task, encoding, kernel=kernel, train_max_tokens=train_max_tokens, **settings)
