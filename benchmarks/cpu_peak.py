"""A CPU core's fp32 peak and DAPE's filter FLOPs, for the rates ``bench_model.py`` prints.

Two peaks, both for one core:

* ``nominal``: FMA units x fp32 lanes per unit x 2 FLOP x the clock ``/proc/cpuinfo`` reports
  (its first "cpu MHz"). Two FMA units; 16 lanes where torch runs AVX-512 kernels, except on
  AMD's Zen 4 (family 25), which executes a 512-bit FMA on 256-bit units (8 lanes), as it
  does without AVX-512. The reported clock is the nominal one: a core that boosts above it
  runs faster than this peak.
* ``measured``: the rate of a 1024 x 1024 x 1024 fp32 matrix product (MKL) on one thread,
  the best rate a matrix product reaches on this core in practice (the best of 20, in CPU
  time, so that other jobs on the machine lower it less).
"""

from __future__ import annotations

import time

import torch


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
