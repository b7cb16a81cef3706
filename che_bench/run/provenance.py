"""What a run used: its software (versions, CPU, the kernels that ran on its device) and the
plugins that registered its task, encoding and model."""

from __future__ import annotations

import platform
import sys

import numpy as np
import torch

import che_bench
from che_bench import plugins
from che_bench.config import RunConfig
from che_bench.cpu import cpu_facts
from che_bench.model.architectures import native_kernels


def software_versions(
    config: RunConfig | None = None, device: torch.device | None = None
) -> dict[str, str]:
    """The software a run used: che-bench, torch, numpy, Python, the platform and the plugins
    that registered ``config``'s task, encoding or model (``plugin NAME``: version); the
    CPU it ran on (``cpu``, ``cpu_capability``: ``che_bench.cpu.cpu_facts``); and, given the
    ``device`` it ran on, how its DAPE filter and the kernels its model may compile run
    there (``architectures.native_kernels``; a kernel is compiled for a CPU only)."""
    used = {} if config is None else plugins.versions_of(*plugin_origins(config))
    return {
        "che_bench": che_bench.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        **cpu_facts(),
        **(
            {}
            if config is None or device is None
            else native_kernels(config.arch, config.arch_options, config.kernel, device)
        ),
        **used,
    }


def plugin_origins(config: RunConfig) -> tuple[str | None, str | None, str | None]:
    """The plugins that registered ``config``'s task, encoding and model (None: che-bench)."""
    from che_bench.encodings.base import ENCODINGS
    from che_bench.model.architectures import ARCHITECTURES
    from che_bench.tasks import TASKS

    return (
        TASKS.origin(config.task),
        ENCODINGS.origin(config.pe),
        ARCHITECTURES.origin(config.arch),
    )
