"""The result store: one SQLite file (WAL mode) shared by every command and worker.

Table ``runs`` holds one row per run id (status ``started`` -> ``complete`` | ``failed``;
a run whose process died stays ``started``). Table ``evaluations`` holds a run's evaluations:
its *original* one, made when the run completed, and any re-evaluation of its kept model under
another protocol. An evaluation is identified by its run and its protocol id
(``config.protocol_id``), so evaluations of different runs under the same protocol share the id.
Table ``accuracies`` holds the per-length curve of each evaluation (split ``test`` or
``train``, accuracies as fractions: token-level, and exact match where it was recorded).
``runs.score`` and ``runs.train_accuracy`` repeat the original evaluation's values. Table
``history`` holds each run's training history (``che_bench.train.history``: a row every
``log_every`` steps).

A file is recognised by SQLite's ``application_id`` header field plus a ``meta`` table; anything
else is refused and never modified. A store of an older schema version (1: one curve per run;
2: no exact match, no training history; 3: no ``runs.plugins``, the plugins a run used with
their versions and source hashes) is upgraded in place, in one transaction, when it is
opened for writing; opened ``read_only``, it is read as it is and nothing of it is written
(``che_bench.store.access``). Every write is one transaction, and a busy timeout lets several
processes write.

``ResultStore`` holds the connections; the rest is by job: ``schema`` (tables, version,
migrations), ``opening`` (recognising, creating, upgrading the file), ``reads`` (the queries)
and ``writes`` (recording runs, evaluations and histories).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.store.access import ReadOnlyAccess, store_error
from che_bench.store.opening import BUSY_TIMEOUT_S, open_or_create, unreadable_file_message
from che_bench.store.reads import StoreReads
from che_bench.store.writes import StoreWrites

DEFAULT_PATH = Path("results") / "che-bench.sqlite"
STORE_ENV = "CHE_BENCH_STORE"


def default_store_path() -> Path:
    """``$CHE_BENCH_STORE`` when set, else ``results/che-bench.sqlite``."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_PATH)


class ResultStore(StoreReads, StoreWrites):
    """Runs, their evaluations and per-length accuracies in one SQLite file (see the module
    docstring). ``read_only``: an existing store, only read (its writing methods fail)."""

    def __init__(self, path: str | os.PathLike | None = None, *, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else default_store_path()
        if self.path.is_dir():
            raise CheBenchError(f"result store {self.path} is a directory, not a file")
        self._reading = ReadOnlyAccess(self.path, BUSY_TIMEOUT_S) if read_only else None
        if not read_only:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheBenchError(
                    f"cannot create the directory of store {self.path}: {exc.strerror}"
                ) from None
        with self._connect() as connection:
            open_or_create(connection, self.path, self._reading)

    # -- connection handling -----------------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = (
                self._reading.connect()
                if self._reading is not None
                else sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            )
        except sqlite3.Error as exc:
            raise store_error(
                self.path, exc, f"cannot open result store {self.path}: {exc}"
            ) from None
        try:
            yield connection
        except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
            # (pandas' queries wrap SQLite's error in their own)
            cause = exc.__cause__ if isinstance(exc.__cause__, sqlite3.DatabaseError) else exc
            message = (
                unreadable_file_message(self.path, cause)
                if "malformed" in str(cause)
                else f"result store {self.path}: {cause}"
            )
            raise store_error(self.path, cause, message) from None
        finally:
            connection.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it lands, or none of it."""
        if self._reading is not None:
            raise CheBenchError(f"result store {self.path} was opened read-only")
        with self._connect() as connection:
            connection.execute("BEGIN IMMEDIATE")
            try:
                yield connection
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
