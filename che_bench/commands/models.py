"""``che-bench models``: the registered architectures, their options and presets."""

from __future__ import annotations

import argparse
import json

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="list the architectures (--arch), their options and presets"
    )
    parser.set_defaults(handler=handler)


def handler(args: argparse.Namespace) -> int:
    from che_bench.model.architectures import ARCHITECTURES

    table = Table(title="che-bench architectures (--arch)", box=box.SIMPLE_HEAD)
    for column in ("architecture", "label", "options (--arch-option)", "presets", "description"):
        table.add_column(column, no_wrap=column in ("architecture", "label"))
    for name in ARCHITECTURES.names():
        entry = ARCHITECTURES.get(name)
        origin = ARCHITECTURES.origin(name)
        table.add_row(
            name,
            entry.label,
            "the transformer's flags" if entry.build is None else _options_text(entry.defaults),
            _options_text(entry.presets) or "-",
            entry.description + (f" (plugin {origin})" if origin else ""),
        )
    console = Console()
    if not console.is_terminal:  # piped: the whole table, not one cut to 80 columns
        natural = Measurement.get(console, console.options.update_width(10_000), table)
        console = Console(width=natural.maximum)
    console.print(table)
    return 0


def _options_text(options: dict) -> str:
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in options.items())
