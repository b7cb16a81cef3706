"""What this process may use of the machine: the CPUs it may run on, its part of them and of
a GPU's free memory; and handing memory back after a failed attempt."""

from __future__ import annotations

import gc
import os
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a GPU is asked: the command line checks arguments without it
    import torch

#: The part of the memory the driver reports free that this process plans for: 1/N for one
#: of a sweep's N workers sharing a GPU, a Ray task's GPU fraction; all of it otherwise.
_gpu_share = Fraction(1)
#: The CPUs this process plans for, when fewer than it may run on: a sweep worker's part of
#: them, a Ray task's granted ``num_cpus``; None: all it may run on.
_cpu_allowance: int | None = None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's or
    ``taskset``'s limit narrows; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def allow_cpus(count: int | None) -> None:
    """Declare that this process has ``count`` of the CPUs (None: all it may run on)."""
    global _cpu_allowance
    _cpu_allowance = None if count is None else max(1, int(count))


def usable_cpus() -> int:
    """The CPUs this process plans for: those it may run on, as many as it was allowed."""
    available = available_cpus()
    return available if _cpu_allowance is None else min(available, _cpu_allowance)


def share_gpu(fraction: float) -> None:
    """Declare that this process has ``fraction`` of the GPU (a Ray task's ``num_gpus``; 1 or
    more: all of it)."""
    global _gpu_share
    if fraction <= 0:
        raise ValueError(f"a GPU share must be positive, got {fraction}")
    _gpu_share = min(Fraction(1), Fraction(fraction).limit_denominator(1000))


def share_gpu_among(processes: int) -> None:
    """Declare that ``processes`` processes (this one included) share the GPU equally."""
    share_gpu(float(Fraction(1, max(1, processes))))


def free_gpu_memory(device: torch.device) -> int:
    """Bytes this process can still fill on a GPU: its part of what the driver reports free
    plus what its caching allocator holds reserved but unallocated (free for this process,
    though the driver counts it as used)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free * _gpu_share) + cached


def release_memory(device: torch.device) -> None:
    """Free what unreachable objects hold (reference cycles included) and, on a GPU, hand
    the caching allocator's free blocks back. Call it outside ``except`` blocks: their
    traceback keeps the failed attempt's frames, and so its tensors, alive."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
