"""The device a run computes on: choosing and describing it, and the numerics it is set to
(TF32, deterministic algorithms, cuBLAS's workspace)."""

from __future__ import annotations

import os
from typing import Any

import torch

from che_bench.cpu import check_portable_cpu
from che_bench.errors import CheBenchError


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is a CheBenchError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise CheBenchError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise CheBenchError("device cuda requested but torch sees no CUDA GPU")
    if resolved.type not in ("cpu", "cuda"):
        raise CheBenchError(f"unsupported device {device!r}; use auto, cpu or cuda[:N]")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise CheBenchError(
            f"device {device!r} does not exist: torch sees "
            f"{torch.cuda.device_count()} CUDA GPU(s), cuda:0.."
        )
    return resolved


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'' if threads == 1 else 's'})"


#: cuBLAS's reproducible workspace setting (read when cuBLAS starts, so set before any product).
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def prepare_deterministic_cublas() -> None:
    """Set cuBLAS's reproducible workspace (unless set already). cuBLAS reads it once, when it
    starts in the process, so a process that may compute deterministically calls this before
    any CUDA work (a ``--pack auto`` probe, the self-test's first checks)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)


def configure_numerics(tf32: bool, deterministic: bool = False, portable_cpu: bool = False) -> None:
    """TF32 in GPU matrix products and convolutions only when asked for (cuDNN's own
    default is on, which would make convolution results differ from CPU ones).

    ``deterministic``: torch's deterministic algorithms (``gather`` / ``index_put``
    backward by sorting instead of atomic adds; an error for an op that has none), cuDNN's
    deterministic convolutions without autotuning, cuBLAS's fixed workspace, and no flash or
    cuDNN attention kernels, whose backward adds atomically (memory-efficient attention
    follows the deterministic flag; so does the math path). Off again when not asked for,
    so one process can run both kinds. The backend flags act on CUDA only, so they are set
    on any device.

    ``portable_cpu``: the portable CPU mode (``che_bench.cpu``), refused unless its environment
    took effect; it also turns oneDNN off in torch (its kernels block by the CPU's cache sizes),
    so torch's own kernels and MKL compute what oneDNN would. On again when not asked for.
    """
    if portable_cpu:
        check_portable_cpu()
    torch.backends.mkldnn.enabled = not portable_cpu  # type: ignore[assignment]  # (a property)
    torch.use_deterministic_algorithms(deterministic)
    if deterministic:
        prepare_deterministic_cublas()  # in time only before any CUDA work: see the callers
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(not deterministic)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):  # torch >= 2.3
        torch.backends.cuda.enable_cudnn_sdp(not deterministic)


def numerics_details(
    device: torch.device, tf32: bool, deterministic: bool, portable_cpu: bool = False
) -> dict[str, Any]:
    """The numerics settings recorded with a run (in its details, never in its id): TF32 on a
    GPU, deterministic mode wherever it was asked for, the portable CPU mode where it ran."""
    details: dict[str, Any] = {"tf32": tf32} if device.type == "cuda" else {}
    if deterministic or device.type == "cuda":
        details["deterministic"] = deterministic
    if portable_cpu:
        details["portable_cpu"] = True
    return details


def check_portable_device(device: torch.device, portable_cpu: bool) -> None:
    """The portable CPU mode is for runs on a CPU: a GPU's numbers depend on the GPU."""
    if portable_cpu and device.type != "cpu":
        raise CheBenchError(
            f"--portable-cpu is for runs on a CPU, and these would run on {device}: "
            "add --device cpu, or leave --portable-cpu out"
        )
