"""A CPU core's fp32 peak and DAPE's filter FLOPs, for the rates ``bench_model.py`` prints.

Three peaks, all for one core:

* ``nominal``: FMA units x fp32 lanes per unit x 2 FLOP x the clock ``/proc/cpuinfo`` reports
  (its first "cpu MHz"). Two FMA units; 16 lanes where torch runs AVX-512 kernels, except on
  AMD's Zen 4 (family 25), which executes a 512-bit FMA on 256-bit units (8 lanes), as it
  does without AVX-512. The reported clock is the nominal one: a core that boosts above it
  runs faster than this peak.
* ``matrix product``: the rate of a 1024 x 1024 x 1024 fp32 matrix product (MKL) on one
  thread, what a library's product reaches on this core (the best of 20, in CPU time, so
  that other jobs on the machine lower it less). On a core MKL is not tuned for (AMD's Zen 5)
  it stays well below the FMA units' rate.
* ``FMA loop``: the rate of independent chains of vector fused multiply-adds
  (``fma_peak.c``, compiled with ``che_bench.native_build`` for the target the native kernels
  are built for, its vectors as wide as that target's registers; best of 5 in CPU time): the
  core's fp32 peak at the clock it runs at, for the instructions the kernels use. Fractions of
  the peak are of this one; of the matrix product's without a C compiler.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from che_bench import native_build
from che_bench.cpu import CPUINFO, cpu_capability
from che_bench.model.dape.native import native_filter

FMA_SOURCE = Path(__file__).with_name("fma_peak.c")
#: ``--isa``: the environment each instruction set runs under (the libraries read it when they
#: start), and the CPU flags it needs. ``native``: the kernels built for this CPU, torch's,
#: MKL's and oneDNN's widest. ``avx2``: what a CPU without AVX-512 runs, all four capped.
ISA_ENVIRONMENTS = {
    "native": ({}, ()),
    "avx2": (
        {
            native_build.TARGET_VARIABLE: "x86-64-v3",
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
        },
        ("avx2", "fma"),
    ),
}


def run_at_isa(refuse: Callable[[str], object], isa: str) -> None:
    """Start this benchmark again with ``isa``'s environment (``ISA_ENVIRONMENTS``) unless it
    runs with it; ``refuse`` (the command line's error) a CPU without the instructions it
    needs."""
    environment, needs = ISA_ENVIRONMENTS[isa]
    if all(os.environ.get(name) == value for name, value in environment.items()):
        return
    lines = CPUINFO.read_text().splitlines() if CPUINFO.exists() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    if missing := [flag for flag in needs if flag not in flags]:
        refuse(f"--isa {isa} needs a CPU with {' and '.join(missing)}")
    os.environ.update(environment)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def instruction_sets() -> str:
    """A line naming what the native kernels were built for and torch's kernels' level."""
    kernel = native_filter()
    built = "none (DAPE's chunks filter)" if kernel is None else kernel.description
    return f"native kernels built by {built}; torch's kernels: {cpu_capability()}"


def _cpuinfo() -> dict[str, str]:
    """The first core's fields of /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def nominal_peak() -> tuple[float, str]:
    """(GFLOP/s, how it was derived) of one core, from /proc/cpuinfo and torch's capability."""
    info = _cpuinfo()
    mhz = float(info.get("cpu MHz", "nan"))
    wide = torch.backends.cpu.get_cpu_capability() == "AVX512"
    zen4 = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    lanes = 16 if wide and not zen4 else 8
    text = (f"2 FMA units x {lanes} fp32 lanes x 2 x {mhz:.0f} MHz "
            f"({info.get('model name', 'unknown CPU')}, {torch.backends.cpu.get_cpu_capability()})")
    return 2 * lanes * 2 * mhz / 1e3, text


def measured_peak(repeats: int = 20) -> float:
    """GFLOP/s of a 1024^3 fp32 matrix product on the current threads (best of ``repeats``,
    in CPU time per thread)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    out = torch.empty(1024, 1024)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        torch.mm(a, b, out=out)
        best = min(best, (time.process_time() - start) / torch.get_num_threads())
    return 2 * 1024**3 / best / 1e9


def fma_loop_peak(repeats: int = 5, iterations: int = 20_000_000) -> float | None:
    """GFLOP/s of ``fma_peak.c``'s chains of FMAs on this thread (best of ``repeats``, in CPU
    time), or None where no C compiler builds it."""
    try:
        built = native_build.build(FMA_SOURCE, _declare_fma)
    except native_build.NativeBuildError:
        return None
    if built is None:
        return None
    best = 0.0
    for _ in range(repeats):
        start = time.process_time()
        flops = built.library.fma_peak_flops(iterations)
        best = max(best, flops / max(time.process_time() - start, 1e-9) / 1e9)
    return best


def _declare_fma(library: ctypes.CDLL) -> None:
    library.fma_peak_flops.argtypes = [ctypes.c_long]
    library.fma_peak_flops.restype = ctypes.c_double


def dape_filter_flops(model: torch.nn.Module, batch: int, length: int, training: bool) -> float:
    """FLOPs of DAPE's filter f in one forward (x 3 with its backward when ``training``) of
    ``model`` on ``batch`` sequences of ``length`` tokens, as che-bench computes it: two
    ``1 x k`` convolutions over every score, ``2 k (H D + D H)`` per score and layer for the
    score channels, plus ``2 k C_b D`` per (query, key) and layer for the bias channels, which
    are the same for every sequence and pass the first convolution once per batch (f as
    defined counts them for every sequence: 2 k (2H D + D H) per score). 0 without DAPE."""
    total = 0.0
    for module in model.modules():
        weight1, weight2 = getattr(module, "weight1", None), getattr(module, "weight2", None)
        if weight1 is None or weight2 is None or not hasattr(module, "kernel"):
            continue
        members, width, channels, kernel = weight1.shape
        heads = weight2.shape[1]
        per_score = 2 * kernel * (heads * width + width * heads)
        per_position = 2 * kernel * (channels - heads) * width
        total += members * length * length * (batch * per_score + per_position)
    return total * (3 if training else 1)
