"""The result store: one SQLite file (WAL mode) shared by every command and worker.

Table ``runs`` holds one row per run id (status ``started`` -> ``complete`` | ``failed``;
a run whose process died stays ``started``), table ``accuracies`` the per-length curves
(split ``test`` or ``train``, accuracies as fractions). A file is recognised by SQLite's
``application_id`` header field plus a ``meta`` table; anything else is refused and never
modified. Every write is one transaction, and a busy timeout lets several processes write.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from che_bench.errors import CheBenchError

if TYPE_CHECKING:
    from che_bench.config import RunConfig, RunResult

DEFAULT_PATH = Path("results") / "che-bench.sqlite"
STORE_ENV = "CHE_BENCH_STORE"
APPLICATION_ID = 0x43484542  # "CHEB"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    pe TEXT NOT NULL,
    kernel INTEGER,
    seed INTEGER NOT NULL,
    lr REAL NOT NULL,
    steps INTEGER NOT NULL,
    preset TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('started', 'complete', 'failed')),
    score REAL,
    train_accuracy REAL,
    config TEXT NOT NULL,
    versions TEXT,
    device TEXT,
    timings TEXT,
    details TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 1,
    created_at TEXT NOT NULL,
    finished_at TEXT
);
CREATE TABLE accuracies (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    split TEXT NOT NULL CHECK (split IN ('test', 'train')),
    length INTEGER NOT NULL,
    accuracy REAL NOT NULL,
    PRIMARY KEY (run_id, split, length)
);
"""

RUN_COLUMNS = (
    "run_id", "task", "pe", "kernel", "seed", "lr", "steps", "preset", "status", "score",
    "train_accuracy", "device", "error", "attempts", "created_at", "finished_at",
    "config", "timings",
)


def default_store_path() -> Path:
    """``$CHE_BENCH_STORE`` when set, else ``results/che-bench.sqlite``."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_PATH)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class ResultStore:
    """Runs and their per-length accuracies in one SQLite file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_store_path()
        if self.path.is_dir():
            raise CheBenchError(f"result store {self.path} is a directory, not a file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheBenchError(f"cannot create the directory of store {self.path}: {exc.strerror}") from None
        self._open_or_create()

    # -- connection handling -----------------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as exc:
            raise CheBenchError(f"cannot open result store {self.path}: {exc}") from None
        try:
            yield connection
        except sqlite3.DatabaseError as exc:
            raise CheBenchError(f"result store {self.path}: {exc}") from None
        finally:
            connection.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it lands, or none of it."""
        with self._connect() as connection:
            connection.execute("BEGIN IMMEDIATE")
            try:
                yield connection
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")

    def _open_or_create(self) -> None:
        """Check the file is a che-bench store (creating it when new or empty); never write to
        anything else."""
        with self._connect() as connection:
            try:
                application_id = connection.execute("PRAGMA application_id").fetchone()[0]
                tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
            except sqlite3.DatabaseError:
                raise CheBenchError(
                    f"{self.path} is not a che-bench result store (not an SQLite database); "
                    "refusing to touch it"
                ) from None
            if application_id == 0 and not tables:
                self._create(connection)
            elif application_id != APPLICATION_ID or "meta" not in tables:
                raise CheBenchError(
                    f"{self.path} is an SQLite file of another application, not a che-bench "
                    "result store; refusing to touch it"
                )
            version = connection.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone()
            if version is None or int(version[0]) != SCHEMA_VERSION:
                raise CheBenchError(
                    f"result store {self.path} has schema version {version and version[0]}, "
                    f"this che-bench reads version {SCHEMA_VERSION}"
                )

    def _create(self, connection: sqlite3.Connection) -> None:
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise CheBenchError(f"cannot write result store {self.path}: {exc}") from None
        # Re-check inside the lock: another process may have created the store meanwhile.
        if connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            connection.execute("COMMIT")
            return
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                connection.execute(statement)
        connection.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [("application", "che-bench"), ("schema_version", str(SCHEMA_VERSION)),
             ("created_at", _now())],
        )
        connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        connection.execute("COMMIT")

    # -- writing -----------------------------------------------------------------------------

    def mark_started(self, config: RunConfig) -> None:
        """Record that a run begins (a complete run is left untouched)."""
        run_id = config.run_id()
        with self._transaction() as connection:
            connection.execute(
                """INSERT INTO runs (run_id, task, pe, kernel, seed, lr, steps, preset, status,
                                     config, created_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'started', ?, ?)
                   ON CONFLICT (run_id) DO UPDATE SET
                       status = 'started', attempts = attempts + 1, error = NULL,
                       finished_at = NULL
                   WHERE status != 'complete'""",
                (run_id, config.task, config.pe, config.kernel, config.seed, config.lr,
                 config.steps, config.preset, json.dumps(config.to_dict()), _now()),
            )

    def record(self, result: RunResult) -> None:
        """Write a finished run (row and accuracies) in one transaction."""
        config = result.config
        row = (
            result.run_id, config.task, config.pe, config.kernel, config.seed, config.lr,
            config.steps, config.preset, result.status, result.score, result.train_accuracy,
            json.dumps(config.to_dict()), json.dumps(result.versions), result.device,
            json.dumps(result.timings), json.dumps(result.details, default=str), result.error,
            _now(), _now(),
        )
        accuracies = [(result.run_id, "test", n, acc) for n, acc in result.per_length.items()]
        accuracies += [(result.run_id, "train", n, acc) for n, acc in result.train_per_length.items()]
        with self._transaction() as connection:
            connection.execute(
                """INSERT INTO runs (run_id, task, pe, kernel, seed, lr, steps, preset, status,
                                     score, train_accuracy, config, versions, device, timings,
                                     details, error, created_at, finished_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (run_id) DO UPDATE SET
                       status = excluded.status, score = excluded.score,
                       train_accuracy = excluded.train_accuracy, config = excluded.config,
                       versions = excluded.versions, device = excluded.device,
                       timings = excluded.timings, details = excluded.details,
                       error = excluded.error, finished_at = excluded.finished_at""",
                row,
            )
            connection.execute("DELETE FROM accuracies WHERE run_id = ?", (result.run_id,))
            connection.executemany(
                "INSERT INTO accuracies (run_id, split, length, accuracy) VALUES (?, ?, ?, ?)",
                accuracies,
            )

    # -- reading -----------------------------------------------------------------------------

    def completed_run_ids(self) -> set[str]:
        with self._connect() as connection:
            rows = connection.execute("SELECT run_id FROM runs WHERE status = 'complete'")
            return {row[0] for row in rows}

    def runs(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per run (every status), oldest first; ``kernel`` is None without DAPE."""
        with self._connect() as connection:
            frame = pd.read_sql_query(
                f"SELECT {', '.join(RUN_COLUMNS)} FROM runs ORDER BY created_at, run_id", connection
            )
        frame["kernel"] = _nullable_ints(frame["kernel"])
        if run_ids is not None:
            frame = frame[frame["run_id"].isin(set(run_ids))]
        return frame.reset_index(drop=True)

    def per_length(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Per-length accuracies of complete runs with the run's identifying columns."""
        with self._connect() as connection:
            frame = pd.read_sql_query(
                """SELECT a.run_id, r.task, r.pe, r.kernel, r.seed, r.lr, r.steps, r.preset,
                          a.split, a.length, a.accuracy
                   FROM accuracies a JOIN runs r USING (run_id)
                   WHERE r.status = 'complete'
                   ORDER BY r.created_at, a.run_id, a.split, a.length""",
                connection,
            )
        frame["kernel"] = _nullable_ints(frame["kernel"])
        if run_ids is not None:
            frame = frame[frame["run_id"].isin(set(run_ids))]
        return frame.reset_index(drop=True)


def _nullable_ints(column: pd.Series) -> pd.Series:
    """SQLite NULLs come back as NaN in a float column; keep None and plain ints instead."""
    values = [None if pd.isna(value) else int(value) for value in column]
    return pd.Series(values, index=column.index, dtype=object)
