"""What a GPU has free for this process, and handing memory back after a failed attempt."""

from __future__ import annotations

import gc
from fractions import Fraction

import torch

#: The part of the memory the driver reports free that this process plans for: 1/N for one
#: of a sweep's N workers sharing a GPU, a Ray task's GPU fraction; all of it otherwise.
_gpu_share = Fraction(1)


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
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free * _gpu_share) + cached


def release_memory(device: torch.device) -> None:
    """Free what unreachable objects hold (reference cycles included) and, on a GPU, hand
    the caching allocator's free blocks back. Call it outside ``except`` blocks: their
    traceback keeps the failed attempt's frames, and so its tensors, alive."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
