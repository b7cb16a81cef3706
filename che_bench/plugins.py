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

import hashlib
import importlib
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

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
#: Plugin label -> the SHA-256 of its package's source when it was imported (``source_hash``).
_sources: dict[str, str | None] = {}
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
    # The configured plugins load before the command line's join the variable, so that a
    # module named with --plugin is not said to be named in it.
    load_configured()
    if module_names:
        named = [name for name in _environment_modules() if name not in module_names]
        os.environ[ENVIRONMENT_VARIABLE] = ",".join(named + module_names)
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


def provenance_of(*origins: str | None) -> dict[str, dict[str, Any]]:
    """What a run records of the plugins it used (the origins of its task, encoding and model;
    None: che-bench's own), beside the run and never in its id: ``{LABEL: {"version": the
    distribution's version or the module's ``__version__`` (None: neither), "source": the
    SHA-256 of its package's Python source as imported (``source_hash``)}}``."""
    return {
        label: {"version": _loaded.get(label), "source": _sources.get(label)}
        for label in dict.fromkeys(origins)
        if label is not None
    }


def source_hash(module_name: str) -> str | None:
    """The SHA-256 (hex) of the Python source of module ``module_name``: its file, or every
    ``.py`` file of its package by relative path; None when it has no source file. Any edit
    of the code (a comment included) changes it, whatever the version says."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return None
    if hasattr(module, "__path__"):
        root = Path(file).parent
        files = sorted(root.rglob("*.py"))
    else:
        root, files = Path(file).parent, [Path(file)]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def describe_provenance(provenance: dict[str, Any] | None) -> str:
    """``0.1.0 (source 1a2b3c4d5e6f)`` of one plugin's record; "none" for no record."""
    if not provenance:
        return "none"
    source = provenance.get("source")
    version = provenance.get("version") or "no version"
    return f"{version} (source {source[:12]})" if source else str(version)


def describe_plugins(used: dict[str, dict[str, Any]] | None) -> str:
    """``fox 0.1.0 (source 1a2b3c4d5e6f), ...`` of a run's plugins; "" for none."""
    return ", ".join(
        f"{label} {describe_provenance(record)}" for label, record in (used or {}).items()
    )


def provenance_changes(
    recorded: dict[str, dict[str, Any]], installed: dict[str, dict[str, Any]]
) -> list[str]:
    """How the plugins installed now differ from those a run recorded (both as
    ``provenance_of`` gives them): ``plugin LABEL recorded V (source H), installed V' (source
    H')`` for each plugin whose version differs, or whose source does where both were hashed;
    nothing when they agree."""
    changes = []
    for label in sorted(set(recorded) | set(installed)):
        was, now = recorded.get(label) or {}, installed.get(label) or {}
        hashed = bool(was.get("source")) and bool(now.get("source"))
        if (
            label not in recorded
            or label not in installed
            or was.get("version") != now.get("version")
            or (hashed and was.get("source") != now.get("source"))
        ):
            changes.append(
                f"plugin {label} recorded {describe_provenance(was)}, "
                f"installed {describe_provenance(now)}"
            )
    return changes


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
    _sources[label] = source_hash(module_name.split(".")[0])


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
