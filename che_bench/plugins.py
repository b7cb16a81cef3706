"""Plugins: modules outside che-bench that register encodings, tasks and models when imported.

A plugin is found in one of three ways: an installed distribution's entry point in the group
``che_bench.plugins`` (the entry point names the module), ``--plugin MODULE`` on the command
line, or ``CHE_BENCH_PLUGINS=mod1,mod2`` (a module named there is looked up on the Python path
and, as ``python -m`` does, in the current folder). ``load_configured`` imports all of them
once per process (the registries call it before their first look-up, so a sweep's spawned
workers and Ray workers load them too: ``--plugin`` modules are added to
``CHE_BENCH_PLUGINS``, which child processes inherit). ``--no-plugins`` (or
``CHE_BENCH_NO_PLUGINS=1``, which child processes inherit as well) loads none, so that a
broken installed plugin cannot block che-bench; stores holding plugin runs stay readable
(``che_bench.reports.unregistered``). Importing a plugin module runs its ``@register`` /
``@register_task`` / ``@register_model`` decorators; a module that fails to import, or
registers a name already taken, is a one-line CheBenchError naming the plugin.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

from che_bench.errors import CheBenchError, one_line

ENTRY_POINT_GROUP = "che_bench.plugins"
ENVIRONMENT_VARIABLE = "CHE_BENCH_PLUGINS"
DISABLE_VARIABLE = "CHE_BENCH_NO_PLUGINS"
#: How a plugin that fails to load is skipped (named in the error).
SKIP_HINT = f"--no-plugins or {DISABLE_VARIABLE}=1 starts che-bench without plugins"

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
    if _configured or disabled():
        return
    _configured = True
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution = entry_point.dist
        label = distribution.name if distribution is not None else entry_point.module
        version = distribution.version if distribution is not None else None
        _load(entry_point.module, label, version, hint=SKIP_HINT)
    for module_name in _environment_modules():
        _load(
            module_name,
            module_name,
            None,
            hint=f"it is named in {ENVIRONMENT_VARIABLE}; {SKIP_HINT}",
        )


def disabled() -> bool:
    """Whether plugins are switched off (``--no-plugins`` or ``CHE_BENCH_NO_PLUGINS=1``)."""
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def disable() -> None:
    """Load no plugin, in this process and in the child processes it starts."""
    os.environ[DISABLE_VARIABLE] = "1"


def add_modules(module_names: list[str]) -> None:
    """Load plugin modules named on the command line, and pass them on to child processes."""
    if module_names and disabled():
        raise CheBenchError(
            f"--plugin {module_names[0]} and --no-plugins ({DISABLE_VARIABLE}) "
            "contradict each other: give one of them"
        )
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
    """What a run records of the plugins it used (the origins of its task, encoding and
    model): ``{"plugin LABEL": version or "(module)"}``; nothing for che-bench's own names."""
    return {
        f"plugin {label}": _loaded.get(label) or "(module)"
        for label in origins
        if label is not None
    }


def _environment_modules() -> list[str]:
    text = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return [name.strip() for name in text.split(",") if name.strip()]


def _load(module_name: str, label: str, version: str | None, hint: str | None = None) -> None:
    """Import one plugin module; a failure is a one-line CheBenchError naming the plugin (and
    ``hint``: how to start without it)."""
    if module_name in _loaded_modules:
        return
    _loaded_modules.add(module_name)
    _loading.append(label)
    _search_current_folder()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything a foreign module raises is one line naming it
        raise CheBenchError(
            _failure(module_name, label, exc) + (f" ({hint})" if hint else "")
        ) from None
    finally:
        _loading.pop()
    _loaded[label] = version or getattr(module, "__version__", None)


def _search_current_folder() -> None:
    """Find plugin modules in the current folder, as ``python -m`` does (the ``che-bench``
    script itself only searches its own folder and the Python path). Appended, so that a file
    there never shadows an installed module."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def _failure(module_name: str, label: str, exc: Exception) -> str:
    if isinstance(exc, CheBenchError):
        return f"plugin {label}: {one_line(exc)}"
    if isinstance(exc, ModuleNotFoundError) and (module_name + ".").startswith(f"{exc.name}."):
        return (
            f"plugin {label} failed to import: no module {exc.name!r} in the current folder "
            "or on the Python path (a plugin must be importable: install it, or add its "
            "folder to PYTHONPATH)"
        )
    return f"plugin {label} failed to import: {type(exc).__name__}: {one_line(exc)}"
