"""The ``environment`` step of ``benchmarks/gpu_check.py``: the machine, the GPU and its
driver, CUDA, cuDNN, torch, Python, the commit and che-bench's dependencies. The standard
library only (torch and che-bench read where they import), so that it reports what is
missing instead of failing on it."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Needed beside che-bench's dependencies: the cuda tests run with pytest.
TOOLS = ("pytest",)


def _output(command: list[str]) -> str | None:
    """``command``'s standard output, stripped; None when it cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> str:
    """The checkout's commit, "+ changes" when its files differ from it."""
    commit = _output(["git", "rev-parse", "HEAD"])
    if commit is None:
        return "unknown (no git checkout here)"
    return commit + (" + changes" if _output(["git", "status", "--porcelain"]) else "")


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else platform.machine()


def _requirements() -> list[tuple[str, bool]]:
    """che-bench's dependencies (pyproject.toml) as (name, needed here): an environment marker
    that does not hold (tomli on Python >= 3.11) or cannot be read counts as not needed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return [(name, True) for name in ("torch", "numpy", "pandas", "rich", "matplotlib")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = []
    for requirement in project["dependencies"]:
        specifier, _, marker = requirement.partition(";")
        name = re.split(r"[<>=!~\[ ]", specifier.strip(), maxsplit=1)[0]
        requirements.append((name, not marker or _holds(marker)))
    return requirements


def _holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:
        return False
    return Marker(marker.strip()).evaluate()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def dependencies() -> dict[str, dict[str, Any]]:
    """Each dependency's installed version (None: missing) and whether it is needed here."""
    listed = [*_requirements(), *((tool, True) for tool in TOOLS)]
    return {name: {"version": _version(name), "needed": needed} for name, needed in listed}


def _driver() -> dict[str, Any]:
    """The GPU(s) and driver as ``nvidia-smi`` gives them (or the kernel module's file)."""
    query = "name,driver_version,memory.total"
    listed = _output(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"])
    if listed:
        gpus = [
            dict(zip(query.split(","), map(str.strip, line.split(",")), strict=False))
            for line in listed.splitlines()
        ]
        return {"nvidia_smi": gpus, "driver": gpus[0].get("driver_version")}
    try:
        version = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return {"nvidia_smi": None, "driver": None}
    return {"nvidia_smi": None, "driver": version}


def _torch(device: str) -> dict[str, Any]:
    """torch's build and, for a CUDA ``device``, the GPU as torch sees it."""
    try:
        import torch
    except ImportError as exc:
        return {"torch": None, "device_error": f"torch does not import: {exc}"}
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return {**facts, "device_error": "torch sees no CUDA GPU"}
        properties = torch.cuda.get_device_properties(torch.device(device).index or 0)
        facts.update(
            gpu=properties.name,
            gpu_memory_gib=round(properties.total_memory / 2**30, 1),
            compute_capability=f"{properties.major}.{properties.minor}",
            multiprocessors=properties.multi_processor_count,
        )
    return facts


def environment(
    device: str, rehearse: bool, timeout_s: float, record: Callable[[dict], None]
) -> dict[str, Any]:
    """What this check ran on; passed when every needed dependency imports and ``device``
    is there."""
    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "dependencies": dependencies(),
    }
    record(facts)
    facts.update(_driver())
    facts.update(_torch(device))
    try:
        facts["che_bench"] = importlib.import_module("che_bench").__version__
    except Exception as exc:  # a dependency of che_bench missing
        facts["che_bench_error"] = f"{type(exc).__name__}: {exc}"
    missing = [
        name
        for name, entry in facts["dependencies"].items()
        if entry["needed"] and entry["version"] is None
    ]
    facts["missing"] = missing
    facts["passed"] = not missing and "device_error" not in facts and "che_bench" in facts
    return facts
