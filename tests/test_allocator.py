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
import resource, sys
import torch
from che_bench.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.ones(10 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(10 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
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


def faults(mode: str) -> int:
    environment = {"PATH": "/usr/bin"}  # no MALLOC_* or LD_PRELOAD from the test's own
    result = subprocess.run(
        [sys.executable, "-c", FAULTS_OF_LARGE_BLOCKS, mode],
        capture_output=True, text=True, check=True, env=environment,
    )
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    # Page faults, not time: the count does not depend on the machine's load.
    default, kept = faults("default"), faults("keep")
    assert default > 20 * 9_000  # each 40 MB block faulted in anew (10,240 pages)
    assert kept < default / 2
