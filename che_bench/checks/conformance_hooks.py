"""Conformance checks of what an encoding's attention hooks promise
(``che_bench.checks.conformance`` runs them with the others): every hook returns the inputs'
dtype, the bias has the shape the attention and DAPE take and equals the hook's slow
``reference_bias`` where it declares one, and a ``relative`` encoding's logits depend on
offsets, not on absolute positions.

They work on the hooks alone, with random queries and keys, so a failure points at the hook
and not at a model built on top of it. In a causal model (``causal``) the logits of a key
after its query are never used, so they are not compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from che_bench.encodings import build_encoding
from che_bench.encodings.base import AttentionHook, Draws, PositionalEncoding, prepare_hook
from che_bench.tasks import Task

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
#: Hook sizes: three members (so a bias must say whether it is per member), four heads.
MEMBERS, HEADS, HEAD_DIM, LAYERS = 3, 4, 4, 2
#: T_train_max as for a copy task trained up to n = 40 (2n tokens); every sequence below is
#: shorter, so length-interpolating encodings (FIRE) are inside their training range.
TRAIN_MAX_TOKENS = 80
#: Keys, query row chunks, and the shift of the translation check.
LENGTH = 24
ROW_CHUNKS = (slice(0, LENGTH), slice(5, 9))
SHIFT = 8


def differ(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when equal to float rounding, else the largest difference."""
    if got.shape != expected.shape:
        return f"shape {list(got.shape)} instead of {list(expected.shape)}"
    if torch.allclose(got, expected, **TOLERANCE, equal_nan=False):
        return None
    return f"max |difference| {(got - expected).abs().max().item():.3g}"


def output_problem(logits: torch.Tensor, task: Task, n: int, batch: int, where: str) -> str | None:
    """None when the logits of one model for ``batch`` sequences of ``task`` at length ``n`` have
    the shape ``[1, batch, output_length(n), output_size]`` and are finite, else the failure
    (``where``: the task, length and mode, for the line)."""
    expected = (1, batch, task.output_length(n), task.output_size)
    if tuple(logits.shape) != expected:
        return f"output shape ({where}): expected {list(expected)}, got {list(logits.shape)}"
    if not torch.isfinite(logits).all():
        return (
            f"finite outputs ({where}): expected finite logits, got "
            f"{int((~torch.isfinite(logits)).sum())} non-finite values"
        )
    return None


def _future(rows: slice, length: int) -> torch.Tensor:
    """``[R, T]``: True where key j lies after query i (never used in a causal model)."""
    return torch.arange(length)[None, :] > torch.arange(length)[rows, None]


def _encoding(
    pe: str, options: dict[str, Any], members: int, causal: bool = False
) -> PositionalEncoding:
    torch.manual_seed(0)
    encoding = build_encoding(
        pe,
        dim=HEADS * HEAD_DIM,
        heads=HEADS,
        layers=LAYERS,
        train_max_tokens=TRAIN_MAX_TOKENS,
        members=members,
        causal=causal,
        **options,
    )
    return encoding.eval()


def _queries_and_keys(members: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random queries, keys and layer inputs ``x`` (``[M, 2, T, D]``, for the hooks that
    read it) of two sequences."""
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, members, 2, HEADS, LENGTH, HEAD_DIM, generator=generator)
    x = torch.randn(members, 2, LENGTH, HEADS * HEAD_DIM, generator=generator)
    return q, k, x


def _prepared_hooks(
    encoding: PositionalEncoding,
) -> Iterator[tuple[int, AttentionHook, Any]]:
    """Each layer's hook of ``encoding`` (``MEMBERS`` members) with its context, prepared for
    ``LENGTH`` keys under the training draws of a randomized encoding (its callers
    iterate it under ``torch.no_grad``)."""
    draws = _training_draws(encoding)
    q, k, x = _queries_and_keys(MEMBERS)
    for layer, hook in enumerate(encoding.layer_hooks()):
        _, _, ctx = prepare_hook(hook, q, k, draws.layer(layer), x)
        yield layer, hook, ctx


def check_bias_shape(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """Every hook's ``bias(rows, T, ctx)`` is ``[M or 1, 1, H, R, T]`` (M members, H heads, R
    query rows; ``[M or 1, B, H, R, T]`` for a hook with ``sequence_bias``, B sequences)
    when the encoding class sets ``carries_bias`` (what che-bench reads: DAPE takes the bias
    as H extra channels), and None when it does not; with three members, whole and part row
    chunks, and the training draws of a randomized encoding."""
    encoding = _encoding(pe, options, MEMBERS, causal)
    failures = []
    with torch.no_grad():
        for layer, hook, ctx in _prepared_hooks(encoding):
            for rows in ROW_CHUNKS:
                where = f"layer {layer}, rows {rows.start}:{rows.stop} of {LENGTH} keys"
                bias = hook.bias(rows, LENGTH, ctx)
                batch = 2 if hook.sequence_bias else 1
                problem = _bias_problem(bias, encoding.carries_bias, rows.stop - rows.start, batch)
                if problem:
                    failures.append(f"bias shape ({where}, {MEMBERS} members): {problem}")
    return failures


def _bias_problem(
    bias: torch.Tensor | None, carries_bias: bool, rows: int, batch: int
) -> str | None:
    expected = f"[{MEMBERS} or 1, {batch}, {HEADS}, {rows}, {LENGTH}]"
    if bias is None:
        return (
            f"expected a bias {expected} (the encoding class sets carries_bias), got None"
            if carries_bias
            else None
        )
    if not carries_bias:
        return (
            f"expected None (the encoding class does not set carries_bias, so DAPE would "
            f"not take the bias), got a bias {list(bias.shape)}"
        )
    shape = tuple(bias.shape)
    if len(shape) != 5 or shape[0] not in (1, MEMBERS) or shape[1:] != (batch, HEADS, rows, LENGTH):
        return f"expected {expected}, got {list(shape)}"
    return None


def check_translation_invariance(
    pe: str, options: dict[str, Any], causal: bool = False
) -> list[str]:
    """For a ``relative`` encoding: the logits (scores plus bias) of query i and key j depend
    on their contents and j - i only. Queries and keys moved SHIFT positions later give the
    same logits, at lengths inside the training range (without random draws); and the
    embeddings carry no position (the same token everywhere stays the same everywhere)."""
    encoding = _encoding(pe, options, 1, causal)
    if encoding.kind != "relative":
        return []
    q, k, x = _queries_and_keys(1)
    shifted = [torch.roll(tensor, SHIFT, dims=-2) for tensor in (q, k, x)]
    failures = []
    with torch.no_grad():
        same_token = torch.randn(HEADS * HEAD_DIM).expand(1, 2, LENGTH, -1)
        embedded = encoding.embed(same_token)
        difference = differ(embedded, embedded[:, :, :1].expand_as(embedded))
        if difference:
            failures.append(
                f"translation invariance (embeddings): expected no position in the "
                f"embeddings of a relative encoding, got {difference} between "
                "positions of the same token"
            )
        for layer, hook in enumerate(encoding.layer_hooks()):
            here = _logits(hook, q, k, x)[..., : LENGTH - SHIFT, : LENGTH - SHIFT]
            later = _logits(hook, *shifted)[..., SHIFT:, SHIFT:]
            if causal:
                future = _future(slice(0, LENGTH - SHIFT), LENGTH - SHIFT)
                here, later = here.masked_fill(future, 0), later.masked_fill(future, 0)
            difference = differ(later, here)
            if difference:
                failures.append(
                    f"translation invariance (layer {layer}): expected the logits of query i and "
                    f"key j to depend on j - i only (kind 'relative'), got {difference} between "
                    f"(i, j) and (i + {SHIFT}, j + {SHIFT})"
                )
    return failures


def _logits(hook: Any, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q, k, ctx = prepare_hook(hook, q, k, None, x)
    rows = slice(0, LENGTH)
    scores = hook.scores(q, k, rows, ctx)
    bias = hook.bias(rows, LENGTH, ctx)
    return scores if bias is None else scores + bias


def check_reference_bias(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """Where a hook declares ``reference_bias(i, j, ctx)`` (its bias computed straight from
    the formula, one query and key at a time): ``bias(rows, T, ctx)`` equals it at every
    (i, j), with three members, whole and part row chunks, and the training draws of a
    randomized encoding (a map of the right shape with i and j swapped fails here)."""
    failures = []
    with torch.no_grad():
        for layer, hook, ctx in _prepared_hooks(_encoding(pe, options, MEMBERS, causal)):
            reference = _reference_map(hook, ctx)
            if reference is None:
                continue
            for rows in ROW_CHUNKS:
                problem = _reference_problem(hook.bias(rows, LENGTH, ctx), reference, rows, causal)
                if problem:
                    failures.append(
                        f"reference bias (layer {layer}, rows {rows.start}:{rows.stop} of "
                        f"{LENGTH} keys): expected bias() to equal reference_bias(i, j) at "
                        f"every query i and key j, got {problem}"
                    )
    return failures


def _reference_map(hook: AttentionHook, ctx: Any) -> torch.Tensor | None:
    """``[M or 1, 1, H, T, T]`` from ``reference_bias(i, j, ctx)`` at every query i and key
    j (None: the hook declares no reference)."""
    if hook.reference_bias(0, 0, ctx) is None:
        return None
    rows = []
    for i in range(LENGTH):
        row = [hook.reference_bias(i, j, ctx) for j in range(LENGTH)]
        rows.append(torch.stack([value for value in row if value is not None], -1))
    return torch.stack(rows, -2)


def _reference_problem(
    bias: torch.Tensor | None, reference: torch.Tensor, rows: slice, causal: bool
) -> str | None:
    if bias is None:
        return "None from bias()"
    expected = reference[..., rows, :]
    try:
        got, expected = torch.broadcast_tensors(bias, expected)
    except RuntimeError:
        return f"shape {list(bias.shape)} against the reference's {list(expected.shape)}"
    if causal:
        future = _future(rows, LENGTH)
        got, expected = got.masked_fill(future, 0), expected.masked_fill(future, 0)
    difference = differ(got, expected)
    if difference is None:
        return None
    far = (got - expected).abs().amax(dim=(0, 1, 2)) > TOLERANCE["atol"]
    i, j = (int(index) for index in far.nonzero()[0])
    return f"{difference} (first at i={rows.start + i}, j={j})"


def _training_draws(encoding: PositionalEncoding) -> Draws:
    """The training draws of a randomized encoding (one generator per member), else none."""
    if not encoding.draws_active(False):
        return Draws()
    return encoding.sample_draws(LENGTH, [torch.Generator().manual_seed(2)] * encoding.members)


def dtype_problem(pe: str, options: dict[str, Any]) -> str | None:
    """None when ``embed`` and every hook's ``prepare``, ``scores``, ``bias`` and ``normalise``
    return the dtype of their float32 inputs, else which method of which layer returns what."""
    encoding = _encoding(pe, options, 1)
    q, k, x = _queries_and_keys(1)
    with torch.no_grad():
        embedded = encoding.embed(torch.randn(1, 2, LENGTH, HEADS * HEAD_DIM))
        if embedded.dtype != q.dtype:
            return f"{type(encoding).__name__}.embed returns {embedded.dtype}"
        for layer, hook in enumerate(encoding.layer_hooks()):
            name = f"layer {layer}'s {type(hook).__name__}"
            prepared_q, prepared_k, ctx = prepare_hook(hook, q, k, None, x)
            rows = slice(0, LENGTH)
            scores = hook.scores(prepared_q, prepared_k, rows, ctx)
            returned = {
                "prepare (q)": prepared_q,
                "prepare (k)": prepared_k,
                "scores": scores,
                "bias": hook.bias(rows, LENGTH, ctx),
                "normalise": hook.normalise(scores, rows, None, ctx),
            }
            for method, tensor in returned.items():
                if tensor is not None and tensor.dtype != q.dtype:
                    return f"{name}.{method} returns {tensor.dtype}"
    return None


def check_dtypes(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """``embed`` and every hook method return float32 for float32 inputs (``dtype_problem``):
    a float64 bias fails here, named, rather than deep inside the attention."""
    problem = dtype_problem(pe, options)
    if problem is None:
        return []
    return [f"dtypes: expected {torch.float32} (the inputs' dtype) from every hook, got {problem}"]
