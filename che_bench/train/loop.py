"""The training loop of the CHE protocol for a pack of runs, resumable bit for bit.

A pack is ``M`` runs that differ only in initialisation seed, data seed and learning rate
(``RunConfig.pack_key``); a single run is a pack of one. They train side by side in one
model with a member axis (``che_bench.members``): one forward and one backward per step for
all of them. Each member keeps its own parameters, Adam state, gradient clipping (global norm
per member), Kerple projection, dropout masks, randomized-position draws and training data;
the members share the length drawn at each step.

Each step draws one length uniformly from ``task.min_length..train_max_length`` (from the
length seed's generator, or, for a run without one, from its data generator as before the
length seed existed) and, per member, a batch of that length from a numpy Generator seeded
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

import math
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

from che_bench.train.checkpoints import (
    layout_matches,
    load_checkpoints,
    member_layout,
    save_checkpoints,
)
from che_bench.config import RunConfig
from che_bench.encodings.base import Draws
from che_bench.errors import CheBenchError
from che_bench.train.history import DEFAULT_LOG_EVERY, TrainingHistory
from che_bench.model.encoder import Encoder
from che_bench.tasks.base import Task

#: Batches made ahead of the step loop on a GPU.
PREFETCH_DEPTH = 4
#: Host-device synchronisations: every step on a CPU (free there), every this many on a GPU.
GPU_SYNC_EVERY = 50
#: On a GPU, packs of at least this many members make their batches in worker processes
#: (about 1 ms of Python per member and step for the slowest tasks at batch 128) ...
WIDE_PACK = 8
#: ... in at most this many, leaving a core to the step loop.
MAX_BATCH_WORKERS = 4


class Diverged(RuntimeError):
    """The loss became NaN or infinite (of every member); ``history`` holds their training
    history up to then."""

    def __init__(self, message: str, history: list[list[dict[str, Any]]] | None = None) -> None:
        super().__init__(message)
        self.history = history or []


def draw_seed(seed: int) -> int:
    """Seed of a run's generator of random positions, derived from its initialisation seed
    (a separate stream, so dropout and draws never share numbers)."""
    return int(np.random.SeedSequence([seed, 0x64726177]).generate_state(1)[0])


def check_token_ids(inputs: np.ndarray, task: Task) -> None:
    """Input ids must lie in ``0..input_size-1`` (checked on the host, before any copy)."""
    if inputs.size and (inputs.min() < 0 or inputs.max() >= task.input_size):
        raise CheBenchError(f"input ids must lie in 0..{task.input_size - 1}")


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy per output token, averaged over batch and positions, per member: logits
    ``[M, B, L, C]`` and targets ``[M, B, L]`` -> ``[M]``. Not masked (the CHE reference), or
    with ``mask`` (``[M, B, L]`` or ``[B, L]``) averaged over its positions only."""
    members = logits.shape[0]
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(members, -1)
    if mask is None:
        return per_token.mean(1)
    weights = mask.expand(targets.shape).reshape(members, -1).to(per_token.dtype)
    return (per_token * weights).sum(1) / weights.sum(1).clamp(min=1)


def masked_counts(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct masked-in positions and masked-in positions per member (device tensors ``[M]``);
    ``targets`` and ``mask`` are ``[M, B, L]`` or ``[B, L]`` (shared by the members)."""
    hits = (logits.argmax(-1) == targets) & mask
    counted = mask.expand_as(hits)
    return hits.flatten(1).sum(1), counted.flatten(1).sum(1)


def exact_counts(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences with every masked-in position right, and sequences with any masked-in
    position, per member (device tensors ``[M]``); shapes as in ``masked_counts``."""
    wrong = (logits.argmax(-1) != targets) & mask
    scored = mask.expand_as(wrong).any(-1)
    return (scored & ~wrong.any(-1)).sum(-1), scored.sum(-1)


# --- the optimizer ------------------------------------------------------------------------


class PackOptimizer:
    """Adam after global-norm gradient clipping, per member, for a model whose parameters
    all have a leading member axis.

    The parameters are re-homed into a flat ``[M, P]`` buffer (each parameter a view of its
    columns), and ``step`` copies the gradients autograd left in ``.grad`` into a second one
    with a single ``cat``, so clipping and the Adam update are a handful of whole-pack
    operations, whatever the number of parameter tensors (``zero_grad`` sets the gradients to
    None: autograd then hands over its own instead of adding each into a zeroed buffer, one
    operator per parameter). Members never mix: the norm, the clipping factor and the
    learning rate are per row. A learning rate of 0 leaves its member's weights unchanged.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lrs: Sequence[float],
        betas: Sequence[float],
        eps: float,
        max_norm: float,
    ) -> None:
        self.parameters = list(model.parameters())
        first = self.parameters[0]
        members = first.shape[0]
        if len(lrs) != members or any(p.shape[0] != members for p in self.parameters):
            raise ValueError("every parameter needs a leading member axis of one size per lr")
        sizes = [p[0].numel() for p in self.parameters]
        self.flat = first.new_empty(members, sum(sizes))
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        with torch.no_grad():
            for parameter, size in zip(self.parameters, sizes):
                columns = slice(offset, offset + size)
                self.flat[:, columns].copy_(parameter.reshape(members, size))
                parameter.data = self.flat[:, columns].view(parameter.shape)
                parameter.grad = None
                offset += size
        self.lrs = torch.tensor(list(lrs), dtype=self.flat.dtype, device=self.flat.device)[:, None]
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.max_norm = float(eps), float(max_norm)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.steps = 0
        #: Each member's gradient norm before clipping at the last step (on the device).
        self.grad_norms = torch.zeros_like(self.lrs[:, 0])
        #: The shapes of one member's parameters: its row of the flat buffers is portable to
        #: a pack of any width (``che_bench.train.checkpoints``).
        self.member_shapes = [p.shape[1:] for p in self.parameters]

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def _gather_gradients(self) -> None:
        """``flat_grad`` := the parameters' gradients (0 where a parameter got none)."""
        members = self.flat.shape[0]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        torch.cat([grad.reshape(members, -1) for grad in grads], dim=1, out=self.flat_grad)

    @torch.no_grad()
    def step(self) -> None:
        self._gather_gradients()
        norms = torch.linalg.vector_norm(self.flat_grad, dim=1, keepdim=True)
        self.grad_norms = norms[:, 0]
        # torch.nn.utils.clip_grad_norm_'s factor, per member.
        self.flat_grad.mul_((self.max_norm / (norms + 1e-6)).clamp(max=1.0))
        self.steps += 1
        grad = self.flat_grad
        self.exp_avg.lerp_(grad, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**self.steps
        bias_correction2 = 1 - self.beta2**self.steps
        denominator = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        self.flat.sub_(self.exp_avg / denominator * (self.lrs / bias_correction1))

    def member_state(self, member: int) -> dict[str, Any]:
        """One member's weights and Adam state (copies, on the CPU)."""
        return {
            "layout": member_layout(self.member_shapes),
            "adam_steps": self.steps,
            "flat": self.flat[member].cpu(),
            "exp_avg": self.exp_avg[member].cpu(),
            "exp_avg_sq": self.exp_avg_sq[member].cpu(),
        }

    @torch.no_grad()
    def load_member_state(self, member: int, state: dict[str, Any]) -> None:
        if (not layout_matches(state, self.member_shapes)
                or state["flat"].shape != self.flat[member].shape):
            raise CheBenchError("checkpoint is for another model layout")
        self.flat[member] = state["flat"]
        self.exp_avg[member] = state["exp_avg"]
        self.exp_avg_sq[member] = state["exp_avg_sq"]
        self.steps = int(state["adam_steps"])


def training_step(
    model: Encoder,
    optimizer: PackOptimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    projected: Sequence[torch.nn.Module],
    micro_batches: int = 1,
    loss_mask: torch.Tensor | None = None,
    draws: Draws | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of every member: forward, per-member loss, backward, clipped Adam,
    projection of constrained parameters. Returns (losses ``[M]``, logits), on the device.
    ``loss_mask`` (like ``targets``): the positions the loss counts (default: all).
    ``draws``: the randomized encoding's sample, drawn with the batch (default: drawn here).

    ``micro_batches`` > 1 splits the batch (every member's sequences alike) into that many
    forward/backward passes whose gradients add up to the whole batch's (the loss is a mean
    over sequences, so each part is weighted by its share); one random draw serves them all.
    On a CPU this keeps a pack's working set that of a single run: the step is memory-bound
    there, and a pack four times as wide no longer fits the caches a single run fits in.
    """
    if draws is None:
        draws = model.sample_draws(inputs.shape[-1])
    optimizer.zero_grad()
    if micro_batches <= 1:  # the GPU's step: no operator spent on splitting
        logits = model(inputs, draws)
        losses = token_loss(logits, targets, loss_mask)
        losses.sum().backward()  # members are independent: each gets its own loss's gradient
        losses, logits = losses.detach(), logits.detach()
    else:
        losses, logits = _micro_batched_backward(model, inputs, targets, loss_mask, draws,
                                                 micro_batches)
    optimizer.step()
    for module in projected:
        module.project_()
    return losses, logits


def _micro_batched_backward(
    model: Encoder, inputs: torch.Tensor, targets: torch.Tensor,
    loss_mask: torch.Tensor | None, draws: Any, micro_batches: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward in ``micro_batches`` passes, each weighted by its share of the
    batch; the whole batch's (losses, logits), detached."""
    batch = inputs.shape[1]
    losses, logits = [], []
    for rows in micro_batch_rows(batch, micro_batches):
        share = (rows.stop - rows.start) / batch
        part_logits = model(inputs[:, rows], draws)
        part_losses = token_loss(part_logits, targets[:, rows],
                                 None if loss_mask is None else loss_mask[:, rows])
        (part_losses.sum() * share).backward()
        losses.append(part_losses.detach() * share)
        logits.append(part_logits.detach())
    return torch.stack(losses).sum(0), torch.cat(logits, dim=1)


def micro_batch_rows(batch: int, parts: int) -> list[slice]:
    """``parts`` (at most ``batch``) contiguous row ranges covering ``batch`` rows, the first
    ``batch % parts`` one row longer (``torch.tensor_split``'s split, in plain integers)."""
    parts = min(parts, batch)
    size, longer = divmod(batch, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (part < longer))
    return [slice(start, stop) for start, stop in zip(bounds[:-1], bounds[1:])]


def batch_workers_for(members: int, device: torch.device) -> int:
    """Worker processes making a pack's batches: on a GPU, for a wide pack, as many as there
    are cores to spare (up to ``MAX_BATCH_WORKERS``); on a CPU none (its cores compute the
    step, and a batch costs the same there in any process)."""
    if device.type != "cuda" or members < WIDE_PACK:
        return 0
    return max(1, min(MAX_BATCH_WORKERS, (os.cpu_count() or 2) - 1))


def sync_every_for(device: torch.device) -> int:
    """Steps between reads of the device: every step on a CPU (free there), ``GPU_SYNC_EVERY``
    on a GPU."""
    return 1 if device.type == "cpu" else GPU_SYNC_EVERY


def micro_batches_for(members: int, device: torch.device) -> int:
    """Passes per training step: on a CPU one per member, so that each pass holds as many
    sequences as a single run's step (see ``training_step``); on a GPU one, the widest."""
    return members if device.type == "cpu" else 1


def projected_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose parameters are projected after every step (Kerple's positivity)."""
    return [module for module in model.modules() if hasattr(module, "project_")]


# --- batches ------------------------------------------------------------------------------


@dataclass
class PackBatch:
    """One step's training batch for every member, with the RNG states after drawing it."""

    length: int
    inputs: torch.Tensor  # [M, B, n]
    targets: torch.Tensor  # [M, B, L]
    mask: torch.Tensor  # [M, B, L]
    rng_states: dict[str, Any]
    #: The randomized encoding's sample for this batch (on the model's device), or None.
    draws: Draws | None = None


class BatchStream:
    """The training batches of a pack, in order: the shared length schedule and each
    member's data generator. Its RNG states can be saved and restored with the batches.

    ``workers`` > 0 (a pack with a length seed): the members' batches are made in that many
    worker processes (``che_bench.train.batch_workers``), the same batches as in this process.

    With ``model``, each batch also carries the randomized encoding's sample, drawn from the
    model's draw generators (seeded here with ``draw_seed``) by whoever makes the batches --
    the prefetching thread on a GPU, not the step loop (``randperm`` per member and layer:
    5.5 ms a step for 30 members) -- one sample per batch in order, as the step drew them.
    The generators run ahead with the batches made ahead: ``rewind_draws`` sets them back
    to the states after the last batch trained on, where the evaluation goes on drawing.
    """

    def __init__(self, task: Task, configs: Sequence[RunConfig], workers: int = 0,
                 model: Encoder | None = None) -> None:
        first = configs[0]
        self.task, self.batch_size = task, first.batch_size
        self.min_length, self.max_length = task.min_length, first.train_max_length
        self.data_rngs = [np.random.default_rng(config.data_seed) for config in configs]
        # Without a length seed (a single run) the lengths come from the data generator.
        seeded = first.length_seed is not None
        self.length_rng = np.random.default_rng(first.length_seed) if seeded else None
        self.workers = workers if seeded else 0
        self.model = model
        if model is not None:
            model.seed_draws([draw_seed(config.seed) for config in configs])

    def states(self) -> dict[str, Any]:
        return {
            "length": None if self.length_rng is None else self.length_rng.bit_generator.state,
            "data": [rng.bit_generator.state for rng in self.data_rngs],
            "draw": None if self.model is None else self.model.draw_states(),
        }

    def restore(self, states: dict[str, Any]) -> None:
        if self.length_rng is not None:
            self.length_rng.bit_generator.state = states["length"]
        for rng, state in zip(self.data_rngs, states["data"], strict=True):
            rng.bit_generator.state = state
        self.rewind_draws(states)

    def rewind_draws(self, states: dict[str, Any]) -> None:
        """The model's draw generators back to ``states`` (those after a batch)."""
        if self.model is not None:
            self.model.set_draw_states(states["draw"])

    def __iter__(self) -> Iterator[PackBatch]:
        if self.workers:
            return self._from_workers()
        return self._in_process()

    def _draw_length(self) -> int:
        length_rng = self.length_rng or self.data_rngs[0]
        return int(length_rng.integers(self.min_length, self.max_length + 1))

    def _batch(self, length: int, arrays: tuple[np.ndarray, ...], states: dict) -> PackBatch:
        """The batch of ``arrays`` with its sample drawn; ``states``: the length and data
        generators' after it."""
        inputs, targets, mask = arrays
        check_token_ids(inputs, self.task)
        draws = draw_states = None
        if self.model is not None:
            draws = self.model.sample_draws(inputs.shape[-1], evaluating=False)
            draw_states = self.model.draw_states()
        return PackBatch(length, torch.from_numpy(inputs), torch.from_numpy(targets),
                         torch.from_numpy(mask), {**states, "draw": draw_states}, draws)

    def _in_process(self) -> Iterator[PackBatch]:
        while True:
            length = self._draw_length()
            batches = [self.task.sample(length, self.batch_size, rng) for rng in self.data_rngs]
            arrays = tuple(np.stack([getattr(batch, name) for batch in batches])  # copies views
                           for name in ("inputs", "targets", "mask"))
            yield self._batch(length, arrays, self.states())  # (its "draw" replaced)

    def _from_workers(self) -> Iterator[PackBatch]:
        from che_bench.train.batch_workers import BatchWorkers

        workers = BatchWorkers(self.task, self.batch_size, self.states()["data"], self.workers)
        drawn: deque[tuple[int, dict]] = deque()  # lengths sent ahead, with the state after

        def lengths() -> Iterator[int]:
            while True:
                length = self._draw_length()
                drawn.append((length, self.length_rng.bit_generator.state))
                yield length

        try:
            for arrays, data_states in workers.batches(lengths()):
                length, length_state = drawn.popleft()
                yield self._batch(length, arrays, {"length": length_state, "data": data_states})
        finally:
            workers.close()


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; to a GPU copied from pinned memory without
    waiting for the copy (the caching host allocator keeps the pinned copy until it is done)."""
    pinned = tensor.pin_memory() if device.type == "cuda" else tensor
    return pinned.to(device, non_blocking=True)


def on_device(
    batches: Iterator[PackBatch], device: torch.device, prefetch: bool | None = None
) -> Iterator[PackBatch]:
    """The batches on ``device`` (``host_to_device``), made ahead on a background thread
    (``PREFETCH_DEPTH`` of them) when ``prefetch`` (default: on a GPU)."""
    if prefetch is None:
        prefetch = device.type == "cuda"

    def copied(batch: PackBatch) -> PackBatch:
        inputs, targets, mask = (host_to_device(tensor, device)
                                 for tensor in (batch.inputs, batch.targets, batch.mask))
        return PackBatch(batch.length, inputs, targets, mask, batch.rng_states, batch.draws)

    on_the_device = (copied(batch) for batch in batches)
    return prefetched(on_the_device, PREFETCH_DEPTH) if prefetch else on_the_device


_EXHAUSTED = object()


def prefetched(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items`` in order, computed up to ``depth`` ahead on a background thread; an error
    there is raised here, and closing this generator stops the thread."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer(item):
                    return
            offer(_EXHAUSTED)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            offer(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        while True:
            item = ready.get()
            if item is _EXHAUSTED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        producer.join()


# --- training -----------------------------------------------------------------------------


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


class _Readings:
    """What each step measured, kept on the device until read: losses, correct and counted
    positions and gradient norms per member (a ``[4, M]`` tensor per step), with the training
    seconds after the step (host time). ``read`` takes them off in one transfer and feeds
    the divergence watch, the running values and the history."""

    def __init__(self, members: int, first_step: int, history: TrainingHistory) -> None:
        self.values: list[torch.Tensor] = []
        self.seconds: list[float] = []
        self.first_step = first_step  # the step of the oldest pending reading
        self.history = history
        self.diverged_at: list[int | None] = [None] * members
        self.running_losses = [math.nan] * members
        self.running_accuracy = math.nan

    def add(self, losses: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor,
            grad_norms: torch.Tensor, seconds: float) -> None:
        self.values.append(torch.stack([losses, correct.to(losses.dtype),
                                        counted.to(losses.dtype), grad_norms.to(losses.dtype)]))
        self.seconds.append(seconds)

    def read(self) -> list[float]:
        """Pull the pending readings off the device; note divergences, running values and
        history. Returns the last read step's losses ([] when none was pending)."""
        if not self.values:
            return []
        values = torch.stack(self.values).tolist()  # [steps][4][M]
        seconds, first_step = list(self.seconds), self.first_step
        # Taken off before use: an interruption below never feeds a step to the history twice.
        self.values.clear(), self.seconds.clear()
        self.first_step += len(values)
        for offset, ((losses, correct, counted, norms), elapsed) in enumerate(zip(values, seconds)):
            _note_divergence(first_step + offset, losses, self.diverged_at, self.running_losses)
            self.history.add(first_step + offset, losses, correct, counted, norms, elapsed)
        correct, counted = (np.sum([step_values[i] for step_values in values], axis=0)
                            for i in (1, 2))
        accuracy = float(np.mean(correct / np.maximum(counted, 1)))
        self.running_accuracy = _smooth(self.running_accuracy, accuracy)
        return values[-1][0]

    def all_diverged(self) -> bool:
        return all(at is not None for at in self.diverged_at)


def train_pack(
    model: Encoder,
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
    steps = configs[0].steps
    if sync_every is None:
        sync_every = 1 if on_step is not None else sync_every_for(device)
    optimizer = PackOptimizer(model, [c.lr for c in configs], configs[0].adam_betas,
                              configs[0].adam_eps, configs[0].grad_clip_norm)
    if batch_workers is None:
        batch_workers = batch_workers_for(len(configs), device)
    stream = BatchStream(task, configs, workers=batch_workers, model=model)
    projected = projected_modules(model)
    micro_batches = micro_batches_for(len(configs), device)
    history = TrainingHistory([c.lr for c in configs], log_every, steps, on_history)
    masks_loss = task.output_layout == "in_place"  # unscored positions have no answer to learn
    step, seconds_before = _resume(checkpoints, configs, optimizer, stream, history, device)
    resumed_from = step
    readings = _Readings(len(configs), step + 1, history)
    last_states = stream.states()
    started = time.perf_counter()

    def save() -> None:
        readings.read()  # the history's open window goes into the checkpoints whole
        save_checkpoints(checkpoints, configs, optimizer, last_states, step,
                         seconds_before + time.perf_counter() - started, history, device)

    model.train()
    between_steps = True  # False while a step is half done (state not consistent)
    batches = on_device(iter(stream), device, prefetch)
    try:
        with _deferred_interrupt() as interrupted, _progress_bar(progress, steps, step) as bar:
            while step < steps:
                between_steps = False
                batch = next(batches)
                losses, logits = training_step(model, optimizer, batch.inputs, batch.targets,
                                               projected, micro_batches,
                                               batch.mask if masks_loss else None, batch.draws)
                step += 1
                last_states = batch.rng_states
                between_steps = True

                with torch.no_grad():
                    readings.add(losses, *masked_counts(logits, batch.targets, batch.mask),
                                 optimizer.grad_norms, seconds_before + time.perf_counter() - started)
                if step % sync_every == 0 or step == steps:
                    _check_in(readings, step, configs, on_step, bar)
                if interrupted.is_set():
                    raise KeyboardInterrupt
                if checkpoints is not None and (step % checkpoint_every == 0 or step == steps):
                    save()  # also at the end, so an interrupted evaluation keeps the training
    except KeyboardInterrupt:
        if checkpoints is not None and between_steps:
            save()
        _report_interrupt(checkpoints, between_steps, step, steps)
        raise
    finally:
        batches.close()
        stream.rewind_draws(last_states)

    new_steps = step - resumed_from
    elapsed = time.perf_counter() - started
    return PackTraining(
        steps_done=step,
        resumed_from_step=resumed_from,
        final_losses=readings.running_losses,
        diverged_at=readings.diverged_at,
        history=history.rows,
        timings={
            "train_s": seconds_before + elapsed,
            "steps_per_s": new_steps / max(elapsed, 1e-9),
            "resumed_from_step": float(resumed_from),
            "pack_members": float(len(configs)),
        },
    )


def _check_in(readings: _Readings, step: int, configs: Sequence[RunConfig],
              on_step: Callable[[int, list[float]], None] | None, bar: Progress | None) -> None:
    """Read the pending readings: report the step, stop when every member has diverged,
    show progress."""
    step_losses = readings.read()
    if on_step is not None:
        on_step(step, step_losses)
    if readings.all_diverged():
        raise Diverged(f"diverged at step {min(readings.diverged_at)}: loss is not finite "
                       f"(lr {', '.join(f'{c.lr:g}' for c in configs)})", readings.history.rows)
    if bar is not None:
        bar.update(bar.task_ids[0], completed=step,
                   loss=float(np.nanmean(readings.running_losses)), acc=readings.running_accuracy)


def _resume(checkpoints: Sequence[Path] | None, configs: Sequence[RunConfig],
            optimizer: PackOptimizer, stream: BatchStream, history: TrainingHistory,
            device: torch.device) -> tuple[int, float]:
    """The step and training seconds to go on from: those of the members' checkpoints (loaded
    into ``optimizer``, ``stream`` and ``history``, and said on stderr), or none."""
    if checkpoints is None or not any(path.exists() for path in checkpoints):
        return 0, 0.0
    step, seconds = load_checkpoints(checkpoints, configs, optimizer, stream, history, device)
    runs = ", ".join(config.run_id() for config in configs)
    sys.stderr.write(f"che-bench: run{'s' if len(configs) > 1 else ''} {runs}: resuming from step "
                     f"{step}/{configs[0].steps} (checkpoint in {checkpoints[0].parent})\n")
    return step, seconds


def _report_interrupt(checkpoints: Sequence[Path] | None, between_steps: bool, step: int,
                      steps: int) -> None:
    """Say on stderr what an interruption kept (the checkpoints are saved by then)."""
    if checkpoints is None:
        sys.stderr.write("che-bench: interrupted (no checkpoint directory, progress lost)\n")
    elif between_steps:
        sys.stderr.write(f"che-bench: checkpoint saved at step {step}/{steps} in "
                         f"{checkpoints[0].parent}; run the same command again to resume\n")
    else:
        sys.stderr.write("che-bench: aborted mid-step; a re-run resumes from the last checkpoint\n")


def _note_divergence(step: int, losses: Sequence[float], diverged_at: list[int | None],
                     running_losses: list[float]) -> None:
    """Mark members whose loss at ``step`` is not finite; smooth the others' running loss."""
    for member, loss in enumerate(losses):
        if diverged_at[member] is not None:
            continue
        if not math.isfinite(loss):
            diverged_at[member] = step
        else:
            running_losses[member] = _smooth(running_losses[member], loss)


def _smooth(previous: float, value: float, weight: float = 0.95) -> float:
    return value if math.isnan(previous) else weight * previous + (1 - weight) * value


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
def _progress_bar(enabled: bool, steps: int, start: int) -> Iterator[Progress | None]:
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
        bar.add_task("train", total=steps, completed=start, loss=math.nan, acc=math.nan)
        yield bar
