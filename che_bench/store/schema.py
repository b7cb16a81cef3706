"""The result store's schema: its tables, its version and the migrations of older versions
(1: one curve per run; 2: no exact match, no training history; 3: no plugin provenance; 4: no
pooled counts, no prefix curve), each run inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from typing import Any

from che_bench.config import EVALUATION_FIELDS, OMITTED_AT_DEFAULT, protocol_id
from che_bench.errors import CheBenchError

APPLICATION_ID = 0x43484542  # "CHEB"
SCHEMA_VERSION = 5

RUNS_SCHEMA = """
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
#: by ``opening._create`` and by the upgrade of a version-1 store.
EVALUATIONS_SCHEMA = """
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
#: they were recorded) and training histories; run by ``opening._create`` and by the upgrade.
EXACT_AND_HISTORY_SCHEMA = """
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
#: What version 4 added to version 3: the plugins a run used, each with its version and source
#: hash (``che_bench.plugins.provenance_of``, JSON; NULL: not recorded).
PLUGINS_SCHEMA = """
ALTER TABLE runs ADD COLUMN plugins TEXT;
"""
#: What version 5 added to version 4: per length the correct and scored positions of all
#: sequences (pooled accuracy, flip-flop's read error), the pooled score, and DeltaProduct's
#: cumulative sequence accuracy by prefix at one length (a JSON list); NULL in evaluations
#: made before; run by ``opening._create`` and by the upgrade.
POOLED_AND_PREFIX_SCHEMA = """
ALTER TABLE evaluations ADD COLUMN pooled_score REAL;
ALTER TABLE evaluations ADD COLUMN train_pooled_accuracy REAL;
ALTER TABLE evaluations ADD COLUMN prefix_length INTEGER;
ALTER TABLE evaluations ADD COLUMN prefix_accuracies TEXT;
ALTER TABLE accuracies ADD COLUMN correct INTEGER;
ALTER TABLE accuracies ADD COLUMN scored INTEGER;
"""
SCHEMA = (
    RUNS_SCHEMA
    + EVALUATIONS_SCHEMA
    + EXACT_AND_HISTORY_SCHEMA
    + PLUGINS_SCHEMA
    + POOLED_AND_PREFIX_SCHEMA
)

#: The ``runs`` columns that copy a run's config, after its ``run_id``.
CONFIG_COLUMNS = ("task", "pe", "kernel", "seed", "lr", "steps", "preset")
#: Columns of ``runs()`` taken from the ``runs`` table; the evaluation shown adds ``score``,
#: ``train_accuracy`` and ``EVALUATION_COLUMNS``.
RUN_COLUMNS = (
    "run_id",
    *CONFIG_COLUMNS,
    "status",
    "device",
    "error",
    "attempts",
    "created_at",
    "finished_at",
    "config",
    "versions",
    "timings",
    "plugins",
)
#: Columns of ``runs()`` that describe the evaluation shown: its id, protocol (JSON), and the
#: device and timings of that evaluation (a re-evaluation may run elsewhere than training).
EVALUATION_COLUMNS = ("evaluation", "protocol", "eval_device", "eval_timings")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def schema_version(connection: sqlite3.Connection) -> int | None:
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def execute_script(connection: sqlite3.Connection, script: str) -> None:
    """Run a schema script statement by statement (``executescript`` would commit the open
    transaction first)."""
    for statement in script.split(";"):
        if statement.strip():
            connection.execute(statement)


def _migrate_1_to_2(connection: sqlite3.Connection) -> None:
    """Schema version 1 -> 2 inside the caller's transaction (see ``opening._upgrade``)."""
    connection.execute("ALTER TABLE accuracies RENAME TO accuracies_v1")
    execute_script(connection, EVALUATIONS_SCHEMA)
    evaluated = connection.execute(
        """SELECT run_id, config, score, train_accuracy, device, versions, timings,
                  coalesce(finished_at, created_at)
           FROM runs
           WHERE status = 'complete' OR run_id IN (SELECT run_id FROM accuracies_v1)"""
    ).fetchall()
    fields = EVALUATION_FIELDS
    for run_id, config_json, score, train_accuracy, device, versions, timings, at in evaluated:
        config = json.loads(config_json)
        protocol = checked_protocol(
            {name: config[name] for name in fields if name in config}, run_id
        )
        connection.execute(
            """INSERT INTO evaluations (run_id, evaluation_id, protocol, is_original, score,
                                        train_accuracy, device, versions, timings, created_at)
               VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?)""",
            (
                run_id,
                protocol_id(protocol),
                json.dumps(protocol),
                score,
                train_accuracy,
                device,
                versions,
                timings,
                at,
            ),
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
    execute_script(connection, EXACT_AND_HISTORY_SCHEMA)


def _migrate_3_to_4(connection: sqlite3.Connection) -> None:
    """Schema version 3 -> 4 inside the caller's transaction: no run has recorded plugins yet
    (NULL; ``StoreReads.run_plugins`` reads the plugin versions their versions name)."""
    execute_script(connection, PLUGINS_SCHEMA)


def _migrate_4_to_5(connection: sqlite3.Connection) -> None:
    """Schema version 4 -> 5 inside the caller's transaction: every stored evaluation keeps
    its values, without pooled counts or prefix curve (NULL)."""
    execute_script(connection, POOLED_AND_PREFIX_SCHEMA)


#: The migration from each older schema version to the next one.
MIGRATIONS = {
    1: _migrate_1_to_2,
    2: _migrate_2_to_3,
    3: _migrate_3_to_4,
    4: _migrate_4_to_5,
}


def migrate(connection: sqlite3.Connection, from_version: int) -> None:
    """Schema version ``from_version`` -> ``SCHEMA_VERSION`` inside the caller's transaction."""
    for step in range(from_version, SCHEMA_VERSION):
        MIGRATIONS[step](connection)
    connection.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
    )
    connection.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        (f"upgraded_from_{from_version}_at", now()),
    )


def checked_protocol(protocol: Any, run_id: str | None = None) -> dict[str, Any]:
    """``protocol`` as plain JSON data with exactly the evaluation fields (those left out of the
    run id at their default: only when not at it), or a CheBenchError."""
    whose = f"run {run_id}: " if run_id else ""
    fields = set(EVALUATION_FIELDS)
    optional = fields & set(OMITTED_AT_DEFAULT)  # absent at their default
    if not isinstance(protocol, dict) or not fields - optional <= set(protocol) <= fields:
        given = sorted(protocol) if isinstance(protocol, dict) else type(protocol).__name__
        raise CheBenchError(
            f"{whose}an evaluation protocol has the fields {', '.join(sorted(fields))}; got {given}"
        )
    # An optional field at its default is no field (as in ``RunConfig.evaluation_protocol``).
    protocol = {
        name: value
        for name, value in protocol.items()
        if not (name in optional and value == OMITTED_AT_DEFAULT[name])
    }
    try:
        return json.loads(json.dumps(protocol))
    except (TypeError, ValueError) as exc:
        raise CheBenchError(f"{whose}evaluation protocol is not JSON data: {exc}") from None
