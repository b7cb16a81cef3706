"""``che-bench models``: the registered architectures, their options and presets."""

from __future__ import annotations

import argparse
import json

from che_bench.reports.text_tables import Column, fit_table, wrap


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="list the architectures (--arch), their options and presets"
    )
    parser.set_defaults(handler=handler)


def handler(args: argparse.Namespace) -> int:
    from che_bench.model.architectures import ARCHITECTURES

    columns = [
        Column("architecture", key=True),
        Column("label"),
        Column("from"),
        Column("options (--arch-option)", wrap=True),
        Column("presets", wrap=True),
        Column("description", wrap=True),
    ]
    rows = []
    for name in ARCHITECTURES.names():
        entry = ARCHITECTURES.get(name)
        rows.append(
            (
                name,
                entry.label,
                ARCHITECTURES.source(name),
                "the transformer's flags" if entry.build is None else _options_text(entry.defaults),
                _options_text(entry.presets) or "-",
                entry.description,
            )
        )
    print("\n".join([*wrap("che-bench architectures (--arch)"), "", *fit_table(columns, rows)]))
    return 0


def _options_text(options: dict) -> str:
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in options.items())
