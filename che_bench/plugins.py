"""Plugins: modules outside che-bench that register encodings and tasks when imported.

A plugin is found in one of three ways: an installed distribution's entry point in the group
``che_bench.plugins`` (the entry point names the module), ``--plugin MODULE`` on the command
line, or ``CHE_BENCH_PLUGINS=mod1,mod2``. ``load_configured`` imports all of them once per
process (the registries call it before their first look-up, so a sweep's spawned workers
and Ray workers load them too: ``--plugin`` modules are added to ``CHE_BENCH_PLUGINS``, which
child processes inherit). Importing a plugin module runs its ``@register`` /
``@register_task`` decorators; a module that fails to import, or registers a name already
taken, is a one-line CheBenchError naming the plugin.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

from che_bench.errors import CheBenchError

ENTRY_POINT_GROUP = "che_bench.plugins"
ENVIRONMENT_VARIABLE = "CHE_BENCH_PLUGINS"

#: Plugin label (distribution name, or module name when not installed) -> version (None when
#: the module has no ``__version__``), in loading order.
_loaded: dict[str, str | None] = {}
_loaded_modules: set[str] = set()
_loading: list[str] = []  # the plugin being imported (a stack: a plugin may import another)
_configured = False


def loading_plugin() -> str | None:
    """The plugin whose import is running now (None: che-bench's own registrations)."""
    return _loading[-1] if _loading else None


def load_configured() -> None:
    """Import the entry-point plugins and the ``CHE_BENCH_PLUGINS`` modules (once)."""
    global _configured
    if _configured:
        return
    _configured = True
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution = entry_point.dist
        label = distribution.name if distribution is not None else entry_point.module
        version = distribution.version if distribution is not None else None
        _load(entry_point.module, label, version)
    for module_name in _environment_modules():
        _load(module_name, module_name, None)


def add_modules(module_names: list[str]) -> None:
    """Load plugin modules named on the command line, and pass them on to child processes."""
    if module_names:
        named = [name for name in _environment_modules() if name not in module_names]
        os.environ[ENVIRONMENT_VARIABLE] = ",".join(named + module_names)
    load_configured()
    for module_name in module_names:
        _load(module_name, module_name, None)


def loaded() -> dict[str, str | None]:
    """Every plugin loaded so far: label -> version."""
    return dict(_loaded)


def versions_of(*origins: str | None) -> dict[str, str]:
    """What a run records of the plugins it used (the origins of its task and encoding):
    ``{"plugin LABEL": version or "(module)"}``; nothing for che-bench's own names."""
    return {f"plugin {label}": _loaded.get(label) or "(module)"
            for label in origins if label is not None}


def _environment_modules() -> list[str]:
    text = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return [name.strip() for name in text.split(",") if name.strip()]


def _load(module_name: str, label: str, version: str | None) -> None:
    if module_name in _loaded_modules:
        return
    _loaded_modules.add(module_name)
    _loading.append(label)
    try:
        module = importlib.import_module(module_name)
    except CheBenchError as exc:
        raise CheBenchError(f"plugin {label}: {exc}") from None
    except Exception as exc:  # anything a foreign module raises is one line naming it
        cause = str(exc).splitlines()[0] if str(exc) else ""
        raise CheBenchError(f"plugin {label} failed to import: {type(exc).__name__}: {cause}") from None
    finally:
        _loading.pop()
    _loaded[label] = version or getattr(module, "__version__", None)
