"""Conformance checks of what an encoding's attention hooks promise
(``che_bench.checks.conformance`` runs them with the others): the bias has the shape the
attention and DAPE take, and a ``relative`` encoding's logits depend on offsets, not on
absolute positions.

Both work on the hooks alone, with random queries and keys, so a failure points at the hook
and not at a model built on top of it.
"""

from __future__ import annotations

from typing import Any

import torch

from che_bench.encodings import build_encoding
from che_bench.encodings.base import Draws, PositionalEncoding

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


def _encoding(pe: str, options: dict[str, Any], members: int) -> PositionalEncoding:
    torch.manual_seed(0)
    encoding = build_encoding(
        pe,
        dim=HEADS * HEAD_DIM,
        heads=HEADS,
        layers=LAYERS,
        train_max_tokens=TRAIN_MAX_TOKENS,
        members=members,
        **options,
    )
    return encoding.eval()


def _queries_and_keys(members: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, members, 2, HEADS, LENGTH, HEAD_DIM, generator=generator)
    return q, k


def check_bias_shape(pe: str, options: dict[str, Any]) -> list[str]:
    """Every hook's ``bias(rows, T, ctx)`` is ``[M or 1, 1, H, R, T]`` (M members, H heads, R
    query rows) when the encoding class sets ``carries_bias`` (what che-bench reads: DAPE
    takes the bias as H extra channels), and None when it does not; with three members,
    whole and part row chunks, and the training draws of a randomized encoding."""
    encoding = _encoding(pe, options, MEMBERS)
    draws = (
        encoding.sample_draws(LENGTH, [torch.Generator().manual_seed(2)] * MEMBERS)
        if encoding.draws_active(False)
        else Draws()
    )
    q, k = _queries_and_keys(MEMBERS)
    failures = []
    with torch.no_grad():
        for layer, hook in enumerate(encoding.layer_hooks()):
            _, _, ctx = hook.prepare(q, k, draws.layer(layer))
            for rows in ROW_CHUNKS:
                where = f"layer {layer}, rows {rows.start}:{rows.stop} of {LENGTH} keys"
                problem = _bias_problem(
                    hook.bias(rows, LENGTH, ctx), encoding.carries_bias, rows.stop - rows.start
                )
                if problem:
                    failures.append(f"bias shape ({where}, {MEMBERS} members): {problem}")
    return failures


def _bias_problem(bias: torch.Tensor | None, carries_bias: bool, rows: int) -> str | None:
    expected = f"[{MEMBERS} or 1, 1, {HEADS}, {rows}, {LENGTH}]"
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
    if len(shape) != 5 or shape[0] not in (1, MEMBERS) or shape[1:] != (1, HEADS, rows, LENGTH):
        return f"expected {expected}, got {list(shape)}"
    return None


def check_translation_invariance(pe: str, options: dict[str, Any]) -> list[str]:
    """For a ``relative`` encoding: the logits (scores plus bias) of query i and key j depend
    on their contents and j - i only. Queries and keys moved SHIFT positions later give the
    same logits, at lengths inside the training range (without random draws); and the
    embeddings carry no position (the same token everywhere stays the same everywhere)."""
    encoding = _encoding(pe, options, 1)
    if encoding.kind != "relative":
        return []
    q, k = _queries_and_keys(1)
    shifted = [torch.roll(x, SHIFT, dims=-2) for x in (q, k)]
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
            here = _logits(hook, q, k)[..., : LENGTH - SHIFT, : LENGTH - SHIFT]
            later = _logits(hook, *shifted)[..., SHIFT:, SHIFT:]
            difference = differ(later, here)
            if difference:
                failures.append(
                    f"translation invariance (layer {layer}): expected the logits of query i and "
                    f"key j to depend on j - i only (kind 'relative'), got {difference} between "
                    f"(i, j) and (i + {SHIFT}, j + {SHIFT})"
                )
    return failures


def _logits(hook: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    q, k, ctx = hook.prepare(q, k, None)
    rows = slice(0, LENGTH)
    scores = hook.scores(q, k, rows, ctx)
    bias = hook.bias(rows, LENGTH, ctx)
    return scores if bias is None else scores + bias
