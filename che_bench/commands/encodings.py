"""``che-bench encodings``: the registered positional encodings and the DAPE kernels."""

from __future__ import annotations

import argparse

from che_bench.reports.text_tables import Column, fit_table, wrap

BIAS_LINE = "bias: the encoding adds a bias to the attention scores (DAPE then sees 2H channels)."
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
    from che_bench.encodings import list_encodings
    from che_bench.encodings.base import ENCODINGS

    columns = [
        Column("encoding", key=True),
        Column("from"),
        Column("kind"),
        Column("randomized"),
        Column("bias"),
        Column("description", wrap=True),
    ]
    rows = [
        (
            cls.name,
            ENCODINGS.source(cls.name),
            cls.kind,
            "yes" if cls.randomized else "no",
            "yes" if cls.carries_bias else "no",
            cls.description,
        )
        for cls in list_encodings()
    ]
    lines = [*wrap("che-bench positional encodings"), "", *fit_table(columns, rows), ""]
    for note in (BIAS_LINE, DAPE_LINE):
        lines += wrap(note, indent="  ")
    print("\n".join(lines))
    return 0
