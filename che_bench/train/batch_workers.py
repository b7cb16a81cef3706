"""Training batches of a wide pack made in worker processes, outside the step loop's GIL.

Each worker owns the data generators of a contiguous share of the members and makes their
batches, in order, at the lengths the step loop sends it (drawn there from the pack's length
generator); it returns the arrays and its generators' states after each batch. The batches
are therefore exactly those made in one process, whatever the number of workers.

A worker is ``python -m che_bench.train.batch_workers`` talking over two pipes, not a
multiprocessing child: spawn would run the user's main module again in every worker (a
script without a ``__main__`` guard would then start training there), while this imports
che-bench and the module of the pickled task only (numpy, no torch). A worker stops when its
owner closes the pipes or dies (even by SIGKILL: the pipe ends, or its parent changes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import numpy as np

from che_bench.errors import CheBenchError
from che_bench.tasks.base import Task

#: Lengths sent to each worker ahead of the batch being consumed.
LENGTHS_AHEAD = 4
#: Seconds between checks that the other side is still alive while waiting for it.
LIVENESS_POLL_S = 1.0
#: Seconds a worker gets to exit once its pipes are closed, before it is killed.
EXIT_GRACE_S = 10

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


class _OwnerGone(Exception):
    """The process that started this worker has ended."""


def _next_length(lengths: Connection, owner: int) -> int:
    """The next length the owner sends; _OwnerGone when it closed the pipe or died."""
    while not lengths.poll(LIVENESS_POLL_S):
        if os.getppid() != owner:  # (the pipe stays open if a child of the owner holds it)
            raise _OwnerGone
    try:
        return lengths.recv()
    except EOFError:
        raise _OwnerGone from None


def _serve(lengths: Connection, out: Connection) -> None:
    """A worker: for each length received, its members' stacked batch and their generators'
    states after it; an error is sent back as one line."""
    owner = os.getppid()
    try:
        task, batch_size, states = lengths.recv()
        rngs = [np.random.default_rng() for _ in states]
        for rng, state in zip(rngs, states, strict=True):
            rng.bit_generator.state = state
        while True:
            length = _next_length(lengths, owner)
            batches = [task.sample(length, batch_size, rng) for rng in rngs]
            out.send(
                (
                    np.stack([batch.inputs for batch in batches]),  # copies reversed views too
                    np.stack([batch.targets for batch in batches]),
                    np.stack([batch.mask for batch in batches]),
                    [rng.bit_generator.state for rng in rngs],
                )
            )
    except (_OwnerGone, EOFError, BrokenPipeError):  # stopped: batches made ahead stay unread
        return
    except Exception as exc:
        with contextlib.suppress(OSError):  # the owner may be gone too
            out.send(f"{type(exc).__name__}: {exc}")


def _start_worker(
    task: Task, batch_size: int, states: list[dict]
) -> tuple[subprocess.Popen, Connection, Connection]:
    """A worker process and the two ends of its pipes held here (lengths in, batches out)."""
    lengths_read, lengths_write = os.pipe()
    out_read, out_write = os.pipe()
    # The worker finds che-bench and the plugins where this process does.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
    process = subprocess.Popen(
        [sys.executable, "-m", "che_bench.train.batch_workers", str(lengths_read), str(out_write)],
        pass_fds=(lengths_read, out_write),
        env=environment,
    )
    os.close(lengths_read)
    os.close(out_write)
    lengths, out = Connection(lengths_write, readable=False), Connection(out_read, writable=False)
    try:
        lengths.send((task, batch_size, states))
    except BrokenPipeError:  # it could not start (its error is on stderr)
        lengths.close()
        out.close()
        process.wait()
        raise CheBenchError("a batch worker process died") from None
    return process, lengths, out


def shares(members: int, workers: int) -> list[range]:
    """Contiguous member ranges, one per worker, as even as possible."""
    bounds = np.linspace(0, members, min(workers, members) + 1).round().astype(int)
    return [range(start, stop) for start, stop in itertools.pairwise(bounds)]


class BatchWorkers:
    """Worker processes making a pack's batches; ``batches(lengths)`` yields, in order, each
    length's ``(inputs, targets, mask)`` for every member and the members' data generator
    states after it. ``close()`` stops the workers (also at the end of ``batches``)."""

    def __init__(
        self, task: Task, batch_size: int, data_states: Sequence[dict], workers: int
    ) -> None:
        self._processes: list[subprocess.Popen] = []
        self._lengths: list[Connection] = []
        self._outputs: list[Connection] = []
        try:
            for share in shares(len(data_states), workers):
                process, lengths, out = _start_worker(
                    task, batch_size, [data_states[m] for m in share]
                )
                self._processes.append(process)
                self._lengths.append(lengths)
                self._outputs.append(out)
        except BaseException:
            self.close()
            raise

    def batches(self, lengths: Iterator[int]) -> Iterator[tuple[Arrays, list[dict]]]:
        pending: deque[int] = deque()
        try:
            while True:
                while len(pending) < LENGTHS_AHEAD and (length := next(lengths, None)) is not None:
                    pending.append(length)
                    self._send(length)
                if not pending:
                    return
                pending.popleft()
                parts = [self._receive(index) for index in range(len(self._processes))]
                inputs, targets, mask = (
                    np.concatenate([part[i] for part in parts]) for i in range(3)
                )
                arrays = (inputs, targets, mask)
                yield arrays, [state for part in parts for state in part[3]]
        finally:
            self.close()

    def _send(self, length: int) -> None:
        try:
            for channel in self._lengths:
                channel.send(length)
        except BrokenPipeError:
            raise CheBenchError("a batch worker process died") from None

    def _receive(self, index: int) -> tuple:
        out = self._outputs[index]
        while not out.poll(LIVENESS_POLL_S):
            if self._processes[index].poll() is not None:
                raise CheBenchError("a batch worker process died")
        try:
            part = out.recv()
        except EOFError:
            raise CheBenchError("a batch worker process died") from None
        if isinstance(part, str):
            raise CheBenchError(f"a batch worker failed: {part}")
        return part

    def close(self) -> None:
        """Stop the workers: their pipes closed, a worker waiting for a length or blocked
        sending a batch made ahead ends at once."""
        for channel in self._lengths + self._outputs:
            channel.close()
        for process in self._processes:
            try:
                process.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes, self._lengths, self._outputs = [], [], []


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the step loop handles it (finishing its step,
    # saving checkpoints) and then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
