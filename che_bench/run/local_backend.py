"""The local backend of ``che-bench sweep``: a pool of worker processes on this machine, each
running one pack at a time.

What the workers write (resuming, checkpoints saved, warnings) travels to the sweep process as
whole lines, which it prints on its standard error: above its live progress bar and wrapped
at spaces on a terminal, as a single run's messages are, rather than over the bar. A Ctrl-C
is announced once, by the sweep, for all the runs it stops.

Each worker runs one torch thread unless ``--threads`` says otherwise (``DEFAULT_THREADS``, as
``che-bench run``), and the workers split the CPUs this process may use
(``che_bench.device_memory.available_cpus``) between them for the batch workers a wide pack
starts. With a GPU named without an index (``--device auto`` or ``cuda``) and several GPUs
visible, worker k runs on ``cuda:{k mod GPUs}``, as Ray gives each task a GPU of its own; the
workers on one GPU share its free memory equally.
"""

from __future__ import annotations

import concurrent.futures
import io
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

from che_bench.allocator import keep_freed_memory
from che_bench.config import RunConfig
from che_bench.cpu import set_portable_environment
from che_bench.device_memory import allow_cpus, available_cpus, share_gpu_among
from che_bench.outcomes import RunResult
from che_bench.run.options import DEFAULT_THREADS, RuntimeOptions
from che_bench.run.runner import execute_runs
from che_bench.train.loop import announce_interrupts
from che_bench.train.progress import say

#: How often an idle-or-busy worker checks that the sweep process is still alive.
ORPHAN_POLL_S = 1.0
#: How long an orphaned worker may take to checkpoint its run before it exits anyway.
ORPHAN_GRACE_S = 60.0


def worker_devices(device: str, workers: int) -> list[str]:
    """The device of each of ``workers`` workers: round robin over the visible GPUs when
    ``device`` resolves to a GPU without an index and there are several; else ``device``."""
    import torch

    from che_bench.run.device import resolve_device

    resolved = resolve_device(device)
    gpus = torch.cuda.device_count() if resolved.type == "cuda" else 0
    if resolved.index is not None or gpus < 2:
        return [device] * workers
    return [f"cuda:{worker % gpus}" for worker in range(workers)]


class LocalBackend:
    """``workers`` spawned processes, each running one pack at a time (``execute_runs``) with
    ``options`` and ``options.threads`` torch threads (default ``DEFAULT_THREADS``), on the
    device ``worker_devices`` gives it; results travel back to the sweep process."""

    def __init__(self, workers: int, options: RuntimeOptions | None = None) -> None:
        from che_bench.run.device import resolve_device

        options = options or RuntimeOptions()
        self.workers = workers
        self.on_gpu = resolve_device(options.device).type == "cuda"
        self.devices = worker_devices(options.device, workers)
        self.threads = options.threads or DEFAULT_THREADS
        # Workers draw no progress bars: their lines would interleave on one terminal.
        self.options = options.with_changes(progress=False)
        if options.portable_cpu:  # read as the workers import torch: they inherit it
            set_portable_environment()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._relay: WorkerLines | None = None

    def capacity(self) -> int:
        return self.workers

    def submit(self, configs: list[RunConfig], width: int | str) -> concurrent.futures.Future:
        return self._executor().submit(_run_in_worker, configs, width, self.options)

    def wait(self, handles):
        done, _ = concurrent.futures.wait(handles, return_when=concurrent.futures.FIRST_COMPLETED)
        finished = []
        for future in done:
            try:
                finished.append((future, future.result()))
            except concurrent.futures.process.BrokenProcessPool as exc:
                self._discard_pool()  # a worker died (e.g. killed for memory); start a new pool
                finished.append((future, RuntimeError(f"worker process died: {exc}")))
            except Exception as exc:
                finished.append((future, exc))
        return finished

    def interrupt(self) -> None:
        if self._pool is None:
            return
        say(
            "\nche-bench: stopping the runs in flight after their current step; they save "
            "checkpoints (Ctrl-C again to abort)\n"
        )
        for process in list(self._pool._processes.values()):
            try:
                if process.pid is not None:
                    os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._stop_relay()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: forking a process that already runs torch threads can deadlock.
            context = multiprocessing.get_context("spawn")
            self._relay = WorkerLines(context)
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=context,
                initializer=_init_worker,
                # The counter numbers the pool's workers as they start (worker k: devices[k]).
                initargs=(
                    self.threads,
                    os.getpid(),
                    self.devices,
                    context.Value("i", 0),
                    self._relay.queue,
                ),
            )
        return self._pool

    def _discard_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._stop_relay()

    def _stop_relay(self) -> None:
        if self._relay is not None:
            self._relay.stop()
            self._relay = None


class WorkerLines:
    """The sweep's side of its workers' output: a queue of lines, printed on this process's
    standard error by a thread as they arrive (until ``stop``)."""

    def __init__(self, context: Any) -> None:
        self.queue = context.Queue()
        self.thread = threading.Thread(target=self._print_lines, daemon=True)
        self.thread.start()

    def _print_lines(self) -> None:
        for line in iter(self.queue.get, None):
            say(line + "\n")  # (sys.stderr: a live bar's proxy while one is shown)

    def stop(self) -> None:
        """Print what is queued still, then stop (the workers have exited or are abandoned)."""
        self.queue.put(None)
        self.thread.join()
        self.queue.close()


class LinesToSweep(io.TextIOBase):
    """A worker's standard output and error: each whole line is put on ``queue``, for the
    sweep to print (``WorkerLines``); a partial line waits for its end."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.queue.put(line)
        return len(text)


_run_active = threading.Event()
#: This worker's device (``worker_devices``), set as it starts.
_worker_device: str | None = None


def _init_worker(
    threads: int, sweep_pid: int, devices: list[str], counter: Any, lines: Any
) -> None:
    """Worker set-up: its output sent to the sweep (``LinesToSweep``), torch threads, its
    device and its part of that GPU's memory and of the CPUs, glibc's thresholds
    (``keep_freed_memory``), Ctrl-C handling, and an orphan watchdog."""
    import torch

    sys.stdout = sys.stderr = LinesToSweep(lines)
    announce_interrupts(False)  # the sweep says it once for all its runs
    keep_freed_memory()
    torch.set_num_threads(threads)
    take_place(claim_index(counter), devices)
    # Own process group: a Ctrl-C in the terminal reaches the sweep only, which then asks each
    # worker once to stop (a second SIGINT would abort training mid-step, without checkpoint).
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # between runs there is nothing to stop
    threading.Thread(target=_watch_sweep, args=(sweep_pid,), daemon=True).start()


def claim_index(counter: Any) -> int:
    """The next number of a pool's shared counter (a ``multiprocessing.Value``)."""
    with counter.get_lock():
        index = int(counter.value)
        counter.value += 1
    return index


def take_place(index: int, devices: list[str]) -> None:
    """Make this process worker ``index`` of ``len(devices)``: on ``devices[index]`` (modulo),
    with an equal part of that GPU's memory (among the workers on it) and of the CPUs."""
    global _worker_device
    _worker_device = devices[index % len(devices)]
    share_gpu_among(devices.count(_worker_device))
    allow_cpus(available_cpus() // len(devices))


def _run_in_worker(
    configs: list[RunConfig], width: int | str, options: RuntimeOptions
) -> list[RunResult]:
    """Runs in a worker, on its device; SIGINT stops them (training finishes its step and
    checkpoints)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _run_active.set()
    try:
        if _worker_device is not None:
            options = options.with_changes(device=_worker_device)
        return execute_runs(configs, options, pack=width)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _run_active.clear()


def _watch_sweep(sweep_pid: int) -> None:
    """Exit when the sweep process is gone (killed, even with SIGKILL): a run in progress is
    stopped first so it saves its checkpoint. Without this, orphaned workers would live on."""
    while os.getppid() == sweep_pid:
        time.sleep(ORPHAN_POLL_S)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # nobody relays lines now
    if _run_active.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while _run_active.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(1)
