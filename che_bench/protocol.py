"""Protocol presets and the parsing of length ranges.

A preset is a complete set of run settings; every field can be overridden. ``paper`` is the
published CHE / DAPE protocol (a GPU budget), ``quick`` is sized for a laptop CPU (minutes per
single-output task, enough to see learning, far too short to reproduce the paper's numbers) and
``smoke`` only checks that everything runs (seconds). ``state_tracking`` is the xLSTM
harness's formal-language protocol as Grazzi et al. (ICLR 2025) ran it, translated to CHE's
tasks (docs/protocol.md).
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

#: Number of in-distribution lengths evaluated when ``train_eval_lengths`` is "auto".
AUTO_TRAIN_EVAL_COUNT = 5


def preset_settings(name: str) -> dict[str, Any]:
    """A copy of the preset's settings; unknown names are a CheBenchError."""
    if name not in PRESETS:
        raise CheBenchError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


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
