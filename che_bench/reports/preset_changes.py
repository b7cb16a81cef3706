"""What stored runs changed from their preset: the settings a suite's ``[overrides]`` or a
run's flags set, which the table's note names beside the preset (``preset(s): quick with
steps = 400``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from typing import Any

from che_bench.config import OMITTED_AT_DEFAULT, RunConfig, make_config
from che_bench.errors import CheBenchError
from che_bench.protocol import format_lengths

#: What varies within a table cell by design (its max is over seeds and learning rates).
CELL_FIELDS = frozenset({"seed", "data_seed", "lr"})
#: What the table's rows and columns already name: kept as the run has them.
NAMED_FIELDS = ("arch", "arch_options", "task_params", "pe_options")


def preset_changes(configs: Iterable[str]) -> str:
    """`` with NAME = VALUE, ...``: each setting where runs (their stored configs, JSON) differ
    from their preset, with every value they give it; "" when none does."""
    values: dict[str, set[str]] = {}
    for text in set(configs):
        for name, value in _changes(text):
            values.setdefault(name, set()).add(value)
    changes = ", ".join(f"{name} = {' / '.join(sorted(values[name]))}" for name in values)
    return f" with {changes}" if changes else ""


def changes_from_preset(config: RunConfig) -> tuple[tuple[str, str], ...]:
    """The (name, value as a suite spells it) of each setting ``config`` changes from its
    preset, besides seeds and learning rates."""
    return _changes(json.dumps(config.to_dict(), sort_keys=True))


def stored_changes(config: str) -> tuple[tuple[str, str], ...]:
    """``changes_from_preset`` of a stored config (JSON)."""
    return _changes(json.dumps(json.loads(config), sort_keys=True))


@cache
def _changes(text: str) -> tuple[tuple[str, str], ...]:
    """The (name, value) of each field where the stored config ``text`` differs from its
    preset; none for a run today's che-bench cannot rebuild (a plugin not installed)."""
    config = json.loads(text)
    try:
        at_preset = make_config(
            config["task"],
            config.get("pe"),
            config.get("kernel"),
            config["preset"],
            # (empty ones left out: another architecture refuses even empty pe_options)
            **{name: config[name] for name in NAMED_FIELDS if config.get(name)},
        ).to_dict()
    except (CheBenchError, KeyError, TypeError):
        return ()
    # (a field at its default is left out of a config: OMITTED_AT_DEFAULT gives it back)
    at_preset = {**OMITTED_AT_DEFAULT, **at_preset}
    return tuple(
        (name, _value_text(value))
        for name, value in config.items()
        if name not in CELL_FIELDS and name in at_preset and at_preset[name] != value
    )


def _value_text(value: Any) -> str:
    """A value as a suite file spells it; a length list as the lengths' range."""
    if isinstance(value, list) and value and all(isinstance(n, int) for n in value):
        return format_lengths(value)
    return json.dumps(value)
