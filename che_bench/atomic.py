"""Files written whole or not at all: a kill never leaves a torn checkpoint or model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from che_bench.errors import CheBenchError


def save_atomically(content: Any, path: Path, what: str) -> None:
    """``torch.save`` into a temporary file beside ``path``, then rename it over ``path``;
    an OSError becomes a one-line CheBenchError about ``what``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(content, temporary)
        os.replace(temporary, path)
    except OSError as exc:
        raise CheBenchError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
