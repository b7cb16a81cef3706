"""Opening a result store's file: recognising it as a che-bench store, creating it when new
or empty, and upgrading an older schema (the file, for writing; an in-memory copy, for
reading). Anything that is not a che-bench store is refused and never written."""

from __future__ import annotations

import sqlite3
import time
from functools import partial
from pathlib import Path

from che_bench.errors import CheBenchError
from che_bench.store.access import ReadOnlyAccess, store_error
from che_bench.store.schema import (
    APPLICATION_ID,
    MIGRATIONS,
    SCHEMA,
    SCHEMA_VERSION,
    execute_script,
    migrate,
    now,
    schema_version,
)

#: How long a connection waits for another process's write before it gives up.
BUSY_TIMEOUT_S = 60.0
#: The first bytes of every SQLite database file (the SQLite file format, section 1.3).
SQLITE_HEADER = b"SQLite format 3\x00"


def unreadable_file_message(path: Path, exc: BaseException) -> str:
    """Why SQLite cannot read the file at ``path``: an SQLite database (it begins with the
    SQLite header) that is damaged or truncated, or a file that is no SQLite database."""
    try:
        with open(path, "rb") as file:
            sqlite_file = file.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        sqlite_file = False
    if sqlite_file:
        return (
            f"result store {path} is damaged or truncated (an SQLite database that SQLite "
            f"cannot read: {exc}); refusing to touch it: restore it from a copy, or give "
            "another --store"
        )
    return f"{path} is not a che-bench result store (not an SQLite database); refusing to touch it"


def open_or_create(
    connection: sqlite3.Connection, path: Path, reading: ReadOnlyAccess | None
) -> None:
    """Check the file at ``path`` is a che-bench store (for writing, ``reading`` None:
    creating it when new or empty, upgrading it from an older version); never write to
    anything else."""
    try:
        # One read transaction: a store that another process is creating right now is
        # seen either whole or not at all (two separate reads could see its tables but
        # not yet its application id, and refuse it as foreign).
        connection.execute("BEGIN")
        application_id = connection.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
        connection.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        raise store_error(path, exc, unreadable_file_message(path, exc)) from None
    if application_id == 0 and not tables:
        if reading is not None:
            raise CheBenchError(f"{path} is empty: not a che-bench result store yet")
        _create(connection, path)
    elif application_id != APPLICATION_ID or "meta" not in tables:
        raise CheBenchError(
            f"{path} is an SQLite file of another application, not a che-bench "
            "result store; refusing to touch it"
        )
    _adopt_schema(connection, path, reading, schema_version(connection))


def _adopt_schema(
    connection: sqlite3.Connection, path: Path, reading: ReadOnlyAccess | None, version: int | None
) -> None:
    """Make an older schema ``version`` readable: upgrade the store (for writing) or an
    in-memory copy of it (for reading); refuse an unknown one."""
    if version in MIGRATIONS and reading is not None:
        reading.read_from_upgraded_copy(partial(migrate, from_version=version))
    elif version in MIGRATIONS:
        _upgrade(connection, path, version)
    elif version != SCHEMA_VERSION:
        raise CheBenchError(
            f"result store {path} has schema version {version}, "
            f"this che-bench reads versions 1 to {SCHEMA_VERSION}"
        )


def _create(connection: sqlite3.Connection, path: Path) -> None:
    _enable_wal(connection, path)
    try:
        connection.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        raise store_error(path, exc, f"cannot write result store {path}: {exc}") from None
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


def _enable_wal(connection: sqlite3.Connection, path: Path) -> None:
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
                raise store_error(path, exc, f"cannot write result store {path}: {exc}") from None
        time.sleep(0.01)


def _upgrade(connection: sqlite3.Connection, path: Path, version: int) -> None:
    """Upgrade a store of an older schema ``version`` in place, through every later
    version (``MIGRATIONS``), in one transaction. Any failure (or a crash) leaves the
    store as it was."""
    try:
        connection.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        raise store_error(
            path,
            exc,
            f"result store {path} has schema version {version} and "
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
                path,
                exc,
                f"cannot upgrade result store {path} from schema "
                f"version {version} (left unchanged): {exc}",
            ) from None
        raise
    connection.execute("COMMIT")
