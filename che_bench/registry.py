"""One registry class for everything che-bench looks up by name (tasks, encodings).

Built-ins and plugins register the same way; a registry remembers which plugin registered
each name (``origin``), refuses a name that is already taken and suggests close names for an
unknown one. Before the first look-up it loads the configured plugins
(``che_bench.plugins.load_configured``), so every process, a sweep's workers included, sees
the same names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from che_bench.errors import CheBenchError, one_line

Registered = TypeVar("Registered")


def normalise_name(name: str) -> str:
    """Lower case, every run of other characters one "_" ("Even Pairs" -> "even_pairs")."""
    return re.sub(r"[^a-z0-9]+", "_", str(name).strip().lower()).strip("_")


class Registry(Generic[Registered]):
    """Names (plus aliases) -> registered classes, in registration order."""

    def __init__(self, kind: str, normalise: Callable[[str], str] = normalise_name) -> None:
        self.kind = kind
        self._normalise = normalise
        self._entries: dict[str, Registered] = {}
        self._aliases: dict[str, str] = {}
        self._origins: dict[str, str | None] = {}

    def add(
        self,
        name: str,
        entry: Registered,
        aliases: tuple[str, ...] = (),
        *,
        module: str | None = None,
    ) -> None:
        """Register ``entry`` under ``name`` and ``aliases``; a taken name is a CheBenchError.
        ``module`` is the module that defines ``entry`` (default: ``entry.__module__``): a
        name defined in che-bench's own modules is che-bench's, even when a plugin's import is
        what first imported that module."""
        from che_bench.plugins import loading_plugin

        keys = [self._normalise(key) for key in (name, *aliases)]
        for key in keys:
            if key in self._entries or key in self._aliases:
                owner = self._origins[self._aliases.get(key, key)] or "che-bench"
                raise CheBenchError(f"{self.kind} name {key!r} is already registered by {owner}")
        self._entries[keys[0]] = entry
        defined_in = module if module is not None else getattr(entry, "__module__", "")
        own = defined_in == "che_bench" or str(defined_in).startswith("che_bench.")
        self._origins[keys[0]] = None if own else loading_plugin()
        self._aliases.update({alias: keys[0] for alias in keys[1:]})

    def canonical(self, name: str) -> str:
        """The registered name for ``name`` or one of its aliases; a CheBenchError naming the
        closest names when there is none."""
        _load_plugins()
        key = self._normalise(name)
        key = self._aliases.get(key, key)
        if key in self._entries:
            return key
        close = difflib.get_close_matches(key, [*self._entries, *self._aliases], n=4, cutoff=0.6)
        suggestions = list(dict.fromkeys(self._aliases.get(match, match) for match in close))[:3]
        hint = f"; did you mean {' or '.join(map(repr, suggestions))}?" if suggestions else ""
        raise CheBenchError(
            f"unknown {self.kind} {name!r}{hint} (valid: {', '.join(self._entries)}; "
            f"{plugin_hint()})"
        )

    def get(self, name: str) -> Registered:
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        """Registered names, in registration order (built-ins first)."""
        _load_plugins()
        return list(self._entries)

    def instantiate(self, cls: type, **arguments: Any) -> Any:
        """``cls(**arguments)`` of a registered class. A plain ValueError it raises (how a
        plugin may refuse an option or parameter) is a one-line CheBenchError naming it, like
        the CheBenchError that che-bench's own classes raise."""
        try:
            return cls(**arguments)
        except CheBenchError:
            raise
        except ValueError as exc:
            name = getattr(cls, "name", cls.__name__)
            raise CheBenchError(f"{self.kind} {name!r}: {one_line(exc)}") from None

    def origin(self, name: str) -> str | None:
        """The plugin that registered ``name`` (None: che-bench itself)."""
        return self._origins[self.canonical(name)]

    def source(self, name: str) -> str:
        """Where ``name`` comes from, as listings say it: ``che-bench`` or ``plugin LABEL``."""
        origin = self.origin(name)
        return f"plugin {origin}" if origin else "che-bench"


def plugin_hint() -> str:
    """How to make a plugin's names known (or why they are not: plugins switched off)."""
    from che_bench.plugins import DISABLE_VARIABLE, disabled

    if disabled():
        return f"plugins are switched off: --no-plugins or {DISABLE_VARIABLE}"
    return "a plugin's names need the plugin installed, or --plugin MODULE"


def _load_plugins() -> None:
    from che_bench.plugins import load_configured

    load_configured()
