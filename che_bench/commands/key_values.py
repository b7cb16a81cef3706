"""``KEY=VALUE`` command-line items (task parameters, encoding options)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from che_bench.errors import CheBenchError


def parse_key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``["a=3", "b=True", "c=near"]`` -> ``{"a": 3, "b": True, "c": "near"}``: values are read
    as JSON (numbers, true/false in any case) and otherwise kept as strings."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CheBenchError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            parsed[key] = json.loads(text.lower() if text.lower() in ("true", "false") else text)
        except json.JSONDecodeError:
            parsed[key] = text
    return parsed


def add_key_values_argument(
    parser: argparse.ArgumentParser, flag: str, help: str, aliases: tuple[str, ...] = ()
) -> None:
    """A repeatable ``flag KEY=VALUE`` (read with ``parse_key_values``), also spelt as each
    of ``aliases``."""
    parser.add_argument(flag, *aliases, action="append", default=[], metavar="KEY=VALUE", help=help)
