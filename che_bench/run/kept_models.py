"""Trained models kept beside the result store: ``NAME.models/<run id>.pt`` next to the store
file ``NAME.sqlite`` (``che_bench.store.files``; ``models/`` of older stores still read).

A kept model is one run's final weights plus the run's configuration (everything needed to
rebuild it), written atomically when the run completes. Files are read with
``torch.load(weights_only=True)``: loading never executes code from the file. A missing or
damaged file is a ``CheBenchError`` (one line), never a crash.
"""

from __future__ import annotations

from pathlib import Path

import torch

from che_bench.atomic import save_atomically
from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.base import BenchModel
from che_bench.store.files import MODELS, files_dir, run_file

FORMAT = "che-bench-model"
VERSION = 1


def models_dir_for(store_path: str | Path) -> Path:
    """Where a store's runs keep their models: ``NAME.models/`` beside the store file."""
    return files_dir(store_path, MODELS)


def model_path(models_dir: str | Path, run_id: str) -> Path:
    return Path(models_dir) / f"{run_id}.pt"


def save_model(models_dir: str | Path, config: RunConfig, state: dict[str, torch.Tensor]) -> Path:
    """Write one run's weights (a one-member ``state_dict``) atomically; returns the path."""
    path = model_path(models_dir, config.run_id())
    content = {
        "format": FORMAT,
        "version": VERSION,
        "run_id": config.run_id(),
        "config": config.to_dict(),
        "state": {name: tensor.detach().cpu() for name, tensor in state.items()},
    }
    save_atomically(content, path, "model")
    return path


def load_model(store_path: str | Path, run_id: str) -> tuple[RunConfig, BenchModel]:
    """The configuration and the rebuilt model (one member, on the CPU, eval mode) of a run
    of the store at ``store_path`` (its kept model, ``store.files.run_file``); a missing,
    foreign or damaged file is a CheBenchError."""
    path = run_file(store_path, MODELS, run_id)
    if not path.is_file():
        raise CheBenchError(
            f"no kept model for run {run_id} ({path} is missing: the run was made with "
            "--no-keep-model, before models were kept, or the file was removed)"
        )
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file: truncated, not a torch file, foreign pickle
        raise CheBenchError(
            f"kept model {path} is damaged or not a che-bench model ({_reason(exc)})"
        ) from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise CheBenchError(f"{path} is not a che-bench model file")
    if content.get("version") != VERSION:
        raise CheBenchError(
            f"kept model {path} has format version {content.get('version')}, "
            f"this che-bench reads version {VERSION}"
        )
    try:
        config = RunConfig.from_dict(content["config"])
        if config.run_id() != run_id or content.get("run_id") != run_id:
            raise CheBenchError(f"kept model {path} belongs to another run")
        model = build_architecture(config.arch, config.build_task(), **config.model_arguments())
        model.load_state_dict(content["state"])
    except CheBenchError:
        raise
    except Exception as exc:  # wrong keys, shapes or config fields: a damaged or foreign file
        raise CheBenchError(f"kept model {path} does not rebuild ({_reason(exc)})") from None
    return config, model.eval()


def _reason(exc: Exception) -> str:
    """The first line of an exception, named by its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
