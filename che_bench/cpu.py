"""The CPU a run computes on: its model and torch's instruction-set level (recorded with every
run), and the portable CPU mode (``--portable-cpu``), which caps the instruction sets the
numerical libraries may use so that a run's numbers should not depend on the CPU model.

Without the mode the libraries pick their kernels by CPU: torch's own kernels by the widest
vector instructions the CPU has (AVX-512 or AVX2), MKL's matrix products by vendor and model,
oneDNN (a one-member LSTM's fused evaluation) by instruction set and cache sizes. The kernels
sum in different orders, so the same run differs in its last bits from one CPU model to
another, and training amplifies that (see docs/protocol.md, "Determinism"). The mode's
settings are read when the libraries start, so they go into the environment of the process
before torch is imported: ``che-bench`` does that when its arguments hold ``--portable-cpu``
(``cli.main``), and sweep workers inherit the environment (Ray tasks get it as their runtime
environment). This module imports torch only inside the functions that read it.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path

from che_bench.errors import CheBenchError

#: The switch of DAPE's native filter (``che_bench.model.dape.native``), compiled for this
#: CPU's instruction sets; "0" keeps the ``chunks`` filter.
NATIVE_FILTER_SWITCH = "CHE_BENCH_NATIVE_FILTER"
#: The switch of the delta rule's native kernel (``che_bench.model.state_tracking.
#: delta_rule_native``), compiled likewise; "0" keeps the chunkwise form.
NATIVE_DELTA_RULE_SWITCH = "CHE_BENCH_NATIVE_DELTA_RULE"
#: The environment of the portable mode. torch's own kernels: the AVX2 build on every CPU (not
#: AVX-512 where there is one). MKL: its COMPATIBLE branch, the only conditional-reproducibility
#: branch MKL runs on both Intel and AMD CPUs (it ignores its AVX2 branch on AMD CPUs and falls
#: back to AUTO without a warning). oneDNN: capped at AVX2 (the mode also turns oneDNN off in
#: torch, ``che_bench.run.device.configure_numerics``: its kernels block by cache size). DAPE's
#: native filter and the delta rule's native kernel: off (compiled with ``-march=native``).
PORTABLE_ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    NATIVE_FILTER_SWITCH: "0",
    NATIVE_DELTA_RULE_SWITCH: "0",
}
#: torch's CPU capability under the mode.
PORTABLE_CAPABILITY = "AVX2"
#: What a run records for a fact it could not read (and reports show for runs stored before
#: the CPU was recorded).
UNKNOWN = "unknown"


#: Where Linux describes the CPU.
CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name: ``cpuinfo``'s first "model name" (Linux), else
    ``platform.processor()``, else "unknown"."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip() or UNKNOWN
    except OSError:
        pass
    return platform.processor() or UNKNOWN


def cpu_description(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name with what tells CPUs of one name apart: its family and model
    numbers and its widest vector instructions (``cpuinfo``'s first processor; the model
    name alone where Linux does not describe it)."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's description ends at its blank line
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    vectors = next(
        (name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags),
        None,
    )
    facts = [
        f"family {fields['cpu family']}, model {fields['model']}"
        if "cpu family" in fields and "model" in fields
        else None,
        vectors,
    ]
    known = [fact for fact in facts if fact]
    return cpu_model(cpuinfo) + (f" ({'; '.join(known)})" if known else "")


def cpu_capability() -> str:
    """The instruction set torch's own CPU kernels use in this process (``DEFAULT``,
    ``AVX2``, ``AVX512``, ...)."""
    import torch

    getter = getattr(torch.backends.cpu, "get_cpu_capability", None)  # torch >= 2.1
    return str(getter()) if getter is not None else UNKNOWN


def cpu_facts() -> dict[str, str]:
    """What a run records about its CPU: ``cpu`` (the model) and ``cpu_capability``."""
    return {"cpu": cpu_model(), "cpu_capability": cpu_capability()}


def set_portable_environment(environment: MutableMapping[str, str] | None = None) -> None:
    """Put the portable mode's settings into ``environment`` (default: this process's, for
    torch to read when it is imported and for the processes it starts)."""
    (os.environ if environment is None else environment).update(PORTABLE_ENVIRONMENT)


def check_portable_cpu() -> None:
    """Refuse to run in the portable mode unless its settings took effect: they are in the
    environment and torch's kernels run at ``PORTABLE_CAPABILITY``."""
    missing = [f"{k}={v}" for k, v in PORTABLE_ENVIRONMENT.items() if os.environ.get(k) != v]
    if missing:
        raise CheBenchError(
            "--portable-cpu needs its settings in the environment before torch starts: "
            f"set {' '.join(missing)} (the che-bench command does so itself)"
        )
    capability = cpu_capability()
    if capability != PORTABLE_CAPABILITY:
        raise CheBenchError(
            f"--portable-cpu needs torch's {PORTABLE_CAPABILITY} kernels, but they run at "
            f"{capability} (torch was imported before the settings were made, or this CPU "
            "lacks AVX2)"
        )
