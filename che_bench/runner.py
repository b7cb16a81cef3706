"""One benchmark run: its execution (train, then evaluate) on a device.

``execute_run`` trains and evaluates without touching the result store, so it can run in any
worker process; the caller records the returned ``RunResult`` (see ``che_bench.store``).
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import che_bench
from che_bench.config import RunConfig, RunResult
from che_bench.errors import CheBenchError


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is a CheBenchError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise CheBenchError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise CheBenchError("device cuda requested but torch sees no CUDA GPU")
    if resolved.type not in ("cpu", "cuda"):
        raise CheBenchError(f"unsupported device {device!r}; use auto, cpu or cuda[:N]")
    return resolved


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'' if threads == 1 else 's'})"


def software_versions() -> dict[str, str]:
    return {
        "che_bench": che_bench.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def checkpoint_path(checkpoint_dir: str | Path, run_id: str) -> Path:
    return Path(checkpoint_dir) / f"{run_id}.pt"


def execute_run(
    config: RunConfig,
    *,
    device: str = "auto",
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    checkpoint_every: int = 1000,
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """Train and evaluate one configuration; never touches the result store.

    With ``checkpoint_dir``, training state is saved there every ``checkpoint_every`` steps and
    on Ctrl-C, and a run with an existing checkpoint resumes from it (the final result is exactly
    that of an uninterrupted run); the checkpoint is removed once the run has finished.
    ``on_step(step, loss)`` is called after every optimizer step (progress hooks, tests).
    A diverged or crashed run returns ``status="failed"``; KeyboardInterrupt propagates
    after the checkpoint is saved.
    """
    from che_bench.evaluation import evaluate
    from che_bench.model import build_model
    from che_bench.training import Diverged, train

    run_id = config.run_id()
    torch_device = resolve_device(device)
    result = RunResult(
        run_id=run_id,
        config=config,
        status="failed",
        versions=software_versions(),
        device=describe_device(torch_device),
    )
    checkpoint = checkpoint_path(checkpoint_dir, run_id) if checkpoint_dir is not None else None
    started = time.perf_counter()
    try:
        task = config.build_task()
        torch.manual_seed(config.seed)
        model = build_model(task, pe=config.pe, kernel=config.kernel, **config.model_kwargs())
        result.details["model"] = model.describe()
        model.to(torch_device)
        training = train(
            model,
            task,
            config,
            torch_device,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            progress=progress,
            on_step=on_step,
        )
        result.timings.update(training.timings)
        evaluation = evaluate(model, task, config, torch_device, progress=progress)
    except KeyboardInterrupt:
        raise
    except Diverged as exc:  # deterministic: a resumed run would diverge again
        result.error = str(exc)
        finished = True
    except Exception as exc:  # recorded as a failed run; the traceback is kept in details
        result.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result.details["traceback"] = traceback.format_exc()
        finished = False  # keep the checkpoint: a re-run after a fix resumes
    else:
        finished = True
        result.status = "complete"
        result.score = evaluation.score
        result.train_accuracy = evaluation.train_accuracy
        result.per_length = evaluation.per_length
        result.train_per_length = evaluation.train_per_length
        result.timings["eval_s"] = evaluation.seconds
    result.timings["total_s"] = time.perf_counter() - started
    if checkpoint is not None and finished:
        checkpoint.unlink(missing_ok=True)
    return result
