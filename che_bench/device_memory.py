"""What a GPU has free for this process, and handing memory back after a failed attempt."""

from __future__ import annotations

import gc

import torch


#: Processes sharing this process's GPU (a sweep's workers): each plans for its part of the
#: memory the driver reports free, not all of it.
_processes_sharing_gpu = 1


def share_gpu_among(processes: int) -> None:
    """Declare that ``processes`` processes (this one included) share the GPU."""
    global _processes_sharing_gpu
    _processes_sharing_gpu = max(1, processes)


def free_gpu_memory(device: torch.device) -> int:
    """Bytes this process can still fill on a GPU: its part of what the driver reports free
    plus what its caching allocator holds reserved but unallocated (free for this process,
    though the driver counts it as used)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free // _processes_sharing_gpu + cached


def release_memory(device: torch.device) -> None:
    """Free what unreachable objects hold (reference cycles included) and, on a GPU, hand
    the caching allocator's free blocks back. Call it outside ``except`` blocks: their
    traceback keeps the failed attempt's frames, and so its tensors, alive."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
