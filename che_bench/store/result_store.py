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

import datetime as dt
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench.config import EVALUATION_FIELDS, RunConfig, RunResult, Scores, protocol_id
from che_bench.errors import CheBenchError
from che_bench.protocol import EVAL_SEED, format_lengths
from che_bench.store.access import ReadOnlyAccess, store_error
from che_bench.train.history import HISTORY_FIELDS

DEFAULT_PATH = Path("results") / "che-bench.sqlite"
STORE_ENV = "CHE_BENCH_STORE"
APPLICATION_ID = 0x43484542  # "CHEB"
SCHEMA_VERSION = 3
BUSY_TIMEOUT_S = 60.0
#: ``evaluation`` argument of the readers: each run's own original evaluation.
ORIGINAL = "original"

_RUNS_SCHEMA = """
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
"""
#: What version 2 added to version 1 (whose ``accuracies`` had one curve per run); run both
#: by ``_create`` and by the upgrade of a version-1 store.
_EVALUATIONS_SCHEMA = """
CREATE TABLE evaluations (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    evaluation_id TEXT NOT NULL,
    protocol TEXT NOT NULL,
    is_original INTEGER NOT NULL CHECK (is_original IN (0, 1)),
    score REAL,
    train_accuracy REAL,
    device TEXT,
    versions TEXT,
    timings TEXT,
    created_at TEXT NOT NULL,
    PRIMARY KEY (run_id, evaluation_id)
);
CREATE UNIQUE INDEX one_original_evaluation_per_run ON evaluations (run_id) WHERE is_original = 1;
CREATE INDEX evaluations_by_protocol ON evaluations (evaluation_id);
CREATE TABLE accuracies (
    run_id TEXT NOT NULL,
    evaluation_id TEXT NOT NULL,
    split TEXT NOT NULL CHECK (split IN ('test', 'train')),
    length INTEGER NOT NULL,
    accuracy REAL NOT NULL,
    PRIMARY KEY (run_id, evaluation_id, split, length),
    FOREIGN KEY (run_id, evaluation_id) REFERENCES evaluations (run_id, evaluation_id)
);
"""
#: What version 3 added to version 2: exact-match accuracies (NULL in evaluations made before
#: they were recorded) and training histories; run by ``_create`` and by the upgrade.
_EXACT_AND_HISTORY_SCHEMA = """
ALTER TABLE evaluations ADD COLUMN exact_score REAL;
ALTER TABLE evaluations ADD COLUMN train_exact_accuracy REAL;
ALTER TABLE accuracies ADD COLUMN exact_accuracy REAL;
CREATE TABLE history (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step INTEGER NOT NULL,
    loss REAL,
    accuracy REAL,
    grad_norm REAL,
    lr REAL NOT NULL,
    elapsed_s REAL,
    PRIMARY KEY (run_id, step)
);
"""
_SCHEMA = _RUNS_SCHEMA + _EVALUATIONS_SCHEMA + _EXACT_AND_HISTORY_SCHEMA

#: Columns of ``runs()`` taken from the ``runs`` table; the evaluation shown adds ``score``,
#: ``train_accuracy`` and ``EVALUATION_COLUMNS``.
RUN_COLUMNS = (
    "run_id", "task", "pe", "kernel", "seed", "lr", "steps", "preset", "status", "device",
    "error", "attempts", "created_at", "finished_at", "config", "versions", "timings",
)
#: Columns of ``runs()`` that describe the evaluation shown: its id, protocol (JSON), and the
#: device and timings of that evaluation (a re-evaluation may run elsewhere than training).
EVALUATION_COLUMNS = ("evaluation", "protocol", "eval_device", "eval_timings")


def default_store_path() -> Path:
    """``$CHE_BENCH_STORE`` when set, else ``results/che-bench.sqlite``."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_PATH)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def describe_protocol(protocol: dict[str, Any]) -> str:
    """One line about an evaluation protocol, e.g. ``test lengths 41..1000, 512 samples
    (batch 64), in-distribution 1..40 (5 lengths), dropout at eval``."""
    parts = [f"test lengths {format_lengths(protocol['test_lengths'])}"]
    if protocol["score_from_42"]:
        parts.append("score from 42")
    parts.append(f"{protocol['eval_samples']} samples (batch {protocol['eval_batch_size']})")
    parts.append(f"in-distribution {format_lengths(protocol['train_eval_lengths'])}")
    if protocol["eval_seed"] != EVAL_SEED:
        parts.append(f"eval seed {protocol['eval_seed']}")
    if protocol["dropout_at_eval"]:
        parts.append("dropout at eval")
    return ", ".join(parts)


class ResultStore:
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
                raise CheBenchError(f"cannot create the directory of store {self.path}: {exc.strerror}") from None
        self._open_or_create()

    # -- connection handling -----------------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = (self._reading.connect() if self._reading is not None else
                          sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None))
        except sqlite3.Error as exc:
            raise store_error(self.path, exc, f"cannot open result store {self.path}: {exc}") from None
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
                    self.path, exc, f"{self.path} is not a che-bench result store (not an SQLite "
                    "database); refusing to touch it"
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
            self._adopt_schema(connection, _schema_version(connection))

    def _adopt_schema(self, connection: sqlite3.Connection, version: int | None) -> None:
        """Make an older schema ``version`` readable: upgrade the store (for writing) or an
        in-memory copy of it (for reading); refuse an unknown one."""
        if version in _MIGRATIONS and self._reading is not None:
            self._reading.read_from_upgraded_copy(partial(_migrate, from_version=version))
        elif version in _MIGRATIONS:
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
            raise store_error(self.path, exc, f"cannot write result store {self.path}: {exc}") from None
        # Re-check inside the lock: another process may have created the store meanwhile.
        if connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            connection.execute("COMMIT")
            return
        _execute_script(connection, _SCHEMA)
        connection.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [("application", "che-bench"), ("schema_version", str(SCHEMA_VERSION)),
             ("created_at", _now())],
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
                    raise store_error(self.path, exc, f"cannot write result store {self.path}: {exc}") from None
            time.sleep(0.01)

    def _upgrade(self, connection: sqlite3.Connection, version: int) -> None:
        """Upgrade a store of an older schema ``version`` in place, through every later
        version (``_MIGRATIONS``), in one transaction. Any failure (or a crash) leaves the
        store as it was."""
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise store_error(
                self.path, exc, f"result store {self.path} has schema version {version} and "
                f"cannot be upgraded to {SCHEMA_VERSION}: {exc}"
            ) from None
        try:
            # Re-check inside the lock: another process may have upgraded the store meanwhile.
            current = _schema_version(connection)
            if current != SCHEMA_VERSION:
                _migrate(connection, current)
        except BaseException as exc:
            connection.execute("ROLLBACK")
            if isinstance(exc, (ValueError, sqlite3.DatabaseError)):  # CheBenchError included
                raise store_error(
                    self.path, exc, f"cannot upgrade result store {self.path} from schema "
                    f"version {version} (left unchanged): {exc}"
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
                (run_id, config.task, config.pe, config.kernel, config.seed, config.lr,
                 config.steps, config.preset, json.dumps(config.to_dict()), _now()),
            )

    def record(self, result: RunResult) -> None:
        """Write a finished run (row, original evaluation and its curves, training history)
        in one transaction. The run's re-evaluations are kept."""
        config = result.config
        row = (
            result.run_id, config.task, config.pe, config.kernel, config.seed, config.lr,
            config.steps, config.preset, result.status, result.score, result.train_accuracy,
            json.dumps(config.to_dict()), json.dumps(result.versions), result.device,
            json.dumps(result.timings), json.dumps(result.details, default=str), result.error,
            _now(), _now(),
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
            _delete_evaluation(connection, result.run_id, evaluation_id)
            if result.status == "complete" or result.per_length or result.train_per_length:
                _insert_evaluation(connection, result.run_id, evaluation_id, protocol, result,
                                   is_original=True, device=result.device,
                                   versions=result.versions, timings=result.timings)
            _replace_history(connection, result.run_id, result.history)

    def record_evaluation(self, run_id: str, protocol: dict[str, Any], scores: Scores, *,
                          device: str, versions: dict[str, str],
                          timings: dict[str, float]) -> str:
        """Record a re-evaluation of complete run ``run_id`` under ``protocol`` (a dict like
        ``RunConfig.evaluation_protocol()``) with its ``scores`` in one transaction, replacing
        an earlier one under the same protocol; returns the evaluation id (the protocol's id).
        The curves must cover exactly the protocol's test and in-distribution lengths; the
        exact-match values come all together or not at all."""
        protocol = _checked_protocol(protocol)
        _check_scores(scores, protocol)
        evaluation_id = protocol_id(protocol)
        with self._transaction() as connection:
            run = connection.execute(
                "SELECT status FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if run is None:
                raise CheBenchError(f"no run {run_id!r} in result store {self.path}")
            if run[0] != "complete":
                raise CheBenchError(f"run {run_id} is {run[0]}, not complete: nothing to re-evaluate")
            original = connection.execute(
                "SELECT evaluation_id FROM evaluations WHERE run_id = ? AND is_original = 1",
                (run_id,),
            ).fetchone()
            if original is not None and original[0] == evaluation_id:
                raise CheBenchError(
                    f"protocol {evaluation_id} is the original evaluation of run {run_id}; "
                    "re-evaluate under another protocol"
                )
            _delete_evaluation(connection, run_id, evaluation_id)
            _insert_evaluation(connection, run_id, evaluation_id, protocol, scores,
                               is_original=False, device=device, versions=versions,
                               timings=timings)
        return evaluation_id

    # -- reading -----------------------------------------------------------------------------

    def completed_run_ids(self) -> set[str]:
        with self._connect() as connection:
            rows = connection.execute("SELECT run_id FROM runs WHERE status = 'complete'")
            return {row[0] for row in rows}

    def run_details(self, run_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """What was recorded about each run besides its results (model, pack, tf32, ...)."""
        where, params = _run_filter("r", run_ids)
        with self._connect() as connection:
            rows = connection.execute(f"SELECT r.run_id, r.details FROM runs r {where}", params)
            return {run_id: json.loads(text or "{}") for run_id, text in rows}

    def runs(self, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL) -> pd.DataFrame:
        """One row per run, oldest first; ``kernel`` is None without DAPE. ``score``,
        ``train_accuracy``, ``exact_score``, ``train_exact_accuracy`` (NaN where exact match
        was not recorded) and ``EVALUATION_COLUMNS`` come from ``evaluation``: ``"original"``
        (every run, each with its original evaluation where it has one) or a protocol id (only
        the runs evaluated under it)."""
        run_columns = ", ".join(f"r.{column}" for column in RUN_COLUMNS)
        with self._connect() as connection:
            join, params = self._evaluation_join(connection, evaluation)
            frame = pd.read_sql_query(
                f"""SELECT {run_columns}, e.score, e.train_accuracy, e.exact_score,
                           e.train_exact_accuracy, e.evaluation_id AS evaluation, e.protocol, e.device AS eval_device,
                           e.timings AS eval_timings
                    FROM runs r {join}
                    ORDER BY r.created_at, r.run_id""",
                connection, params=params,
            )
        return _selected(frame, run_ids)

    def per_length(self, run_ids: Iterable[str] | None = None, evaluation: str = ORIGINAL) -> pd.DataFrame:
        """Per-length accuracies of complete runs under ``evaluation`` (as in ``runs``):
        ``accuracy`` and ``exact_accuracy`` (NaN where not recorded), with the evaluation id and
        the run's identifying columns."""
        with self._connect() as connection:
            join, params = self._evaluation_join(connection, evaluation, inner=True)
            frame = pd.read_sql_query(
                f"""SELECT r.run_id, e.evaluation_id AS evaluation, r.task, r.pe, r.kernel,
                           r.seed, r.lr, r.steps, r.preset, a.split, a.length, a.accuracy,
                           a.exact_accuracy
                    FROM runs r {join}
                    JOIN accuracies a
                        ON a.run_id = e.run_id AND a.evaluation_id = e.evaluation_id
                    WHERE r.status = 'complete'
                    ORDER BY r.created_at, r.run_id, a.split, a.length""",
                connection, params=params,
            )
        return _selected(frame, run_ids)

    def history(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Training history rows (``che_bench.train.history.HISTORY_FIELDS``) with their ``run_id``,
        of every run or of ``run_ids``, by run (oldest first) and step; non-finite values read
        back as NaN."""
        where, params = _run_filter("h", run_ids)
        with self._connect() as connection:
            frame = pd.read_sql_query(
                f"""SELECT h.run_id, {', '.join(f'h.{name}' for name in HISTORY_FIELDS)}
                    FROM history h JOIN runs r ON r.run_id = h.run_id {where}
                    ORDER BY r.created_at, r.run_id, h.step""",
                connection, params=params,
            )
        return frame.astype({name: float for name in HISTORY_FIELDS[1:]})

    def lowest_losses(self, run_ids: Iterable[str] | None = None) -> pd.Series:
        """Each run's lowest logged training loss (NaN when every logged loss was not finite),
        indexed by run id, for the runs with a history (of ``run_ids``)."""
        where, params = _run_filter("h", run_ids)
        with self._connect() as connection:
            rows = connection.execute(
                f"SELECT h.run_id, min(h.loss) FROM history h {where} GROUP BY h.run_id", params
            ).fetchall()
        return pd.Series({run_id: math.nan if loss is None else loss for run_id, loss in rows},
                         dtype=float)

    def evaluations(self, run_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per evaluation, oldest first: ``evaluation`` (protocol id), ``run_id``,
        ``original`` (bool), ``protocol`` (a readable summary), ``score``, ``train_accuracy``,
        ``device``, ``versions`` (JSON) and ``created_at``."""
        with self._connect() as connection:
            frame = pd.read_sql_query(
                """SELECT evaluation_id AS evaluation, run_id, is_original AS original, protocol,
                          score, train_accuracy, device, versions, created_at
                   FROM evaluations ORDER BY created_at, run_id, is_original DESC, evaluation_id""",
                connection,
            )
        frame["original"] = frame["original"].astype(bool)
        frame["protocol"] = [describe_protocol(json.loads(text)) for text in frame["protocol"]]
        if run_ids is not None:
            frame = frame[frame["run_id"].isin(set(run_ids))]
        return frame.reset_index(drop=True)

    def _evaluation_join(
        self, connection: sqlite3.Connection, evaluation: str, *, inner: bool = False
    ) -> tuple[str, tuple]:
        """SQL joining ``runs r`` to the chosen evaluation ``e`` of each run, and its parameters;
        an unknown evaluation id is a CheBenchError listing the known ones."""
        if evaluation == ORIGINAL:
            kind = "JOIN" if inner else "LEFT JOIN"
            return f"{kind} evaluations e ON e.run_id = r.run_id AND e.is_original = 1", ()
        known = [row[0] for row in connection.execute(
            "SELECT DISTINCT evaluation_id FROM evaluations ORDER BY evaluation_id"
        )]
        if evaluation not in known:
            listed = ", ".join([ORIGINAL] + known[:20]) + (", ..." if len(known) > 20 else "")
            raise CheBenchError(
                f"unknown evaluation {evaluation!r} in {self.path}; known: {listed} "
                "(see `che-bench evaluations`)"
            )
        return "JOIN evaluations e ON e.run_id = r.run_id AND e.evaluation_id = ?", (evaluation,)


def _run_filter(alias: str, run_ids: Iterable[str] | None) -> tuple[str, tuple]:
    """SQL ``WHERE`` clause restricting table ``alias`` to ``run_ids`` (none: every run), and
    its parameter (one JSON list, however many ids)."""
    if run_ids is None:
        return "", ()
    return f"WHERE {alias}.run_id IN (SELECT value FROM json_each(?))", (json.dumps(list(run_ids)),)


def _schema_version(connection: sqlite3.Connection) -> int | None:
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def _execute_script(connection: sqlite3.Connection, script: str) -> None:
    """Run a schema script statement by statement (``executescript`` would commit the open
    transaction first)."""
    for statement in script.split(";"):
        if statement.strip():
            connection.execute(statement)


def _migrate_1_to_2(connection: sqlite3.Connection) -> None:
    """Schema version 1 -> 2 inside the caller's transaction (see ``_upgrade``)."""
    connection.execute("ALTER TABLE accuracies RENAME TO accuracies_v1")
    _execute_script(connection, _EVALUATIONS_SCHEMA)
    evaluated = connection.execute(
        """SELECT run_id, config, score, train_accuracy, device, versions, timings,
                  coalesce(finished_at, created_at)
           FROM runs
           WHERE status = 'complete' OR run_id IN (SELECT run_id FROM accuracies_v1)"""
    ).fetchall()
    fields = EVALUATION_FIELDS
    for run_id, config_json, score, train_accuracy, device, versions, timings, at in evaluated:
        config = json.loads(config_json)
        protocol = _checked_protocol({name: config[name] for name in fields if name in config}, run_id)
        connection.execute(
            """INSERT INTO evaluations (run_id, evaluation_id, protocol, is_original, score,
                                        train_accuracy, device, versions, timings, created_at)
               VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?)""",
            (run_id, protocol_id(protocol), json.dumps(protocol), score, train_accuracy,
             device, versions, timings, at),
        )
    copied = connection.execute(
        """INSERT INTO accuracies (run_id, evaluation_id, split, length, accuracy)
           SELECT a.run_id, e.evaluation_id, a.split, a.length, a.accuracy
           FROM accuracies_v1 a JOIN evaluations e ON e.run_id = a.run_id AND e.is_original = 1"""
    ).rowcount
    stored = connection.execute("SELECT count(*) FROM accuracies_v1").fetchone()[0]
    if copied != stored:
        raise CheBenchError(f"{stored - copied} stored accuracies belong to no run")
    connection.execute("DROP TABLE accuracies_v1")


def _migrate_2_to_3(connection: sqlite3.Connection) -> None:
    """Schema version 2 -> 3 inside the caller's transaction: every stored evaluation keeps
    its values, without exact match (NULL); runs have no history yet."""
    _execute_script(connection, _EXACT_AND_HISTORY_SCHEMA)


#: The migration from each older schema version to the next one.
_MIGRATIONS = {1: _migrate_1_to_2, 2: _migrate_2_to_3}


def _migrate(connection: sqlite3.Connection, from_version: int) -> None:
    """Schema version ``from_version`` -> ``SCHEMA_VERSION`` inside the caller's transaction."""
    for step in range(from_version, SCHEMA_VERSION):
        _MIGRATIONS[step](connection)
    connection.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                       (str(SCHEMA_VERSION),))
    connection.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                       (f"upgraded_from_{from_version}_at", _now()))


def _checked_protocol(protocol: Any, run_id: str | None = None) -> dict[str, Any]:
    """``protocol`` as plain JSON data with exactly the evaluation fields, or a CheBenchError."""
    whose = f"run {run_id}: " if run_id else ""
    fields = set(EVALUATION_FIELDS)
    if not isinstance(protocol, dict) or set(protocol) != fields:
        given = sorted(protocol) if isinstance(protocol, dict) else type(protocol).__name__
        raise CheBenchError(
            f"{whose}an evaluation protocol has the fields {', '.join(sorted(fields))}; got {given}"
        )
    try:
        return json.loads(json.dumps(protocol))
    except (TypeError, ValueError) as exc:
        raise CheBenchError(f"{whose}evaluation protocol is not JSON data: {exc}") from None


def _check_accuracy(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CheBenchError(f"{name} must be an accuracy in [0, 1], got {value!r}")


def _check_curve(split: str, curve: dict[int, float], lengths: list[int]) -> None:
    """A re-evaluation's curve must hold one accuracy per length of its protocol."""
    if sorted(curve) != sorted(lengths):
        raise CheBenchError(
            f"the {split} accuracies cover lengths {format_lengths(curve)}, the protocol's "
            f"{split} lengths are {format_lengths(lengths)}"
        )
    for length, accuracy in curve.items():
        _check_accuracy(f"{split} accuracy at length {length}", accuracy)


def _delete_evaluation(connection: sqlite3.Connection, run_id: str, evaluation_id: str) -> None:
    connection.execute("DELETE FROM accuracies WHERE run_id = ? AND evaluation_id = ?",
                       (run_id, evaluation_id))
    connection.execute("DELETE FROM evaluations WHERE run_id = ? AND evaluation_id = ?",
                       (run_id, evaluation_id))


def _check_scores(scores: Scores, protocol: dict[str, Any]) -> None:
    """Every accuracy in [0, 1], every curve over exactly the protocol's lengths."""
    checked = [("score", scores.score), ("train_accuracy", scores.train_accuracy)]
    curves = [("test", scores.per_length, "test_lengths"),
              ("in-distribution", scores.train_per_length, "train_eval_lengths")]
    if scores.has_exact_match():
        checked += [("exact_score", scores.exact_score),
                    ("train_exact_accuracy", scores.train_exact_accuracy)]
        curves += [("exact-match test", scores.exact_per_length, "test_lengths"),
                   ("exact-match in-distribution", scores.train_exact_per_length,
                    "train_eval_lengths")]
    for name, value in checked:
        _check_accuracy(name, value)
    for split, curve, lengths in curves:
        _check_curve(split, curve, protocol[lengths])


def _insert_evaluation(connection: sqlite3.Connection, run_id: str, evaluation_id: str,
                       protocol: dict[str, Any], scores: Scores, *, is_original: bool,
                       device: str, versions: dict[str, str], timings: dict[str, float]) -> None:
    connection.execute(
        """INSERT INTO evaluations (run_id, evaluation_id, protocol, is_original, score,
                                    train_accuracy, device, versions, timings, created_at,
                                    exact_score, train_exact_accuracy)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (run_id, evaluation_id, json.dumps(protocol), int(is_original), scores.score,
         scores.train_accuracy, device, json.dumps(versions), json.dumps(timings), _now(),
         scores.exact_score, scores.train_exact_accuracy),
    )
    accuracies = [(run_id, evaluation_id, "test", n, acc, scores.exact_per_length.get(n))
                  for n, acc in scores.per_length.items()]
    accuracies += [(run_id, evaluation_id, "train", n, acc, scores.train_exact_per_length.get(n))
                   for n, acc in scores.train_per_length.items()]
    connection.executemany(
        """INSERT INTO accuracies (run_id, evaluation_id, split, length, accuracy, exact_accuracy)
           VALUES (?, ?, ?, ?, ?, ?)""",
        accuracies,
    )


def _replace_history(connection: sqlite3.Connection, run_id: str,
                     rows: list[dict[str, Any]]) -> None:
    """A run's training history rows, replacing any earlier ones (non-finite values: NULL)."""
    connection.execute("DELETE FROM history WHERE run_id = ?", (run_id,))
    connection.executemany(
        f"INSERT INTO history (run_id, {', '.join(HISTORY_FIELDS)}) "
        f"VALUES (?, {', '.join('?' for _ in HISTORY_FIELDS)})",
        [(run_id, *(_finite_or_none(row[name]) for name in HISTORY_FIELDS)) for row in rows],
    )


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _selected(frame: pd.DataFrame, run_ids: Iterable[str] | None) -> pd.DataFrame:
    """``frame`` with plain-int kernels, restricted to ``run_ids`` when given."""
    frame["kernel"] = _nullable_ints(frame["kernel"])
    if run_ids is not None:
        frame = frame[frame["run_id"].isin(set(run_ids))]
    return frame.reset_index(drop=True)


def _nullable_ints(column: pd.Series) -> pd.Series:
    """SQLite NULLs come back as NaN in a float column; keep None and plain ints instead."""
    values = [None if pd.isna(value) else int(value) for value in column]
    return pd.Series(values, index=column.index, dtype=object)
