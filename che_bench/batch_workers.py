"""Training batches of a wide pack made in worker processes, outside the step loop's GIL.

Each worker owns the data generators of a contiguous share of the members and makes their
batches, in order, at the lengths the step loop sends it (drawn there from the pack's length
generator); it returns the arrays and its generators' states after each batch. The batches
are therefore exactly those made in one process, whatever the number of workers.

Spawned, so this module and the tasks import numpy only: a worker starts without torch.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Task

#: Lengths sent to each worker ahead of the batch being consumed.
LENGTHS_AHEAD = 4
#: Seconds between checks that a worker is still alive while waiting for its batch.
LIVENESS_POLL_S = 1.0

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def _work(task: Task, batch_size: int, states: list[dict], lengths: Any, out: Any) -> None:
    """A worker: for each length received (None: stop), its members' stacked batch and their
    generators' states after it."""
    # Ctrl-C reaches the whole process group: the step loop handles it (finishing its step,
    # saving checkpoints) and then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rngs = [np.random.default_rng() for _ in states]
    for rng, state in zip(rngs, states):
        rng.bit_generator.state = state
    try:
        while (length := lengths.get()) is not None:
            batches = [task.sample(length, batch_size, rng) for rng in rngs]
            out.put((
                np.stack([batch.inputs for batch in batches]),  # copies reversed views too
                np.stack([batch.targets for batch in batches]),
                np.stack([batch.mask for batch in batches]),
                [rng.bit_generator.state for rng in rngs],
            ))
    except Exception as exc:  # noqa: BLE001 - reported to the step loop, which raises it
        out.put(f"{type(exc).__name__}: {exc}")
        return
    out.cancel_join_thread()  # told to stop: batches made ahead may stay unread


def shares(members: int, workers: int) -> list[range]:
    """Contiguous member ranges, one per worker, as even as possible."""
    bounds = np.linspace(0, members, min(workers, members) + 1).round().astype(int)
    return [range(start, stop) for start, stop in zip(bounds[:-1], bounds[1:])]


class BatchWorkers:
    """Worker processes making a pack's batches; ``batches(lengths)`` yields, in order, each
    length's ``(inputs, targets, mask)`` for every member and the members' data generator
    states after it. ``close()`` stops the workers (also at the end of ``batches``)."""

    def __init__(self, task: Task, batch_size: int, data_states: Sequence[dict],
                 workers: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._lengths, self._outputs, self._processes = [], [], []
        for share in shares(len(data_states), workers):
            lengths, out = context.Queue(), context.Queue()
            process = context.Process(
                target=_work, daemon=True,
                args=(task, batch_size, [data_states[m] for m in share], lengths, out),
            )
            process.start()
            self._lengths.append(lengths)
            self._outputs.append(out)
            self._processes.append(process)

    def batches(self, lengths: Iterator[int]) -> Iterator[tuple[Arrays, list[dict]]]:
        pending: deque[int] = deque()
        try:
            while True:
                while len(pending) < LENGTHS_AHEAD and (length := next(lengths, None)) is not None:
                    pending.append(length)
                    for channel in self._lengths:
                        channel.put(length)
                if not pending:
                    return
                pending.popleft()
                parts = [self._receive(index) for index in range(len(self._processes))]
                arrays = tuple(np.concatenate([part[i] for part in parts]) for i in range(3))
                yield arrays, [state for part in parts for state in part[3]]
        finally:
            self.close()

    def _receive(self, index: int) -> tuple:
        while True:
            try:
                part = self._outputs[index].get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                if not self._processes[index].is_alive():
                    raise CheBenchError("a batch worker process died") from None
                continue
            if isinstance(part, str):
                raise CheBenchError(f"a batch worker failed: {part}")
            return part

    def close(self) -> None:
        for channel, process in zip(self._lengths, self._processes):
            if process.is_alive():
                channel.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
        self._processes = []
        self._lengths, self._outputs = [], []
