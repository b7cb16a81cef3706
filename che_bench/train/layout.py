"""Fingerprints of one member's flat parameter layout, as ``PackOptimizer`` writes them into
its member state and checkpoints store them.

The fingerprint hashes the shapes of one member's parameters (in the model's order; names are
not needed), so a member's row of the optimizer's flat buffers is recognised by a pack of any
width. Checkpoint files of version 2 hashed the shapes with their pack's width in front; they
are still recognised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

#: Checkpoint version 2, whose fingerprint included the writing pack's width; still read.
WIDTH_BOUND_FORMAT = 2
#: The widest pack whose version-2 checkpoints are recognised (one hash per width tried).
MAX_WIDTH_BOUND_PACK = 1024


def member_layout(member_shapes: Sequence[torch.Size]) -> str:
    """Fingerprint of a model's flat layout from the shapes of one member's parameters (in
    the model's order: names are not needed)."""
    return _fingerprint([tuple(shape) for shape in member_shapes])


def _fingerprint(shapes: list[tuple[int, ...]]) -> str:
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]


def layout_matches(state: dict[str, Any], member_shapes: Sequence[torch.Size]) -> bool:
    """Whether a checkpoint's fingerprint is that of ``member_shapes``; a version-2 file
    fingerprinted the shapes with its pack's width in front, so each width is tried."""
    if state.get("format") != WIDTH_BOUND_FORMAT:
        return state["layout"] == member_layout(member_shapes)
    return any(
        state["layout"] == _fingerprint([(width, *shape) for shape in member_shapes])
        for width in range(1, MAX_WIDTH_BOUND_PACK + 1)
    )
