"""Trained models kept beside the result store: ``models/<run id>.pt`` next to the store file."""

from __future__ import annotations

from pathlib import Path


def models_dir_for(store_path: str | Path) -> Path:
    """Kept models live in ``models/`` beside the store file."""
    return Path(store_path).resolve().parent / "models"


def model_path(models_dir: str | Path, run_id: str) -> Path:
    return Path(models_dir) / f"{run_id}.pt"
