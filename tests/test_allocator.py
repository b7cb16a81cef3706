"""glibc's allocator keeps freed memory for reuse (che_bench.allocator), unless the user chose."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from che_bench import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

#: 20 blocks of 40 MB, above glibc's largest automatic mmap threshold (32 MiB): by default
#: each is fresh pages from the kernel, faulted in as they are written.
FAULTS_OF_LARGE_BLOCKS = """
import contextlib, resource, sys
import torch
from che_bench.allocator import keep_freed_memory, large_blocks_returned
if sys.argv[1] != "default":
    assert keep_freed_memory()
torch.ones(10 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
returned = large_blocks_returned() if sys.argv[1] == "returned" else contextlib.nullcontext()
with returned:
    for _ in range(20):
        torch.ones(10 << 20)
during = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(10 << 20)
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(during - before, after - during)
"""


@pytest.mark.parametrize(
    "environment",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_ARENA_MAX": "2"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    ],
)
def test_an_allocator_the_user_chose_is_left_alone(environment, monkeypatch):
    assert allocator.allocator_chosen_by_user({"PATH": "/usr/bin", **environment})
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert allocator.keep_freed_memory() is False


def test_a_plain_environment_is_not_a_choice():
    assert not allocator.allocator_chosen_by_user({"PATH": "/usr/bin", "LD_PRELOAD": " "})
    assert not allocator.allocator_chosen_by_user({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})


def faults(mode: str) -> tuple[int, int]:
    """Page faults of 20 blocks of 40 MB allocated in turn, then of 20 more: ``mode`` is
    "default" (glibc's), "keep" (``keep_freed_memory``) or "returned" (the first 20 inside
    ``large_blocks_returned``)."""
    environment = {"PATH": "/usr/bin"}  # no MALLOC_* or LD_PRELOAD from the test's own
    result = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_LARGE_BLOCKS, mode],
        capture_output=True, text=True, check=True, env=environment,
    )
    during, after = result.stdout.split()[-2:]
    return int(during), int(after)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    # Page faults, not time: the count does not depend on the machine's load.
    default, kept = faults("default")[0], faults("keep")[0]
    assert default > 20 * 9_000  # each 40 MB block faulted in anew (10,240 pages)
    assert kept < default / 2


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_large_blocks_go_back_to_the_kernel_only_within_the_block():
    during, after = faults("returned")
    assert during > 20 * 9_000  # each block above 32 MiB mapped anew and unmapped on free
    assert after < during / 2  # kept on the heap again afterwards


def test_returning_large_blocks_changes_nothing_where_nothing_was_kept(monkeypatch):
    monkeypatch.setattr(allocator, "_kept_threshold", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: pytest.fail("mallopt called"))
    with allocator.large_blocks_returned():
        pass
