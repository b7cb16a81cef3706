"""Protocol presets and the parsing of length ranges.

A preset is a complete set of run settings; every field can be overridden. ``paper`` is the
published CHE / DAPE protocol (a GPU budget), ``quick`` is sized for a laptop CPU (minutes per
single-output task, enough to see learning, far too short to reproduce the paper's numbers) and
``smoke`` only checks that everything runs (seconds). ``state_tracking`` is the xLSTM
harness's formal-language protocol as Grazzi et al. (ICLR 2025) ran it, translated to CHE's
tasks (docs/protocol.md). The protocol presets (``PROTOCOL_PRESETS``) are published
state-tracking protocols, each a base preset with its own settings over it: the xLSTM
harness's whole pipeline (``state_tracking_harness``), DeltaProduct's (``deltaproduct``),
flip-flop's splits (``flip_flop``) and their length-generalisation variant
(``flip_flop_length``), Merrill et al.'s in-distribution one (``merrill``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, SupportsInt

from che_bench.errors import CheBenchError
from che_bench.settings import BY_NAME, PRESET_NAMES, preset_values

#: Seed of the evaluation data (and of any random draws during evaluation), as in the reference
#: range evaluation: every model sees the same test sequences.
EVAL_SEED = 1

#: Optimiser of the reference training loop: Adam after global-norm clipping (AdamW, the
#: xLSTM harness's, uses torch's same defaults for betas and eps).
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
GRAD_CLIP_NORM = BY_NAME["grad_clip_norm"].default

#: The presets' values of the settings that differ between presets (declared with each
#: setting in ``che_bench.settings``).
PRESETS: dict[str, dict[str, Any]] = {name: preset_values(name) for name in PRESET_NAMES}

#: Published protocols (shared/spec/word_problems.md; docs/protocol.md): name -> (base preset,
#: the settings it changes). An architecture's own settings under the base come between.
PROTOCOL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # The xLSTM harness's whole pipeline over state_tracking (docs/protocol.md, issue 47):
    # mixed-length batches, bf16 autocast, and its read-out and training lengths on the tasks
    # that have them (parity, modular arithmetic; other tasks keep CHE's layout).
    "state_tracking_harness": (
        "state_tracking",
        {
            "batch_lengths": "mixed",
            "train_precision": "bfloat16",
            "task_params": {"layout": "harness"},
        },
    ),
    # DeltaProduct's state_tracking/ README (spec 2.2): train at length 128, test at 512; AdamW
    # (wd 1e-6), cosine to 0 over all steps (100 epochs of 49 batches of 2048 from 99,000); one
    # layer, 8 heads; 1,000 test sequences. A GPU budget.
    "deltaproduct": (
        "state_tracking",
        {
            "steps": 4_900,
            "batch_size": 2048,
            "lr": 1e-3,
            "weight_decay": 1e-6,
            "warmup_steps": 0,
            "min_lr_ratio": 0.0,
            "curriculum": "fixed",
            "train_max_length": 128,
            "test_lengths": "512",
            "train_eval_lengths": "128",
            "eval_samples": 1000,
            "eval_batch_size": 250,
            "layers": 1,
            "heads": 8,
            "dim": 256,
            "ffn": 1024,
        },
    ),
    # Liu et al.'s flip-flop (spec 4.2-4.4): FFL(0.8) at T = 512 (n = 256), 10,000 steps x 16,
    # AdamW lr 3e-4 wd 0.1, 50 warm-up steps then decay to 0; the 6-layer, 512-wide, 8-head
    # transformer; 1,000 in-distribution test sequences (the sparse and dense splits:
    # ``che-bench evaluate --eval-task-param p_ignore=...``).
    "flip_flop": (
        "state_tracking",
        {
            "steps": 10_000,
            "batch_size": 16,
            "lr": 3e-4,
            "weight_decay": 0.1,
            "warmup_steps": 50,
            "min_lr_ratio": 0.0,
            "curriculum": "fixed",
            "train_max_length": 256,
            "test_lengths": "256",
            "train_eval_lengths": "256",
            "eval_samples": 1000,
            "eval_batch_size": 100,
            "layers": 6,
            "dim": 512,
            "heads": 8,
            "ffn": 2048,
        },
    ),
    # The length-generalisation variant of Grazzi et al.'s notebook (spec 4.5): train on the
    # first 64 tokens (n = 32), test at T = 512 (n = 256); AdamW lr 3e-3, batch 32, 16,000
    # steps (one pass over its batches).
    "flip_flop_length": (
        "flip_flop",
        {
            "steps": 16_000,
            "batch_size": 32,
            "lr": 3e-3,
            "warmup_steps": 0,
            "train_max_length": 32,
            "train_eval_lengths": "32",
        },
    ),
    # Merrill, Petty & Sabharwal's in-distribution protocol (spec 1.3, 1.5-1.6): their files'
    # 10^6 distinct sequences a length (all where fewer), every length below k = 20 trained on
    # whole, 80% of k's, tested on the other 20% (``--train-max-length K --test-lengths K``
    # for another k); one layer of d_model 512, 8 heads, d_ff 2048, no dropout; AdamW lr 1e-4
    # wd 0.01, batch 32.
    "merrill": (
        "state_tracking",
        {
            "sample_set": 1_000_000,
            "steps": 20_000,
            "batch_size": 32,
            "lr": 1e-4,
            "weight_decay": 0.01,
            "warmup_steps": 0,
            "lr_schedule": "constant",
            "train_max_length": 20,
            "test_lengths": "20",
            "train_eval_lengths": "auto",
            "eval_samples": 1000,
            "eval_batch_size": 100,
            "layers": 1,
            "dim": 512,
            "heads": 8,
            "ffn": 2048,
        },
    ),
}

#: Number of in-distribution lengths evaluated when ``train_eval_lengths`` is "auto".
AUTO_TRAIN_EVAL_COUNT = 5


def preset_settings(
    name: str, architecture_presets: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A copy of the preset's settings, with an architecture's own settings by preset
    (``architecture_presets``) over those of its base preset and under those a protocol
    preset changes; unknown names are a CheBenchError."""
    if name not in PRESETS and name not in PROTOCOL_PRESETS:
        raise CheBenchError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    chain = _protocol_chain(name)
    values = dict(PRESETS[chain[0]])
    values.update((architecture_presets or {}).get(chain[0], {}))
    for preset in chain[1:]:
        values.update(PROTOCOL_PRESETS[preset][1])
    return values


def _protocol_chain(name: str) -> list[str]:
    """The preset of ``PRESET_NAMES`` that preset ``name`` builds on, then the protocol
    presets from the first built on it to ``name`` (just ``[name]`` for a base preset)."""
    chain = [name]
    while chain[0] in PROTOCOL_PRESETS:
        chain.insert(0, PROTOCOL_PRESETS[chain[0]][0])
    return chain


PRESETS.update({name: preset_settings(name) for name in PROTOCOL_PRESETS})


def parse_lengths(spec: str | int | Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated lengths from ``"41:500"`` (inclusive), ``"41:500:20"``
    (inclusive start, stride, end included only when on the stride), comma lists of either
    (``"41:500:20,500"``), a single int or an iterable of ints."""
    if isinstance(spec, bool):
        raise CheBenchError(f"bad length specification {spec!r}")
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            items.extend(_parse_length_part(part.strip(), spec))
    else:
        items = [_as_length(value, spec) for value in spec]
    if not items:
        raise CheBenchError(f"empty length specification {spec!r}")
    if min(items) < 1:
        raise CheBenchError(f"lengths must be >= 1, got {spec!r}")
    return tuple(sorted(set(items)))


def _parse_length_part(part: str, spec: object) -> list[int]:
    fields = part.split(":")
    if len(fields) == 1:
        return [_as_length(fields[0], spec)]
    if len(fields) not in (2, 3):
        raise CheBenchError(f"bad length range {part!r} in {spec!r}; use START:END[:STRIDE]")
    start, end = _as_length(fields[0], spec), _as_length(fields[1], spec)
    stride = _as_length(fields[2], spec) if len(fields) == 3 else 1
    if stride < 1 or start > end:
        raise CheBenchError(
            f"bad length range {part!r} in {spec!r}; need START <= END, STRIDE >= 1"
        )
    return list(range(start, end + 1, stride))


def _as_length(value: object, spec: object) -> int:
    try:
        if isinstance(value, str):
            return int(value.strip())
        if isinstance(value, bool) or not isinstance(value, SupportsInt) or int(value) != value:
            raise ValueError
        return int(value)
    except (OverflowError, TypeError, ValueError):  # OverflowError: an infinite float
        raise CheBenchError(f"bad length {value!r} in length specification {spec!r}") from None


def auto_train_eval_lengths(min_length: int, train_max_length: int) -> tuple[int, ...]:
    """A few in-distribution lengths evenly spread over ``min_length..train_max_length``."""
    count = min(AUTO_TRAIN_EVAL_COUNT, train_max_length - min_length + 1)
    if count <= 1:
        return (train_max_length,)
    span = train_max_length - min_length
    return tuple(sorted({min_length + round(i * span / (count - 1)) for i in range(count)}))


def score_lengths(
    test_lengths: Iterable[int], train_max_length: int, score_from_42: bool
) -> tuple[int, ...]:
    """The test lengths a run's score averages over: all, or with ``score_from_42`` those
    beyond ``train_max_length + 1``."""
    if not score_from_42:
        return tuple(test_lengths)
    return tuple(n for n in test_lengths if n > train_max_length + 1)


def format_lengths(lengths: Iterable[int]) -> str:
    """Compact text of a length set, e.g. ``41..500`` or ``41..500 (24 lengths)``."""
    lengths = sorted(lengths)
    if not lengths:
        return "-"
    if len(lengths) == 1:
        return str(lengths[0])
    if lengths == list(range(lengths[0], lengths[-1] + 1)):
        return f"{lengths[0]}..{lengths[-1]}"
    return f"{lengths[0]}..{lengths[-1]} ({len(lengths)} lengths)"
