"""``che-bench encodings``: the registered positional encodings and the DAPE kernels."""

from __future__ import annotations

import argparse

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from che_bench.encodings import list_encodings

DAPE_LINE = (
    "DAPE kernels (--kernel): none = off, 1 = DAPE (MLP over the score channels), "
    "3/5/7 = DAPE V2 (1xk convolution along the keys); works with every encoding."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "encodings", help="list the positional encodings and the DAPE kernels"
    )
    parser.set_defaults(handler=handler)


def handler(args: argparse.Namespace) -> int:
    table = Table(title="che-bench positional encodings", box=box.SIMPLE_HEAD)
    for column in ("encoding", "kind", "randomized", "bias (DAPE sees 2H channels)", "description"):
        table.add_column(column, no_wrap=column != "description")
    for cls in list_encodings():
        table.add_row(
            cls.name,
            cls.kind,
            "yes" if cls.randomized else "no",
            "yes" if cls.carries_bias else "no",
            cls.description,
        )
    console = Console()
    if not console.is_terminal:  # piped: the whole table, not one cut to 80 columns
        natural = Measurement.get(console, console.options.update_width(10_000), table)
        console = Console(width=natural.maximum)
    console.print(table)
    console.print(DAPE_LINE)
    return 0
