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
2: no exact match, no training history) is upgraded in place, in one transaction, when it is
opened for writing; opened ``read_only``, it is read as it is and nothing of it is written
(``che_bench.store.access``). Every write is one transaction, and a busy timeout lets several
processes write.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from che_bench.config import RunConfig, RunResult, Scores, protocol_id
from che_bench.errors import CheBenchError
from che_bench.store.access import ReadOnlyAccess, store_error
from che_bench.store.reads import StoreReads
from che_bench.store.schema import (
    APPLICATION_ID,
    MIGRATIONS,
    SCHEMA,
    SCHEMA_VERSION,
    checked_protocol,
    execute_script,
    migrate,
    now,
    schema_version,
)
from che_bench.store.writes import (
    check_scores,
    delete_evaluation,
    insert_evaluation,
    replace_history,
)

DEFAULT_PATH = Path("results") / "che-bench.sqlite"
STORE_ENV = "CHE_BENCH_STORE"
BUSY_TIMEOUT_S = 60.0


def default_store_path() -> Path:
    """``$CHE_BENCH_STORE`` when set, else ``results/che-bench.sqlite``."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_PATH)


class ResultStore(StoreReads):
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
        self._open_or_create()

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
        except sqlite3.DatabaseError as exc:
            raise store_error(self.path, exc, f"result store {self.path}: {exc}") from None
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

    def _open_or_create(self) -> None:
        """Check the file is a che-bench store (for writing: creating it when new or empty,
        upgrading it from an older version); never write to anything else."""
        with self._connect() as connection:
            try:
                # One read transaction: a store that another process is creating right now is
                # seen either whole or not at all (two separate reads could see its tables but
                # not yet its application id, and refuse it as foreign).
                connection.execute("BEGIN")
                application_id = connection.execute("PRAGMA application_id").fetchone()[0]
                tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
                connection.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise store_error(
                    self.path,
                    exc,
                    f"{self.path} is not a che-bench result store (not an SQLite "
                    "database); refusing to touch it",
                ) from None
            if application_id == 0 and not tables:
                if self._reading is not None:
                    raise CheBenchError(f"{self.path} is empty: not a che-bench result store yet")
                self._create(connection)
            elif application_id != APPLICATION_ID or "meta" not in tables:
                raise CheBenchError(
                    f"{self.path} is an SQLite file of another application, not a che-bench "
                    "result store; refusing to touch it"
                )
            self._adopt_schema(connection, schema_version(connection))

    def _adopt_schema(self, connection: sqlite3.Connection, version: int | None) -> None:
        """Make an older schema ``version`` readable: upgrade the store (for writing) or an
        in-memory copy of it (for reading); refuse an unknown one."""
        if version in MIGRATIONS and self._reading is not None:
            self._reading.read_from_upgraded_copy(partial(migrate, from_version=version))
        elif version in MIGRATIONS:
            self._upgrade(connection, version)
        elif version != SCHEMA_VERSION:
            raise CheBenchError(
                f"result store {self.path} has schema version {version}, "
                f"this che-bench reads versions 1 to {SCHEMA_VERSION}"
            )

    def _create(self, connection: sqlite3.Connection) -> None:
        self._enable_wal(connection)
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise store_error(
                self.path, exc, f"cannot write result store {self.path}: {exc}"
            ) from None
        # Re-check inside the lock: another process may have created the store meanwhile.
        if connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            connection.execute("COMMIT")
            return
        execute_script(connection, SCHEMA)
        connection.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [
                ("application", "che-bench"),
                ("schema_version", str(SCHEMA_VERSION)),
                ("created_at", now()),
            ],
        )
        connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        connection.execute("COMMIT")

    def _enable_wal(self, connection: sqlite3.Connection) -> None:
        """Switch a new store to WAL mode (a no-op once any process did). The switch needs the
        file to itself, and SQLite reports a conflict there at once instead of waiting, so
        several processes creating one store retry until the busy timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise store_error(
                        self.path, exc, f"cannot write result store {self.path}: {exc}"
                    ) from None
            time.sleep(0.01)

    def _upgrade(self, connection: sqlite3.Connection, version: int) -> None:
        """Upgrade a store of an older schema ``version`` in place, through every later
        version (``MIGRATIONS``), in one transaction. Any failure (or a crash) leaves the
        store as it was."""
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise store_error(
                self.path,
                exc,
                f"result store {self.path} has schema version {version} and "
                f"cannot be upgraded to {SCHEMA_VERSION}: {exc}",
            ) from None
        try:
            # Re-check inside the lock: another process may have upgraded the store meanwhile.
            current = schema_version(connection)
            if current is not None and current != SCHEMA_VERSION:
                migrate(connection, current)
        except BaseException as exc:
            connection.execute("ROLLBACK")
            if isinstance(exc, (ValueError, sqlite3.DatabaseError)):  # CheBenchError included
                raise store_error(
                    self.path,
                    exc,
                    f"cannot upgrade result store {self.path} from schema "
                    f"version {version} (left unchanged): {exc}",
                ) from None
            raise
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
                (
                    run_id,
                    config.task,
                    config.pe,
                    config.kernel,
                    config.seed,
                    config.lr,
                    config.steps,
                    config.preset,
                    json.dumps(config.to_dict()),
                    now(),
                ),
            )

    def record(self, result: RunResult) -> None:
        """Write a finished run (row, original evaluation and its curves, training history)
        in one transaction. The run's re-evaluations are kept."""
        config = result.config
        row = (
            result.run_id,
            config.task,
            config.pe,
            config.kernel,
            config.seed,
            config.lr,
            config.steps,
            config.preset,
            result.status,
            result.score,
            result.train_accuracy,
            json.dumps(config.to_dict()),
            json.dumps(result.versions),
            result.device,
            json.dumps(result.timings),
            json.dumps(result.details, default=str),
            result.error,
            now(),
            now(),
        )
        protocol = config.evaluation_protocol()
        evaluation_id = protocol_id(protocol)
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
            delete_evaluation(connection, result.run_id, evaluation_id)
            if result.status == "complete" or result.per_length or result.train_per_length:
                insert_evaluation(
                    connection,
                    result.run_id,
                    evaluation_id,
                    protocol,
                    result,
                    is_original=True,
                    device=result.device,
                    versions=result.versions,
                    timings=result.timings,
                )
            replace_history(connection, result.run_id, result.history)

    def record_evaluation(
        self,
        run_id: str,
        protocol: dict[str, Any],
        scores: Scores,
        *,
        device: str,
        versions: dict[str, str],
        timings: dict[str, float],
    ) -> str:
        """Record a re-evaluation of complete run ``run_id`` under ``protocol`` (a dict like
        ``RunConfig.evaluation_protocol()``) with its ``scores`` in one transaction, replacing
        an earlier one under the same protocol; returns the evaluation id (the protocol's id).
        The curves must cover exactly the protocol's test and in-distribution lengths; the
        exact-match values come all together or not at all."""
        protocol = checked_protocol(protocol)
        check_scores(scores, protocol)
        evaluation_id = protocol_id(protocol)
        with self._transaction() as connection:
            run = connection.execute(
                "SELECT status FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if run is None:
                raise CheBenchError(f"no run {run_id!r} in result store {self.path}")
            if run[0] != "complete":
                raise CheBenchError(
                    f"run {run_id} is {run[0]}, not complete: nothing to re-evaluate"
                )
            original = connection.execute(
                "SELECT evaluation_id FROM evaluations WHERE run_id = ? AND is_original = 1",
                (run_id,),
            ).fetchone()
            if original is not None and original[0] == evaluation_id:
                raise CheBenchError(
                    f"protocol {evaluation_id} is the original evaluation of run {run_id}; "
                    "re-evaluate under another protocol"
                )
            delete_evaluation(connection, run_id, evaluation_id)
            insert_evaluation(
                connection,
                run_id,
                evaluation_id,
                protocol,
                scores,
                is_original=False,
                device=device,
                versions=versions,
                timings=timings,
            )
        return evaluation_id
