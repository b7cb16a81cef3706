"""Text that fits the terminal: every listing and table of the command line goes through here.

``output_width`` is the width to fit: ``$COLUMNS`` when set, else the terminal's width when
standard output is one, else ``DEFAULT_WIDTH``. ``fit_table`` lays a table out in that width
without losing a character of any value: a column may wrap its cells only at spaces (never
inside a word, so an id, a score or a name stays whole on one line), headers wrap likewise,
and a table still too wide is split into column groups printed one after the other, each
repeating the key columns (the run id, the task) so that every row stays identifiable.
``wrap`` wraps prose (notes, headers) the same way.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

#: The width when neither $COLUMNS nor a terminal says otherwise (output into a pipe or file).
DEFAULT_WIDTH = 100
#: Space between two columns.
GAP = "  "
#: A wrapping column is never made narrower than this (or its longest word, or its text).
WRAP_MIN = 30
#: A header this long or shorter never wraps (``score %`` stays on one line).
SHORT_HEADER = 12


def output_width() -> int:
    """``$COLUMNS`` when set to a positive number, else the terminal's width when standard
    output is a terminal, else ``DEFAULT_WIDTH``."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        if sys.stdout.isatty():
            return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stream)
        pass
    return DEFAULT_WIDTH


def wrap(text: str, width: int | None = None, indent: str = "") -> list[str]:
    """``text`` as lines of at most ``width`` (default ``output_width()``) characters, broken
    at spaces only (a word longer than the width keeps its own line; runs of spaces count as
    one), continuation lines indented by ``indent``."""
    width = width or output_width()
    lines = textwrap.wrap(
        " ".join(text.split()),
        width,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return lines or [""]


def print_wrapped(text: str, file: TextIO | None = None) -> None:
    """``text`` printed wrapped at spaces to the terminal's width (ids and scores stay whole),
    continuation lines indented."""
    print("\n".join(wrap(text, indent="  ")), file=file or sys.stdout)


@dataclass(frozen=True)
class Column:
    """A column of ``fit_table``: its header; ``right``: right-aligned (numbers); ``key``:
    repeated in every column group; ``wrap``: its cells may wrap at spaces, their continuation
    lines indented by ``indent``."""

    name: str
    right: bool = False
    key: bool = False
    wrap: bool = False
    indent: str = ""


def fit_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[object]],
    width: int | None = None,
) -> list[str]:
    """The lines of a table of ``rows`` (one value per column, shown with ``str``) at most
    ``width`` (default ``output_width()``) wide where its values allow: a header, a rule,
    the rows; a blank line between column groups when it is split. Trailing spaces are cut."""
    width = width or output_width()
    cells = [[str(value) for value in row] for row in rows]
    natural = [
        max([len(column.name), *(len(row[i]) for row in cells)]) for i, column in enumerate(columns)
    ]
    least = [
        _least_width(column, [row[i] for row in cells], natural[i])
        for i, column in enumerate(columns)
    ]
    lines: list[str] = []
    for group in _column_groups(columns, least, width):
        widths = _group_widths(group, columns, natural, least, width)
        if lines:
            lines.append("")
        lines += _render(group, columns, cells, widths)
    return lines


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def _least_width(column: Column, values: list[str], natural: int) -> int:
    """The narrowest a column may be: its longest cell (its longest word and at least
    ``WRAP_MIN`` for a wrapping column) and its header (its longest word when the header is
    longer than ``SHORT_HEADER``)."""
    name = column.name
    header = len(name) if len(name) <= SHORT_HEADER else _longest_word(name)
    if not column.wrap:
        return max([header, *(len(value) for value in values)])
    words = max([header, *(_longest_word(value) for value in values)])
    return max(words, min(natural, WRAP_MIN))


def _span(indices: Sequence[int], widths: Sequence[int]) -> int:
    return sum(widths[i] for i in indices) + len(GAP) * max(len(indices) - 1, 0)


def _column_groups(columns: Sequence[Column], least: list[int], width: int) -> list[list[int]]:
    """The key columns with as many others (in order) as fit in ``width`` at their least
    widths; at least one other per group, however wide."""
    keys = [i for i, column in enumerate(columns) if column.key]
    others = [i for i, column in enumerate(columns) if not column.key]
    if not others:
        return [keys]
    groups: list[list[int]] = []
    current: list[int] = []
    for i in others:
        if current and _span(sorted(keys + current + [i]), least) > width:
            groups.append(sorted(keys + current))
            current = []
        current.append(i)
    groups.append(sorted(keys + current))
    return groups


def _group_widths(
    group: list[int], columns: Sequence[Column], natural: list[int], least: list[int], width: int
) -> dict[int, int]:
    """Each column of ``group`` at its least width, then widened towards its natural one while
    room is left: the wrapping columns first (their text), then the others (their headers)."""
    widths = {i: least[i] for i in group}
    room = width - _span(group, least)
    for i in sorted(group, key=lambda i: not columns[i].wrap):
        extra = max(min(natural[i] - widths[i], room), 0)
        widths[i] += extra
        room -= extra
    return widths


def _render(
    group: list[int], columns: Sequence[Column], cells: list[list[str]], widths: dict[int, int]
) -> list[str]:
    headers = [wrap(columns[i].name, widths[i]) for i in group]
    height = max(len(header) for header in headers)
    headers = [[""] * (height - len(header)) + header for header in headers]  # at the bottom
    lines = _join(group, columns, headers, widths)
    lines.append(GAP.join("─" * widths[i] for i in group))
    for row in cells:
        lines += _join(
            group,
            columns,
            [
                wrap(row[i], widths[i], columns[i].indent) if columns[i].wrap else [row[i]]
                for i in group
            ],
            widths,
        )
    return lines


def _join(
    group: list[int], columns: Sequence[Column], parts: list[list[str]], widths: dict[int, int]
) -> list[str]:
    """Lines of one row whose cells are ``parts`` (lines each), aligned, shorter ones padded."""
    height = max(len(part) for part in parts)
    lines = []
    for line in range(height):
        texts = []
        for i, part in zip(group, parts, strict=True):
            text = part[line] if line < len(part) else ""
            texts.append(text.rjust(widths[i]) if columns[i].right else text.ljust(widths[i]))
        lines.append(GAP.join(texts).rstrip())
    return lines
