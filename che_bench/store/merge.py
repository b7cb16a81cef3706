"""Merging result stores written by separate jobs (a SLURM array, two clusters) into one.

``merge_stores(out, inputs)`` copies every run of each input store into ``out``: every table
with a ``run_id`` column, every column of it, as the schema has them (a table or a column
added to the schema travels with no change here), and then the runs' kept models and
checkpoints (``store.files``). The inputs are only read (an input of an older schema is read
from an upgraded copy in memory, as by any reader).

A run id already in ``out`` (stored there before, or brought by an earlier input) is a
duplicate, settled by the runs' status and results, a result being every column but
``CIRCUMSTANCES`` (when, where, how and how long a run or evaluation ran):

- complete in both with the same results: one is kept; rows that only the input has (a
  re-evaluation made on the other cluster) are added;
- complete in the input, started or failed in ``out``: the complete run replaces the other;
- started or failed in the input: the run in ``out`` is kept;
- complete in both with different results: a conflict. ``out`` keeps its run, the input's
  stays in the input store, and the merge names both.

The database part is one transaction: it lands whole or not at all. Files are copied after it
(a file already there is kept), so a merge run again adds nothing and copies any file missing.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from che_bench.errors import CheBenchError
from che_bench.store.files import CHECKPOINTS, MODELS, files_dir, run_file
from che_bench.store.result_store import ResultStore
from che_bench.store.schema import now

#: Columns that say when, where, with which numerics settings and how long something ran, not
#: what it gave: two copies of a run that differ only in them hold the same results.
CIRCUMSTANCES = frozenset(
    {
        "created_at",
        "finished_at",
        "timings",
        "device",
        "versions",
        "details",
        "attempts",
        "elapsed_s",
    }
)

#: A run's rows: each table's, as column -> value dicts.
RunRows = dict[str, list[dict[str, Any]]]
#: What became of an input's run (``MergeReport`` lists them by these names).
ADDED, IDENTICAL, REPLACED, KEPT, CONFLICT = "added", "identical", "replaced", "kept", "conflict"


@dataclass
class MergeReport:
    """What ``merge_stores`` did, by run id."""

    added: list[str] = field(default_factory=list)
    identical: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    #: One line per run id whose copies hold different results.
    conflicts: list[str] = field(default_factory=list)
    #: How many kept models and checkpoints were copied.
    files: int = 0


def merge_stores(out: ResultStore, inputs: Sequence[ResultStore]) -> MergeReport:
    """Merge the runs of ``inputs`` (read-only stores) into ``out`` (see the module
    docstring)."""
    target = out.path.resolve()
    if any(store.path.resolve() == target for store in inputs):
        raise CheBenchError(f"{out.path} is among the stores to merge: give another output")
    report = MergeReport()
    origins: dict[str, Path] = {}  # the store each run's copy in the output came from
    to_copy: list[tuple[Path, str]] = []
    with out._transaction() as connection:
        tables = _run_tables(connection)
        for store in inputs:
            with store._connect() as source:
                for run_id, rows in _input_runs(source, store.path, tables):
                    sources = (store.path, origins.get(run_id, out.path))
                    outcome = _merge_run(connection, tables, run_id, rows, sources, report)
                    if outcome in (ADDED, REPLACED):
                        origins[run_id] = store.path
                    if outcome != CONFLICT:
                        to_copy.append((store.path, run_id))
            connection.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                (f"merged_from {store.path.resolve()}", now()),
            )
    runs = out.runs()
    statuses = dict(zip(runs["run_id"], runs["status"], strict=True))
    report.files = sum(_copy_files(out.path, path, run_id, statuses) for path, run_id in to_copy)
    return report


def _run_tables(connection: sqlite3.Connection) -> dict[str, list[str]]:
    """Each table with a ``run_id`` column and its key columns (the primary key's; every
    column where it has none): ``runs`` first and ``evaluations`` next, as the others refer
    to them."""
    names = [
        row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    ]
    tables = {}
    for name in sorted(names, key=lambda name: (name != "runs", name != "evaluations", name)):
        columns = connection.execute(f'PRAGMA table_info("{name}")').fetchall()
        if any(column[1] == "run_id" for column in columns):
            keys = sorted((column for column in columns if column[5]), key=lambda c: c[5])
            tables[name] = [column[1] for column in keys or columns]
    return tables


def _input_runs(source: sqlite3.Connection, path: Path, tables: dict[str, list[str]]):
    """(run id, its rows) of every run of an input store, oldest first."""
    missing = sorted(set(_run_tables(source)) - set(tables))
    if missing:
        raise CheBenchError(f"{path} has table(s) {', '.join(missing)} that the output lacks")
    run_ids = [row[0] for row in source.execute("SELECT run_id FROM runs ORDER BY created_at")]
    for run_id in run_ids:
        yield run_id, {table: _rows(source, table, run_id) for table in tables}


def _rows(connection: sqlite3.Connection, table: str, run_id: str) -> list[dict[str, Any]]:
    cursor = connection.execute(f'SELECT * FROM "{table}" WHERE run_id = ?', (run_id,))
    names = [description[0] for description in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def _merge_run(
    connection: sqlite3.Connection,
    tables: dict[str, list[str]],
    run_id: str,
    incoming: RunRows,
    sources: tuple[Path, Path],
    report: MergeReport,
) -> str:
    """Bring one run of an input into the output (``sources``: the input and the store that
    the output's copy came from); what became of it, also noted in ``report``."""
    stored = {table: _rows(connection, table, run_id) for table in tables}
    new, old = incoming["runs"][0]["status"], (stored["runs"] or [{"status": None}])[0]["status"]
    if old is None or (new == "complete" and old != "complete"):
        for table in reversed(tables) if old is not None else ():
            connection.execute(f'DELETE FROM "{table}" WHERE run_id = ?', (run_id,))
        for table, rows in incoming.items():
            _insert(connection, table, rows)
        outcome = ADDED if old is None else REPLACED
        getattr(report, outcome).append(run_id)
        return outcome
    if new != "complete" or old != "complete":
        report.kept.append(run_id)
        return KEPT
    differences, missing = _compare(stored, incoming, tables)
    if differences:
        report.conflicts.append(_conflict(run_id, sources, differences, stored, incoming))
        return CONFLICT
    for table, rows in missing.items():
        _insert(connection, table, rows)
    report.identical.append(run_id)
    return IDENTICAL


def _compare(
    stored: RunRows, incoming: RunRows, tables: dict[str, list[str]]
) -> tuple[list[str], RunRows]:
    """The ``table.column`` results in which two copies of a run differ, and the input's rows
    that the output lacks (by key)."""
    differences: dict[str, None] = {}
    missing: RunRows = {}
    for table, keys in tables.items():
        have = {tuple(row[key] for key in keys): row for row in stored[table]}
        for row in incoming[table]:
            other = have.get(tuple(row[key] for key in keys))
            if other is None:
                missing.setdefault(table, []).append(row)
                continue
            for column, value in row.items():
                if column not in CIRCUMSTANCES and other.get(column) != value:
                    differences[f"{table}.{column}"] = None
    return list(differences), missing


def _conflict(
    run_id: str,
    sources: tuple[Path, Path],
    differences: list[str],
    stored: RunRows,
    incoming: RunRows,
) -> str:
    source, origin = sources
    scores = [rows["runs"][0]["score"] for rows in (stored, incoming)]
    shown = ", ".join(differences[:4]) + (", ..." if len(differences) > 4 else "")
    return (
        f"run {run_id}: complete in {origin} (score {_percent(scores[0])}) and in {source} "
        f"(score {_percent(scores[1])}) with other results ({shown}); kept {origin}'s, "
        f"{source}'s is not merged (it stays in {source})"
    )


def _percent(score: float | None) -> str:
    return "-" if score is None else f"{score:.2%}"


def _insert(connection: sqlite3.Connection, table: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        columns = ", ".join(f'"{name}"' for name in row)
        places = ", ".join("?" for _ in row)
        connection.execute(
            f'INSERT INTO "{table}" ({columns}) VALUES ({places})', tuple(row.values())
        )


def _copy_files(out: Path, source: Path, run_id: str, statuses: dict[str, str]) -> int:
    """Copy a run's kept model (a complete run) or checkpoint (a started or failed one, which
    resumes from it) from store ``source`` into the output's folder, unless the output has
    one already; 1 if copied. Written whole or not at all (a temporary file, renamed)."""
    kind = MODELS if statuses.get(run_id) == "complete" else CHECKPOINTS
    origin = run_file(source, kind, run_id)
    if not origin.is_file() or run_file(out, kind, run_id).exists():
        return 0
    target = files_dir(out, kind) / origin.name
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(origin, temporary)
        os.replace(temporary, target)
    except OSError as exc:
        raise CheBenchError(f"cannot copy {origin} to {target}: {exc.strerror or exc}") from None
    return 1
