"""How runs execute, as one typed object: ``RuntimeOptions``.

Built once, from a command's flags (``che_bench.commands.common.runtime_options_from_args``)
or a Python call (``execute_run(config, device="cpu", ...)``), and handed down unchanged to
the backends, the runner, training and the trackers; it is picklable, so it travels to sweep
worker processes and Ray tasks as it is. None of it enters a run id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from che_bench.run.trackers import TrackerOptions
from che_bench.settings import BY_NAME
from che_bench.train.history import DEFAULT_LOG_EVERY

#: How often (in steps) training saves a checkpoint when it has a checkpoint directory.
DEFAULT_CHECKPOINT_EVERY = 1000
#: torch CPU threads of a run where ``--threads`` is not given (a run, a local sweep's
#: workers): these models are small, and on a busy 2-core machine a second thread made a
#: sweep's runs 20x slower (docs/usage.md).
DEFAULT_THREADS = 1


@dataclass(frozen=True)
class RuntimeOptions:
    """``device``, ``threads``, ``tf32``, ``deterministic``, ``portable_cpu`` and ``log_every``
    are the runtime settings of ``che_bench.settings`` (checked by their validators here,
    whoever builds the object); ``threads=None`` leaves the thread count to whoever runs the
    runs (``DEFAULT_THREADS`` in this process and in a local sweep's workers, the granted CPUs
    in a Ray task).
    ``trackers``: TensorBoard / W&B logging. ``progress``: progress bars. With
    ``checkpoint_dir`` runs checkpoint every ``checkpoint_every`` steps and resume; with
    ``models_dir`` completed runs keep their weights there."""

    device: str = "auto"
    threads: int | None = None
    tf32: bool = False
    deterministic: bool = False
    portable_cpu: bool = False
    log_every: int = DEFAULT_LOG_EVERY
    trackers: TrackerOptions | None = None
    progress: bool = True
    checkpoint_dir: str | Path | None = None
    models_dir: str | Path | None = None
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY

    def __post_init__(self) -> None:
        for name in ("threads", "log_every"):
            object.__setattr__(self, name, BY_NAME[name].validate(getattr(self, name)))

    def with_changes(self, **changes: Any) -> RuntimeOptions:
        """A copy with ``changes`` (field names; an unknown one is a TypeError)."""
        return dataclasses.replace(self, **changes) if changes else self


def runtime_options(options: RuntimeOptions | None, changes: dict[str, Any]) -> RuntimeOptions:
    """``options`` (default: all defaults) with the keyword ``changes`` of a Python call."""
    return (options or RuntimeOptions()).with_changes(**changes)
