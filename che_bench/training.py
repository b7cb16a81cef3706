"""The training loop of the CHE protocol, resumable bit for bit.

Each step draws one length uniformly from ``task.min_length..train_max_length`` and a batch of
that length from a numpy Generator seeded with ``data_seed``; the loss is the per-token
cross-entropy averaged over batch and output positions (unmasked, as in the reference); Adam
follows global-norm clipping; modules with ``project_()`` (Kerple's positivity) are projected
after every step. Dropout and randomized encodings draw from torch's global RNG.

A checkpoint holds the model, the optimizer, the step and every RNG state, so resuming gives
exactly the result of an uninterrupted run. Ctrl-C is deferred to the end of the current step,
a checkpoint is written, then KeyboardInterrupt is re-raised.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from che_bench.config import RunConfig
    from che_bench.tasks.base import Task


class Diverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class TrainingOutcome:
    steps_done: int
    resumed_from_step: int
    final_loss: float
    timings: dict[str, float] = field(default_factory=dict)


def batch_to_device(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask) tensors. The arrays are copied: task arrays may be reversed
    views, whose negative strides torch rejects (even on size-1 axes numpy calls contiguous)."""
    return tuple(  # type: ignore[return-value]
        torch.from_numpy(array.copy()).to(device)
        for array in (batch.inputs, batch.targets, batch.mask)
    )


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per output token, averaged over batch and positions; not masked."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def masked_correct(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(correct masked-in positions, masked-in positions) of a batch."""
    hits = (logits.argmax(-1) == targets) & mask
    return int(hits.sum()), int(mask.sum())


def make_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        model.parameters(), lr=config.lr, betas=tuple(config.adam_betas), eps=config.adam_eps
    )


def train(
    model: torch.nn.Module,
    task: Task,
    config: RunConfig,
    device: torch.device,
    *,
    checkpoint: Path | None = None,
    checkpoint_every: int = 1000,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainingOutcome:
    """Train ``model`` (already on ``device``, freshly initialised from ``config.seed``) for
    ``config.steps`` steps, resuming from ``checkpoint`` when that file exists."""
    optimizer = make_optimizer(model, config)
    data_rng = np.random.default_rng(config.data_seed)
    projected = [module for module in model.modules() if hasattr(module, "project_")]
    step, seconds_before = 0, 0.0
    if checkpoint is not None and checkpoint.exists():
        step, seconds_before = _load_checkpoint(checkpoint, model, optimizer, data_rng, config, device)
    resumed_from = step

    model.train()
    running_loss, running_acc = math.nan, math.nan
    started = time.perf_counter()

    def save() -> None:
        _save_checkpoint(checkpoint, model, optimizer, data_rng, config, step,
                         seconds_before + time.perf_counter() - started)

    between_steps = True  # False while a step is half done (state not consistent)
    try:
        with _deferred_interrupt() as interrupted, _progress_bar(progress, config, step) as bar:
            while step < config.steps:
                between_steps = False
                length = int(data_rng.integers(task.min_length, config.train_max_length + 1))
                inputs, targets, mask = batch_to_device(
                    task.sample(length, config.batch_size, data_rng), device
                )
                logits = model(inputs)
                loss = token_loss(logits, targets)
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise Diverged(
                        f"diverged at step {step + 1}: loss is {loss_value} (lr {config.lr:g})"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
                optimizer.step()
                for module in projected:
                    module.project_()
                step += 1
                between_steps = True

                correct, total = masked_correct(logits.detach(), targets, mask)
                running_loss = _smooth(running_loss, loss_value)
                running_acc = _smooth(running_acc, correct / max(total, 1))
                if bar is not None:
                    bar.update(bar.task_ids[0], completed=step, loss=running_loss, acc=running_acc)
                if on_step is not None:
                    on_step(step, loss_value)
                if interrupted.is_set():
                    raise KeyboardInterrupt
                if checkpoint is not None and (step % checkpoint_every == 0 or step == config.steps):
                    save()  # also at the end, so an interrupted evaluation keeps the training
    except KeyboardInterrupt:
        if checkpoint is None:
            sys.stderr.write("che-bench: interrupted (no checkpoint directory, progress lost)\n")
        elif between_steps:
            save()
            sys.stderr.write(
                f"che-bench: checkpoint saved at step {step}/{config.steps} in {checkpoint}; "
                "run the same command again to resume\n"
            )
        else:
            sys.stderr.write("che-bench: aborted mid-step; a re-run resumes from the last checkpoint\n")
        raise

    new_steps = step - resumed_from
    elapsed = time.perf_counter() - started
    return TrainingOutcome(
        steps_done=step,
        resumed_from_step=resumed_from,
        final_loss=running_loss,
        timings={
            "train_s": seconds_before + elapsed,
            "steps_per_s": new_steps / max(elapsed, 1e-9),
            "resumed_from_step": float(resumed_from),
        },
    )


def _smooth(previous: float, value: float, weight: float = 0.95) -> float:
    return value if math.isnan(previous) else weight * previous + (1 - weight) * value


# --- checkpoints -------------------------------------------------------------------------------


def _save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_rng: np.random.Generator,
    config: RunConfig,
    step: int,
    train_seconds: float,
) -> None:
    """Write atomically (temp file + rename), so a kill never leaves a torn checkpoint."""
    state = {
        "run_id": config.run_id(),
        "step": step,
        "train_seconds": train_seconds,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "data_rng": data_rng.bit_generator.state,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(state, temporary)
        os.replace(temporary, path)
    except OSError as exc:
        raise CheBenchError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None


def _load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_rng: np.random.Generator,
    config: RunConfig,
    device: torch.device,
) -> tuple[int, float]:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:
        raise CheBenchError(f"unreadable checkpoint {path} ({exc}); delete it to start over") from None
    if state.get("run_id") != config.run_id():
        raise CheBenchError(f"checkpoint {path} belongs to another run; delete it to start over")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"].cpu())
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    data_rng.bit_generator.state = state["data_rng"]
    return int(state["step"]), float(state["train_seconds"])


# --- Ctrl-C and progress --------------------------------------------------------------------


@contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """Turn the first SIGINT into a flag checked between steps (a second one aborts at once).
    Only possible in the main thread; elsewhere the event simply never fires."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        event.set()
        sys.stderr.write("\nche-bench: stopping after this step (Ctrl-C again to abort)\n")

    signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _progress_bar(enabled: bool, config: RunConfig, start: int) -> Iterator[Progress | None]:
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    bar = Progress(
        TextColumn("train"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.1%}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with bar:
        bar.add_task("train", total=config.steps, completed=start, loss=math.nan, acc=math.nan)
        yield bar
