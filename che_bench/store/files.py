"""Where a store's run files live: kept models and checkpoints, beside the store file.

A store ``DIR/NAME.sqlite`` keeps its runs' final weights in ``DIR/NAME.models/<run id>.pt``
and their checkpoints in ``DIR/NAME.checkpoints/<run id>.pt``, so that two stores in one
folder keep theirs apart. A che-bench before issue 44 kept them in ``DIR/models/`` and
``DIR/checkpoints/``, shared by every store of the folder (``shared_dir``): a run's file
missing from its store's own folder is looked for there (``run_file``), and a writer adopts
the shared checkpoints of its started runs (``adopt_shared_checkpoints``) before resuming.
"""

from __future__ import annotations

import os
from pathlib import Path

from che_bench.errors import CheBenchError

#: The kinds of run files, each the name of its folder (``NAME.models``, ``NAME.checkpoints``).
MODELS = "models"
CHECKPOINTS = "checkpoints"


def files_dir(store_path: str | os.PathLike, kind: str) -> Path:
    """The store's own folder of run files of ``kind``: ``NAME.<kind>/`` beside it."""
    path = Path(store_path).resolve()
    return path.parent / f"{path.stem}.{kind}"


def shared_dir(store_path: str | os.PathLike, kind: str) -> Path:
    """The folder of ``kind`` that the stores of the store's folder shared before issue 44."""
    return Path(store_path).resolve().parent / kind


def run_file(store_path: str | os.PathLike, kind: str, run_id: str) -> Path:
    """Run ``run_id``'s file of ``kind``: in the store's own folder, or in the shared one of
    older stores when it is only there; the own folder's path when it is nowhere."""
    own = files_dir(store_path, kind) / f"{run_id}.pt"
    shared = shared_dir(store_path, kind) / f"{run_id}.pt"
    return shared if not own.exists() and shared.exists() else own


def adopt_shared_checkpoints(store_path: str | os.PathLike, started: list[str]) -> list[str]:
    """Move the checkpoints of the ``started`` runs (of this store, about to resume) from the
    shared folder of older stores into the store's own, where the runner looks for them (one
    rename each: never copied, never lost); the ids of those moved."""
    shared = shared_dir(store_path, CHECKPOINTS)
    own = files_dir(store_path, CHECKPOINTS)
    moved = []
    for run_id in started:
        source, target = shared / f"{run_id}.pt", own / f"{run_id}.pt"
        if not source.is_file() or target.exists():
            continue
        try:
            own.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
        except OSError as exc:
            raise CheBenchError(
                f"cannot move checkpoint {source} to {own}: {exc.strerror or exc}"
            ) from None
        moved.append(run_id)
    return moved
