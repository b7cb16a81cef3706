"""The training loop of the CHE protocol for a pack of runs, resumable bit for bit.

A pack is ``M`` runs that differ only in initialisation seed, data seed and learning rate
(``RunConfig.pack_key``); a single run is a pack of one. They train side by side in one
model with a member axis (``che_bench.members``): one forward and one backward per step for
all of them. Each member keeps its own parameters, Adam state, gradient clipping (global norm
per member), Kerple projection, dropout masks, randomized-position draws and training data;
the members share the length drawn at each step.

Each step draws one length by the run's curriculum (``che_bench.curricula``; by default
uniformly from ``task.min_length..train_max_length``) from the length seed's generator, or,
for a run without one, from its data generator as before the length seed existed; and, per
member, a batch of that length from a numpy Generator seeded
with its ``data_seed``; the loss is the per-token cross-entropy averaged over batch and output
positions (unmasked, as in the reference). Dropout draws from torch's global RNG; randomized
encodings from per-member generators of their own.

Nothing in the step loop waits for the device: losses, accuracy counts and gradient norms
accumulate on it and are read every ``sync_every`` steps (finiteness, progress, the training
history of ``che_bench.train.history``), batches are made ahead on a background thread and copied
from pinned memory when training on a GPU, and a wide pack's batches are made in worker
processes (``che_bench.train.batch_workers``).

A member's checkpoint (``che_bench.train.checkpoints``) holds its weights, Adam state, every RNG
state and the step, so resuming gives exactly the result of an uninterrupted run; a pack of
another width resumes it too. Ctrl-C is deferred to the end of
the current step, checkpoints are written, then KeyboardInterrupt is re-raised.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from che_bench.config import RunConfig
from che_bench.model.base import BenchModel
from che_bench.tasks.base import Task
from che_bench.train.batches import BatchStream, PackBatch, batch_workers_for, on_device
from che_bench.train.checkpoints import (
    load_checkpoints,
    save_checkpoints,
)
from che_bench.train.history import DEFAULT_LOG_EVERY, TrainingHistory
from che_bench.train.metrics import masked_counts
from che_bench.train.optimizer import LrSchedule, PackOptimizer, pack_optimizer
from che_bench.train.progress import say, training_progress
from che_bench.train.readings import Readings, check_in
from che_bench.train.step import (
    micro_batches_for,
    projected_modules,
    training_autocast,
    training_step,
)

#: Host-device synchronisations: every step on a CPU (free there), every this many on a GPU.
GPU_SYNC_EVERY = 50


def sync_every_for(device: torch.device) -> int:
    """Steps between reads of the device: every step on a CPU (free there), ``GPU_SYNC_EVERY``
    on a GPU."""
    return 1 if device.type == "cpu" else GPU_SYNC_EVERY


@dataclass
class PackTraining:
    """What ``train_pack`` did; per-member lists in member order."""

    steps_done: int
    resumed_from_step: int
    final_losses: list[float]
    #: Step at which each member's loss first was not finite (None: it never diverged).
    diverged_at: list[int | None]
    timings: dict[str, float] = field(default_factory=dict)
    #: Each member's training history rows (``che_bench.train.history``), resumed steps included.
    history: list[list[dict[str, Any]]] = field(default_factory=list)


def train_pack(
    model: BenchModel,
    task: Task,
    configs: Sequence[RunConfig],
    device: torch.device,
    *,
    checkpoints: Sequence[Path] | None = None,
    checkpoint_every: int = 1000,
    progress: bool = True,
    on_step: Callable[[int, list[float]], None] | None = None,
    sync_every: int | None = None,
    log_every: int = DEFAULT_LOG_EVERY,
    on_history: Callable[[int, dict[str, Any]], None] | None = None,
    batch_workers: int | None = None,
    prefetch: bool | None = None,
) -> PackTraining:
    """Train the members of ``model`` (on ``device``, member m freshly initialised from
    ``configs[m].seed``) for ``steps`` steps, resuming from ``checkpoints`` (one path per
    member) when those files exist; all members must then be at the same step.

    ``on_step(step, losses)`` is called after every optimizer step with each member's loss
    (it makes the loop read the device every step). Each member's history gets a row every
    ``log_every`` steps and at the last one; ``on_history(member, row)`` sees each. Returns
    each member's outcome; a member whose loss stops being finite is reported in
    ``diverged_at`` (the others go on), and when every member has diverged training stops with
    ``Diverged``. ``batch_workers``: processes making the batches (default
    ``batch_workers_for``; the batches are the same either way). ``sync_every`` (read the
    device every N steps) and ``prefetch`` (batches made ahead on a thread) default to what
    suits the device; tests select the GPU's choices on a CPU.
    """
    if sync_every is None:
        sync_every = 1 if on_step is not None else sync_every_for(device)
    if batch_workers is None:
        batch_workers = batch_workers_for(len(configs), device)
    run = _PackRun(
        model,
        task,
        configs,
        device,
        checkpoints,
        TrainingHistory(
            [c.lr for c in configs],
            log_every,
            configs[0].steps,
            on_history,
            lr_factor=LrSchedule.of(configs[0]).factor,
        ),
        BatchStream(task, configs, workers=batch_workers, model=model),
    )
    batches = on_device(iter(run.stream), device, prefetch)
    try:
        run.run_steps(batches, progress, sync_every, checkpoint_every, on_step)
    finally:
        batches.close()
        run.stream.rewind_draws(run.last_states)
    return run.outcome()


class _PackRun:
    """The state ``train_pack``'s steps share: the pack's optimizer, batches, history and
    readings, the step reached and the RNG states after its batch (what a checkpoint saves)."""

    def __init__(
        self,
        model: BenchModel,
        task: Task,
        configs: Sequence[RunConfig],
        device: torch.device,
        checkpoints: Sequence[Path] | None,
        history: TrainingHistory,
        stream: BatchStream,
    ) -> None:
        self.model, self.configs, self.device = model, configs, device
        self.checkpoints, self.history, self.stream = checkpoints, history, stream
        self.steps = configs[0].steps
        self.optimizer = pack_optimizer(model, configs)
        self.projected = projected_modules(model)
        self.micro_batches = micro_batches_for(len(configs), device)
        # In-place tasks: unscored positions have no answer to learn.
        self.masks_loss = task.output_layout == "in_place"
        self.autocast = training_autocast(configs[0])
        self.step, self.seconds_before = _resume(
            checkpoints, configs, self.optimizer, stream, history, device
        )
        self.resumed_from = self.step
        self.readings = Readings(len(configs), self.step + 1, history)
        self.last_states = stream.states()
        self.between_steps = True  # False while a step is half done (state not consistent)
        self.started = time.perf_counter()
        model.train()

    def run_steps(
        self,
        batches: Iterator[PackBatch],
        progress: bool,
        sync_every: int,
        checkpoint_every: int,
        on_step: Callable[[int, list[float]], None] | None,
    ) -> None:
        """Train to the last step, reading the device every ``sync_every`` steps and saving
        every ``checkpoint_every``; Ctrl-C waits for the end of the step, then the members'
        checkpoints are saved and KeyboardInterrupt goes on."""
        try:
            with (
                _deferred_interrupt() as interrupted,
                training_progress(progress, self.label(), self.steps, self.step) as bar,
            ):
                while self.step < self.steps:
                    self.train_step(next(batches))
                    last = self.step == self.steps
                    if self.step % sync_every == 0 or last:
                        check_in(self.readings, self.step, self.configs, on_step, bar)
                    if interrupted.is_set():
                        raise KeyboardInterrupt
                    if self.checkpoints is not None and (self.step % checkpoint_every == 0 or last):
                        self.save()  # also at the end: an interrupted evaluation keeps the training
        except KeyboardInterrupt:
            if self.checkpoints is not None and self.between_steps:
                self.save()
            _report_interrupt(
                self.label(), self.checkpoints, self.between_steps, self.step, self.steps
            )
            raise

    def label(self) -> str:
        """The runs, as progress lines name them."""
        more = f" (+{len(self.configs) - 1} in its pack)" if len(self.configs) > 1 else ""
        return f"run {self.configs[0].run_id()}{more}"

    def seconds(self) -> float:
        """Training seconds so far, resumed ones included."""
        return self.seconds_before + time.perf_counter() - self.started

    def train_step(self, batch: PackBatch) -> None:
        """One optimizer step on ``batch``; its readings stay on the device."""
        self.between_steps = False
        losses, logits = training_step(
            self.model,
            self.optimizer,
            batch.inputs,
            batch.targets,
            self.projected,
            self.micro_batches,
            batch.mask if self.masks_loss else None,
            batch.draws,
            batch.lengths,
            self.autocast,
        )
        self.step += 1
        self.last_states = batch.rng_states
        self.between_steps = True
        with torch.no_grad():
            self.readings.add(
                losses,
                *masked_counts(logits, batch.targets, batch.mask),
                self.optimizer.grad_norms,
                self.seconds(),
            )

    def save(self) -> None:
        """Every member's checkpoint at the step reached (none without a checkpoint path)."""
        if self.checkpoints is None:
            return
        self.readings.read()  # the history's open window goes into the checkpoints whole
        save_checkpoints(
            self.checkpoints,
            self.configs,
            self.optimizer,
            self.last_states,
            self.step,
            self.seconds(),
            self.history,
            self.device,
        )

    def outcome(self) -> PackTraining:
        new_steps = self.step - self.resumed_from
        elapsed = time.perf_counter() - self.started
        return PackTraining(
            steps_done=self.step,
            resumed_from_step=self.resumed_from,
            final_losses=self.readings.running_losses,
            diverged_at=self.readings.diverged_at,
            history=self.history.rows,
            timings={
                "train_s": self.seconds_before + elapsed,
                # (the training seconds of earlier sessions, from the checkpoint resumed)
                "resumed_train_s": self.seconds_before,
                "steps_per_s": new_steps / max(elapsed, 1e-9),
                "resumed_from_step": float(self.resumed_from),
                "pack_members": float(len(self.configs)),
            },
        )


def _resume(
    checkpoints: Sequence[Path] | None,
    configs: Sequence[RunConfig],
    optimizer: PackOptimizer,
    stream: BatchStream,
    history: TrainingHistory,
    device: torch.device,
) -> tuple[int, float]:
    """The step and training seconds to go on from: those of the members' checkpoints (loaded
    into ``optimizer``, ``stream`` and ``history``, and said on stderr), or none."""
    if checkpoints is None or not any(path.exists() for path in checkpoints):
        return 0, 0.0
    step, seconds = load_checkpoints(checkpoints, configs, optimizer, stream, history, device)
    runs = ", ".join(config.run_id() for config in configs)
    say(
        f"che-bench: run{'s' if len(configs) > 1 else ''} {runs}: resuming from step "
        f"{step}/{configs[0].steps} (checkpoint in {checkpoints[0].parent})\n"
    )
    return step, seconds


def _report_interrupt(
    label: str, checkpoints: Sequence[Path] | None, between_steps: bool, step: int, steps: int
) -> None:
    """Say on stderr what the interruption of the runs ``label`` kept (the checkpoints are
    saved by then)."""
    if checkpoints is None:
        kept = "interrupted (no checkpoint directory, progress lost)"
    elif between_steps:
        kept = (
            f"checkpoint saved at step {step}/{steps} in {checkpoints[0].parent}; run the same "
            "command again to resume"
        )
    else:
        kept = "aborted mid-step; a re-run resumes from the last checkpoint"
    say(f"che-bench: {label}: {kept}\n")


# --- Ctrl-C ---------------------------------------------------------------------------------

#: Whether the first Ctrl-C is announced by this process (``announce_interrupts``).
_announce_interrupts = True


def announce_interrupts(announce: bool) -> None:
    """Whether this process says "stopping after this step" on the first Ctrl-C: not in a
    local sweep's workers, whose sweep says it once for all the runs it stops."""
    global _announce_interrupts
    _announce_interrupts = announce


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
        if _announce_interrupts:
            say("\nche-bench: stopping after this step (Ctrl-C again to abort)\n")

    signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)
