"""glibc's allocator kept from handing large freed blocks back to the kernel, in the processes
that train and evaluate (``che-bench``, sweep workers, Ray tasks).

By default glibc serves each allocation above its mmap threshold (at most 32 MiB, adjusted as
blocks are freed) with fresh pages from the kernel and returns them on free, and trims freed
memory at the heap's top: torch's CPU tensors of a few MB, allocated and freed at every step,
then fault in zeroed pages again each time. Mamba's and the delta-rule models' training steps
at batch 256 took 49,000-89,000 page faults and 86-180 ms of system time (of 1.1-1.6 s) that
way, and 1,000-3,500 faults and 2-7 ms with both thresholds at 1 GiB (docs/benchmarks.md, "Memory
allocation"). Which memory a tensor gets changes no arithmetic, so no result changes; the
process keeps up to its peak resident memory until it exits.

An evaluation under a memory budget (long lengths, in chunks) is the exception: its score maps
of tens to hundreds of MB, kept on the heap at sizes that change from chunk to chunk, fragment
it, and PaTH's and stick-breaking's evaluations at n = 500 then took 1.2-4.5 GiB where their
tensors never held more than 0.7 GiB. ``large_blocks_returned`` hands blocks above 32 MiB back
to the kernel for its duration (docs/benchmarks.md, "Memory allocation").

Nothing is changed where the user chose an allocator or its settings: ``MALLOC_*`` variables,
a ``glibc.malloc`` tunable, or an allocator in ``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

#: ``mallopt``'s parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Freed memory up to this much is kept for reuse; a larger block still comes from mmap.
KEEP_BYTES = 1 << 30
#: glibc's documented upper limit of the mmap threshold on 64-bit systems (some versions
#: refuse more).
MMAP_THRESHOLD_MAX = 32 << 20

#: The mmap threshold ``keep_freed_memory`` set in this process (None: it set none).
_kept_threshold: int | None = None


def allocator_chosen_by_user(environment: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment sets glibc's malloc or preloads another allocator."""
    if any(name.startswith("MALLOC_") for name in environment):
        return True
    return "glibc.malloc" in environment.get("GLIBC_TUNABLES", "") or bool(
        environment.get("LD_PRELOAD", "").strip()
    )


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (module docstring); False where
    nothing was changed (not glibc, or an allocator chosen by the user)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if allocator_chosen_by_user():
        return False
    global _kept_threshold
    mallopt = _mallopt()
    # The mmap threshold first: the trim threshold alone would turn off glibc's adjustment of
    # the mmap threshold and leave it at 128 KiB, which faults far more.
    for threshold in (KEEP_BYTES, MMAP_THRESHOLD_MAX):
        if mallopt(M_MMAP_THRESHOLD, threshold):
            _kept_threshold = threshold
            return bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    return False


@contextmanager
def large_blocks_returned() -> Iterator[None]:
    """Within the block, allocations above 32 MiB come from and go back to the kernel, as by
    glibc's default, where ``keep_freed_memory`` had kept them on the heap (module docstring);
    elsewhere nothing changes."""
    kept = _kept_threshold
    if kept is None or kept <= MMAP_THRESHOLD_MAX:
        yield
        return
    mallopt = _mallopt()
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, kept)


@functools.cache
def _mallopt():
    """libc's ``mallopt``, looked up once (``find_library`` reads the linker's cache)."""
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
