"""Run ids given on the command line: a whole id or any prefix that names one run, as git
takes commit prefixes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from che_bench.store.result_store import ResultStore

#: How many of an ambiguous prefix's runs the error names.
SHOWN_MATCHES = 5


def resolve_run_ids(store: ResultStore, given: Iterable[str]) -> list[str]:
    """The ids of the store's runs that ``given`` ids or id prefixes name, in the order given,
    without repeats; a CheBenchError for one that names no run or several (ambiguous)."""
    known = sorted(store.runs()["run_id"])
    resolved, unknown = [], []
    for text in given:
        matches = (
            [text] if text in known else [run_id for run_id in known if run_id.startswith(text)]
        )
        if len(matches) > 1:
            shown = ", ".join(matches[:SHOWN_MATCHES]) + (
                ", ..." if len(matches) > SHOWN_MATCHES else ""
            )
            raise CheBenchError(
                f"run id prefix {text!r} is ambiguous: it begins {len(matches)} "
                f"run ids in {store.path} ({shown}); give more of it"
            )
        if matches:
            resolved.extend(matches)
        else:
            unknown.append(text)
    if unknown:
        raise CheBenchError(f"no run {', '.join(unknown)} in {store.path} (see `che-bench runs`)")
    return list(dict.fromkeys(resolved))
