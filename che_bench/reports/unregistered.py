"""Stored runs of tasks, encodings and models that this process does not know (the plugin
that registered them is not loaded: not installed here, or ``--no-plugins``).

Tables and reports never refuse such a store: they show these runs from what the store
recorded (names, parameters, scores, the plugin's name in the run's versions), with a note
saying what could not be looked up (a task's level and chance).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from che_bench.config import TRANSFORMER
from che_bench.errors import CheBenchError

#: The level shown for a task whose class is not loaded (the store does not record it).
UNKNOWN_LEVEL = "?"


def task_known(name: str) -> bool:
    from che_bench.tasks import TASKS

    return name in TASKS.names()


def encoding_known(name: str) -> bool:
    from che_bench.encodings.base import ENCODINGS

    return name in ENCODINGS.names()


def architecture_known(name: str) -> bool:
    from che_bench.model.architectures import ARCHITECTURES

    return name in ARCHITECTURES.names()


def recorded_task_label(name: str, params: dict[str, Any]) -> str:
    """A table label from the recorded parameters alone (every one is named: without the
    task class, which of them are its defaults is unknown)."""
    if not params:
        return name
    return f"{name}({', '.join(f'{key}={value}' for key, value in sorted(params.items()))})"


def task_names(wanted: Iterable[str], stored: Iterable[str]) -> set[str]:
    """The registered names of ``wanted`` tasks (aliases resolved); a name that only the store
    knows is kept as it is, and any other unknown one is the registry's CheBenchError."""
    from che_bench.registry import normalise_name
    from che_bench.tasks import get_task

    stored = set(stored)
    return {
        normalise_name(name) if normalise_name(name) in stored else get_task(name).name
        for name in wanted
    }


def note(runs: pd.DataFrame) -> str | None:
    """The table note naming the runs' tasks, encodings and models (architectures) that are
    not registered here and the plugins the runs recorded using; None when every one is
    known."""
    tasks = sorted(name for name in set(runs["task"]) if not task_known(name))
    encodings = sorted(name for name in set(runs["pe"]) if not encoding_known(name))
    run_archs = pd.Series(
        [str(json.loads(config).get("arch", TRANSFORMER)) for config in runs["config"]],
        index=runs.index,
        dtype=object,
    )
    archs = sorted(name for name in set(run_archs) if not architecture_known(name))
    if not tasks and not encodings and not archs:
        return None
    unknown = runs[runs["task"].isin(tasks) | runs["pe"].isin(encodings) | run_archs.isin(archs)]
    plugins = sorted(
        {
            key.removeprefix("plugin ")
            for text in unknown["versions"]
            for key in json.loads(text or "{}")
            if key.startswith("plugin ")
        }
    )
    names = (
        [f"task {name}" for name in tasks]
        + [f"encoding {name}" for name in encodings]
        + [f"architecture {name}" for name in archs]
    )
    source = f"plugin {', '.join(plugins)}" if plugins else "a plugin"
    level = (
        f"; level {UNKNOWN_LEVEL} and chance unknown (the task class is needed)" if tasks else ""
    )
    return (
        f"not registered here ({source} not loaded): {', '.join(names)}; shown as the "
        f"store recorded them{level}"
    )


def require_registered(
    run_id: str, config: Mapping[str, Any], plugins: dict[str, Any] | None
) -> None:
    """A one-line CheBenchError when the task, encoding or model of run ``run_id`` (its
    stored ``config``) is not registered here, naming the plugins the run recorded
    (``plugins``: ``ResultStore.run_plugins``' entry, with their versions)."""
    from che_bench.plugins import describe_plugins
    from che_bench.registry import plugin_hint

    arch = str(config.get("arch", TRANSFORMER))
    unknown = [f"task {config['task']}"] if not task_known(config["task"]) else []
    if arch == TRANSFORMER and not encoding_known(config["pe"]):
        unknown.append(f"encoding {config['pe']}")
    if not architecture_known(arch):
        unknown.append(f"architecture {arch}")
    if not unknown:
        return
    many = "s" if plugins and len(plugins) > 1 else ""
    source = f"plugin{many} {describe_plugins(plugins)}" if plugins else "a plugin (none recorded)"
    raise CheBenchError(
        f"run {run_id} was made with {source}, which is not loaded here: {', '.join(unknown)} "
        f"unknown ({plugin_hint()})"
    )
