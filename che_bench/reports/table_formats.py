"""The CHE table (``tables.display_table``: display strings indexed by level, task and chance,
and its notes) rendered as text that fits the terminal, as Markdown or as LaTeX."""

from __future__ import annotations

import math

import pandas as pd

from che_bench.reports.paper import SHOWN_DIFFERENCES
from che_bench.reports.text_tables import Column, fit_table, output_width, wrap
from che_bench.reports.unregistered import UNKNOWN_LEVEL

#: The suffix of a comparison column (the published value and the difference, or what differs).
PAPER_SUFFIX = " paper (diff)"


def chance_text(chance: float) -> str:
    """A chance in percent; the tiny ones of exact match with one significant digit."""
    if math.isnan(chance):
        return UNKNOWN_LEVEL
    return f"{chance:.1f}" if chance >= 0.05 or chance == 0 else f"{chance:.0e}"


def cell_text(row: pd.Series) -> str:
    """A cell: max (mean±std, n), and the best run's configuration in a ``best of`` column."""
    best = f" [{row['best']}]" if row.get("best") else ""
    if row["n"] == 1:
        return f"{row['max']:.2f} (n=1){best}"
    return f"{row['max']:.2f} ({row['mean']:.2f}±{row['std']:.2f}, n={row['n']}){best}"


def paper_text(row: pd.Series) -> str:
    """The published value and ours minus it, or what keeps the cell from being compared."""
    if math.isnan(row["paper"]):
        return ""
    if row["comparable"]:
        return f"{row['paper']:.2f} ({row['diff']:+.2f})"
    shown = list(row["differences"][:SHOWN_DIFFERENCES])
    if len(row["differences"]) > SHOWN_DIFFERENCES:
        shown.append(f"+{len(row['differences']) - SHOWN_DIFFERENCES} more")
    return f"{row['paper']:.2f} (not comparable: {', '.join(shown)})"


def as_text(table: pd.DataFrame, notes: list[str], width: int | None = None) -> str:
    """The table in ``width`` (default ``output_width()``) columns, split into column groups
    that repeat level, task and chance where it is wider; the notes wrapped to it."""
    width = width or output_width()
    frame = table.reset_index()
    keys = list(table.index.names)
    columns = [
        Column(
            str(name),
            right=name == "chance" or not (name in keys or str(name).endswith(PAPER_SUFFIX)),
            key=name in keys,
            wrap=str(name).endswith(PAPER_SUFFIX),
        )
        for name in frame.columns
    ]
    lines = fit_table(columns, frame.values.tolist(), width)
    lines.append("")
    for note in notes:
        lines += wrap(note, width, indent="  ")
    return "\n".join(lines) + "\n"


def as_markdown(table: pd.DataFrame, notes: list[str]) -> str:
    frame = table.reset_index()
    header = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += [
        "| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)
    ]
    return "\n".join(lines) + "\n" + "".join(f"\n{note}  " for note in notes).rstrip() + "\n"


def as_latex(table: pd.DataFrame, notes: list[str]) -> str:
    frame = table.reset_index()

    def escape(value: object) -> str:
        text = str(value)
        for char, replacement in (
            ("\\", r"\textbackslash{}"),
            ("&", r"\&"),
            ("%", r"\%"),
            ("_", r"\_"),
            ("#", r"\#"),
            ("±", r"$\pm$"),
        ):
            text = text.replace(char, replacement)
        return text

    lines = [f"% {note}" for note in notes]
    lines.append(r"\begin{tabular}{" + "ll" + "r" * (len(frame.columns) - 2) + "}")
    lines.append(r"\hline")
    lines.append(" & ".join(escape(c) for c in frame.columns) + r" \\")
    lines.append(r"\hline")
    lines += [" & ".join(escape(v) for v in row) + r" \\" for row in frame.itertuples(index=False)]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"
