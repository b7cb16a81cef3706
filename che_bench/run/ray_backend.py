"""Ray backend of ``che-bench sweep``: every pack of runs is a Ray task; the driver alone
writes the store.

Each pack asks the cluster for ``num_cpus`` CPUs and ``num_gpus`` GPUs (fractions allowed:
several small CHE models share one GPU; a packed table cell wants a GPU of its own), runs
``execute_runs`` on whichever node Ray picks, and returns its RunResults to the driver as
soon as it finishes (``ray.wait``). Ray is an optional dependency, imported only when this
backend is used.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from che_bench import plugins
from che_bench.allocator import keep_freed_memory
from che_bench.config import RunConfig
from che_bench.cpu import PORTABLE_ENVIRONMENT
from che_bench.device_memory import allow_cpus, share_gpu
from che_bench.errors import CheBenchError
from che_bench.outcomes import RunResult
from che_bench.run.options import RuntimeOptions
from che_bench.run.runner import execute_runs

INSTALL_HINT = 'the Ray backend needs Ray: pip install "che-bench[ray]"'
#: Default share of a GPU per task when the cluster has GPUs and nothing else is asked for:
#: single runs share a GPU four ways; a pack (which sizes itself to the GPU) takes all of one.
DEFAULT_GPU_FRACTION = 0.25
PACKED_GPU_FRACTION = 1.0
#: Re-executions Ray may make of a run whose worker process or node died (not of failed runs).
SYSTEM_RETRIES = 2


def import_ray():
    """The ``ray`` module, or a CheBenchError telling how to install it."""
    try:
        import ray
    except ImportError:
        raise CheBenchError(INSTALL_HINT) from None
    return ray


def check_ray_device(device: str) -> None:
    """A Ray task sees only the GPU Ray grants it, as ``cuda:0``: a higher index in
    ``device`` would name a GPU the task cannot see (or, on a node with several, another
    task's), so it is a one-line CheBenchError."""
    index = device.partition(":")[2] if device.startswith("cuda:") else ""
    if index and index != "0":
        raise CheBenchError(
            f"--device {device} names one GPU, but a Ray task sees only the GPU Ray grants "
            "it (as cuda:0): give --device cuda or auto, and let Ray choose the GPUs"
        )


class RayBackend:
    """Runs sweep configs as Ray tasks on a local instance or a cluster.

    ``address``: None starts a private local instance (``num_cpus`` limits it, if given);
    ``"auto"`` joins the cluster started on this node with ``ray start``; ``ray://HOST:PORT``
    connects through Ray Client. ``run_cpus``/``run_gpus`` are each task's resources;
    ``run_gpus=None`` picks DEFAULT_GPU_FRACTION (PACKED_GPU_FRACTION with ``packed``) on
    clusters with GPUs, else 0. ``max_in_flight`` caps the tasks handed to Ray at once
    (default: what fits the cluster). ``options``: how the runs execute (pickled into each
    task; its ``threads`` is not used: a task gets as many as the CPUs Ray grants it).
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        run_cpus: float = 1.0,
        run_gpus: float | None = None,
        max_in_flight: int | None = None,
        local_cpus: int | None = None,
        packed: bool = False,
        options: RuntimeOptions | None = None,
    ) -> None:
        options = options or RuntimeOptions()
        check_ray_device(options.device)
        self.ray = import_ray()
        self._connected_here = not self.ray.is_initialized()
        self._in_flight: set = set()
        if self._connected_here:
            init_options: dict[str, Any] = {
                "address": address,
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            if address is None and local_cpus is not None:
                init_options["num_cpus"] = local_cpus
            plugin_modules = os.environ.get(plugins.ENVIRONMENT_VARIABLE)
            if plugin_modules:  # --plugin modules: the workers import them as the driver did
                init_options["runtime_env"] = {
                    "env_vars": {plugins.ENVIRONMENT_VARIABLE: plugin_modules}
                }
            try:
                self.ray.init(**init_options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = address or "a local instance"
                raise CheBenchError(
                    f"cannot start or reach Ray at {where}: {exc}".splitlines()[0]
                ) from None
        if run_gpus is None:
            share = PACKED_GPU_FRACTION if packed else DEFAULT_GPU_FRACTION
            run_gpus = share if self.ray.cluster_resources().get("GPU", 0) else 0.0
        if run_cpus <= 0 and run_gpus <= 0:
            raise CheBenchError("each run needs some CPUs or GPUs (num_cpus / num_gpus > 0)")
        self.run_cpus, self.run_gpus = run_cpus, run_gpus
        self.on_gpu = run_gpus > 0
        self.max_in_flight = max_in_flight
        # A task that asks for no GPU must not pick one up through device "auto"; tasks draw
        # no progress bars (their lines would interleave in the driver's log).
        device = "cpu" if options.device == "auto" and run_gpus == 0 else options.device
        self.options = options.with_changes(device=device, progress=False)
        # The portable CPU mode's settings must be there before a worker imports torch: they
        # go into the tasks' runtime environment (Ray starts workers for it).
        portable = {"env_vars": dict(PORTABLE_ENVIRONMENT)} if options.portable_cpu else {}
        self._remote = self.ray.remote(_run_in_ray_task).options(
            num_cpus=run_cpus,
            num_gpus=run_gpus,
            max_retries=SYSTEM_RETRIES,
            **({"runtime_env": portable} if portable else {}),
        )

    def capacity(self) -> int:
        """Runs to keep in flight: the cap if given, else how many fit the cluster now
        (re-read every time, so an autoscaling cluster is used as it grows)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        resources = self.ray.cluster_resources()
        fits = []
        if self.run_cpus > 0:
            fits.append(resources.get("CPU", 0) / self.run_cpus)
        if self.run_gpus > 0:
            fits.append(resources.get("GPU", 0) / self.run_gpus)
        return max(1, math.floor(min(fits) + 1e-9))

    def submit(self, configs: list[RunConfig], width: int | str):
        threads = max(1, math.floor(self.run_cpus))
        ref = self._remote.remote(configs, width, self.options, threads, self.run_gpus)
        self._in_flight.add(ref)
        return ref

    def wait(self, handles: Sequence) -> list[tuple[Any, list[RunResult] | BaseException]]:
        ready, rest = self.ray.wait(list(handles), num_returns=1)
        if rest:  # collect whatever else has finished too, without blocking
            more, _ = self.ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        finished = []
        for ref in ready:
            self._in_flight.discard(ref)
            try:
                finished.append((ref, self.ray.get(ref)))
            except Exception as exc:
                finished.append((ref, exc))
        return finished

    def interrupt(self) -> None:
        """Cancel the runs in flight: Ray raises KeyboardInterrupt in running tasks (they save
        their checkpoint) and drops queued ones."""
        for ref in self._in_flight:
            self.ray.cancel(ref)
        self._in_flight.clear()

    def close(self) -> None:
        if self._connected_here and self.ray.is_initialized():
            self.ray.shutdown()  # stops a private local instance; only disconnects from a cluster


def _run_in_ray_task(
    configs: list[RunConfig], width: int | str, options: RuntimeOptions, threads: int, gpus: float
) -> list[RunResult]:
    """Body of one Ray task: size torch's thread pool (and a wide pack's batch workers) to the
    CPUs Ray granted and memory budgets to the GPU fraction it granted (four 0.25-GPU tasks
    share one GPU), and glibc's thresholds (``keep_freed_memory``), then run."""
    import torch

    keep_freed_memory()
    torch.set_num_threads(threads)
    allow_cpus(threads)
    if gpus > 0:
        share_gpu(gpus)
    return execute_runs(configs, options, pack=width)
