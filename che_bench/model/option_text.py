"""How a run's architecture options are shown (run headers, sweep lines, table columns, the
listing of runs): the options that differ from the architecture's defaults, as
``key=value`` with JSON values (``negative_eigenvalues=true``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def changed_options(arch: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``options`` of ``arch`` that differ from its defaults, by name; all of them when
    ``arch`` is not registered here (a plugin not loaded: its defaults are unknown)."""
    from che_bench.model.architectures import ARCHITECTURES

    options = dict(options or {})
    if arch not in ARCHITECTURES.names():
        return dict(sorted(options.items()))
    defaults = ARCHITECTURES.get(arch).defaults
    return {
        key: value
        for key, value in sorted(options.items())
        if key not in defaults or defaults[key] != value
    }


def options_text(options: Mapping[str, Any], separator: str = ", ") -> str:
    """``key=value`` for each option (strings bare, other values as JSON), joined."""
    return separator.join(
        f"{key}={value if isinstance(value, str) else json.dumps(value, sort_keys=True)}"
        for key, value in options.items()
    )
