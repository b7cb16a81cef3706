"""A pack's training batches: one length per step (the run's curriculum; or, with
``batch_lengths = "mixed"``, one per sequence, padded), each member's own data and random
positions, made ahead on a background thread (on a GPU, copied from pinned memory) or in worker
processes for a wide pack."""

from __future__ import annotations

import queue
import threading
from collections import Counter, deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from che_bench import curricula
from che_bench.config import RunConfig
from che_bench.device_memory import usable_cpus
from che_bench.encodings.base import Draws
from che_bench.errors import CheBenchError
from che_bench.model.base import BenchModel
from che_bench.settings import MIXED
from che_bench.tasks.base import Task
from che_bench.train.metrics import check_token_ids

#: Batches made ahead of the step loop on a GPU.
PREFETCH_DEPTH = 4
#: On a GPU, packs of at least this many members make their batches in worker processes
#: (about 1 ms of Python per member and step for the slowest tasks at batch 128) ...
WIDE_PACK = 8
#: ... in at most this many, leaving a core to the step loop.
MAX_BATCH_WORKERS = 4


def draw_seed(seed: int) -> int:
    """Seed of a run's generator of random positions, derived from its initialisation seed
    (a separate stream, so dropout and draws never share numbers)."""
    return int(np.random.SeedSequence([seed, 0x64726177]).generate_state(1)[0])


def batch_workers_for(members: int, device: torch.device) -> int:
    """Worker processes making a pack's batches: on a GPU, for a wide pack, as many as this
    process has CPUs to spare (``usable_cpus``: its affinity, its part of a sweep's, a Ray
    task's; up to ``MAX_BATCH_WORKERS``); on a CPU none (its cores compute the step, and a
    batch costs the same there in any process)."""
    if device.type != "cuda" or members < WIDE_PACK:
        return 0
    return max(1, min(MAX_BATCH_WORKERS, usable_cpus() - 1))


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
    #: A mixed-length batch's input tokens per sequence ``[B]`` (each row padded after them;
    #: ``length`` is then the longest), or None: every sequence ``length`` long.
    lengths: torch.Tensor | None = None


class BatchStream:
    """The training batches of a pack, in order: the shared length schedule (the first
    config's curriculum, at the step counted here) and each member's data generator. Its RNG
    states can be saved and restored with the batches (the step with them: ``restore``).

    ``workers`` > 0 (a pack with a length seed): the members' batches are made in that many
    worker processes (``che_bench.train.batch_workers``), the same batches as in this process.

    With ``model``, each batch also carries the randomized encoding's sample, drawn from the
    model's draw generators (seeded here with ``draw_seed``) by whoever makes the batches --
    the prefetching thread on a GPU, not the step loop (``randperm`` per member and layer:
    5.5 ms a step for 30 members) -- one sample per batch in order, as the step drew them.
    The generators run ahead with the batches made ahead: ``rewind_draws`` sets them back
    to the states after the last batch trained on, where the evaluation goes on drawing.
    """

    def __init__(
        self,
        task: Task,
        configs: Sequence[RunConfig],
        workers: int = 0,
        model: BenchModel | None = None,
    ) -> None:
        first = configs[0]
        self.task, self.batch_size = task, first.batch_size
        self.min_length, self.max_length = task.min_length, first.train_max_length
        self.curriculum = curricula.build(
            first.curriculum,
            first.curriculum_options,
            range(self.min_length, self.max_length + 1),
            first.steps,
        )
        self.step = 0  # of the next length drawn, 0 first (CHE's curricula count so)
        self.data_rngs = [np.random.default_rng(config.data_seed) for config in configs]
        # Without a length seed (a single run) the lengths come from the data generator.
        seeded = first.length_seed is not None
        self.length_rng = np.random.default_rng(first.length_seed) if seeded else None
        self.mixed = first.batch_lengths == MIXED
        self.workers = workers if seeded and not self.mixed else 0
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
        """The generators back to ``states``, and the curriculum to ``states["step"]`` (the
        step reached: the next batch is that step's)."""
        self.step = int(states.get("step", 0))
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
        length = self.curriculum.length(self.step, length_rng)
        self.step += 1
        return length

    def _batch(
        self,
        length: int,
        arrays: tuple[np.ndarray, ...],
        states: dict,
        lengths: np.ndarray | None = None,
    ) -> PackBatch:
        """The batch of ``arrays`` with its sample drawn; ``states``: the length and data
        generators' after it; ``lengths``: a mixed batch's input tokens per sequence."""
        inputs, targets, mask = arrays
        check_token_ids(inputs, self.task)
        draws = draw_states = None
        if self.model is not None:
            draws = self.model.sample_draws(inputs.shape[-1], evaluating=False)
            draw_states = self.model.draw_states()
        return PackBatch(
            length,
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            torch.from_numpy(mask),
            {**states, "draw": draw_states},
            draws,
            None if lengths is None else torch.from_numpy(lengths),
        )

    def _in_process(self) -> Iterator[PackBatch]:
        if self.mixed:
            yield from self._mixed_in_process()
        while True:
            length = self._draw_length()
            batches = [self.task.sample(length, self.batch_size, rng) for rng in self.data_rngs]
            arrays = tuple(
                np.stack([getattr(batch, name) for batch in batches])  # copies views
                for name in ("inputs", "targets", "mask")
            )
            yield self._batch(length, arrays, self.states())  # (its "draw" replaced)

    def _mixed_in_process(self) -> Iterator[PackBatch]:
        """Mixed-length batches: each sequence's length drawn from the curriculum in turn
        (one draw per sequence, shared by the members), each member's sequences sampled
        length by length, shortest first, from its own generator and padded."""
        while True:
            length_rng = self.length_rng or self.data_rngs[0]
            drawn = [self.curriculum.length(self.step, length_rng) for _ in range(self.batch_size)]
            self.step += 1
            *arrays, lengths = mixed_pack_batch(self.task, drawn, self.data_rngs)
            yield self._batch(int(lengths.max()), tuple(arrays), self.states(), lengths)

    def _from_workers(self) -> Iterator[PackBatch]:
        from che_bench.train.batch_workers import BatchWorkers

        length_rng = self.length_rng
        if length_rng is None:  # never: runs that train as a pack share a length seed
            raise CheBenchError("batch workers need the runs' shared length seed")
        workers = BatchWorkers(self.task, self.batch_size, self.states()["data"], self.workers)
        drawn: deque[tuple[int, Any]] = deque()  # lengths sent ahead, with the state after

        def lengths() -> Iterator[int]:
            while True:
                length = self._draw_length()
                drawn.append((length, length_rng.bit_generator.state))
                yield length

        try:
            for arrays, data_states in workers.batches(lengths()):
                length, length_state = drawn.popleft()
                yield self._batch(length, arrays, {"length": length_state, "data": data_states})
        finally:
            workers.close()


def mixed_pack_batch(
    task: Task, drawn: Sequence[int], rngs: Sequence[np.random.Generator]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each member's mixed-length batch of the lengths ``drawn`` (one generator per member),
    stacked: (inputs, targets, mask ``[M, B, L]``, input tokens per sequence ``[B]``, which the
    members share)."""
    counts = sorted(Counter(drawn).items())
    members = [mixed_batch(task, counts, rng) for rng in rngs]
    inputs, targets, mask = (np.stack([member[part] for member in members]) for part in range(3))
    return inputs, targets, mask, members[0][3]


def mixed_batch(
    task: Task, counts: Sequence[tuple[int, int]], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, mask, input tokens per sequence) of ``count`` sequences of each
    requested length ``n`` in ``counts``, in that order, each row padded after its own tokens
    (inputs with id 0, targets with class 0 and the mask off: nothing scores or, in a causal
    model, reads the padding). The targets of an appended layout must have one length."""
    parts = [task.sample(n, count, rng) for n, count in counts]
    widths = {part.targets.shape[1] for part in parts}
    if task.output_layout != "in_place" and len(widths) > 1:
        raise CheBenchError(
            f"task {task.name!r} has outputs of several lengths in one mixed-length batch: "
            "mixed batches need one output length (or outputs at the inputs)"
        )
    lengths = np.concatenate([np.full(len(part.inputs), part.inputs.shape[1]) for part in parts])

    def padded(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
        out = np.zeros((len(lengths), max(array.shape[1] for array in arrays)), dtype=dtype)
        row = 0
        for array in arrays:
            out[row : row + len(array), : array.shape[1]] = array
            row += len(array)
        return out

    return (
        padded([part.inputs for part in parts], np.int64),
        padded([part.targets for part in parts], np.int64),
        padded([part.mask for part in parts], bool),
        lengths,
    )


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; to a GPU copied from pinned memory without
    waiting for the copy (the caching host allocator keeps the pinned copy until it is done)."""
    pinned = tensor.pin_memory() if device.type == "cuda" else tensor
    return pinned.to(device, non_blocking=True)


def on_device(
    batches: Iterator[PackBatch], device: torch.device, prefetch: bool | None = None
) -> Generator[PackBatch, None, None]:
    """The batches on ``device`` (``host_to_device``), made ahead on a background thread
    (``PREFETCH_DEPTH`` of them) when ``prefetch`` (default: on a GPU)."""
    if prefetch is None:
        prefetch = device.type == "cuda"

    def copied(batch: PackBatch) -> PackBatch:
        inputs, targets, mask = (
            host_to_device(tensor, device) for tensor in (batch.inputs, batch.targets, batch.mask)
        )
        lengths = None if batch.lengths is None else host_to_device(batch.lengths, device)
        return PackBatch(
            batch.length, inputs, targets, mask, batch.rng_states, batch.draws, lengths
        )

    on_the_device = (copied(batch) for batch in batches)
    return prefetched(on_the_device, PREFETCH_DEPTH) if prefetch else on_the_device


_EXHAUSTED = object()
T = TypeVar("T")


def prefetched(items: Iterator[T], depth: int) -> Generator[T, None, None]:
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
        except BaseException as exc:
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
