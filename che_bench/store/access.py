"""How ``ResultStore`` connects to its file for reading only, and what it says when a store
cannot be written.

A reader leaves the store's file and its WAL side files (``-wal``, ``-shm``) as they were, so
that a store committed to git stays unmodified and a store in a directory the user cannot
write stays readable. Its connections are ``query_only``, and the first of these that opens:

- while a writer is at work or died mid-way (its ``-wal`` file exists), ``mode=ro``: reads
  through the writer's side files and never checkpoints nor deletes them;
- otherwise read-write: SQLite's side files exist only while the connection is open and are
  removed when it closes, as after any writer (``mode=ro`` would create them and leave them
  behind), and an empty WAL checkpoints nothing into the file;
- where neither opens (a directory the user cannot write: no side file can be created there,
  so no writer can be using the store), ``immutable=1``.

A store of an older schema version is read as it is: copied into memory and upgraded there
(``read_from_upgraded_copy``); only writers upgrade the file.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from che_bench.errors import CheBenchError

#: SQLite's errors for files and directories that this user cannot write or create.
_READ_ONLY_ERROR_NAMES = ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")
_snapshot_numbers = itertools.count()


def is_read_only_error(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite saying the store (or its directory) cannot be written or
    opened by this user."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    name = getattr(exc, "sqlite_errorname", "")  # Python >= 3.11; the messages before
    return (
        name.startswith(_READ_ONLY_ERROR_NAMES)
        or "readonly" in str(exc)
        or "unable to open database file" in str(exc)
    )


def store_error(path: Path, exc: BaseException, otherwise: str) -> CheBenchError:
    """The one-line error for a failed store operation: a store this user cannot write is
    named read-only (never corrupt); any other failure is ``otherwise``."""
    if is_read_only_error(exc):
        return CheBenchError(
            f"result store {path} is read-only for this user (its file or directory cannot be "
            "written); the readers (runs, table, export, plot, report, curves) can still read it"
        )
    return CheBenchError(otherwise)


class ReadOnlyAccess:
    """Connections that only read the store at ``path`` (see the module docstring)."""

    def __init__(self, path: Path, busy_timeout_s: float) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._uri: str | None = None  # the first candidate that opened, once one has
        self._snapshot: sqlite3.Connection | None = None  # keeps an upgraded copy alive

    def connect(self) -> sqlite3.Connection:
        if self._uri is not None:
            return self._open(self._uri)
        *fallbacks, last = self._candidate_uris()
        for uri in fallbacks:
            connection = self._open(uri)
            try:
                connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError as exc:
                if is_read_only_error(exc):
                    connection.close()
                    continue
            except sqlite3.DatabaseError:
                pass  # not a database: the caller's first read reports it
            self._uri = uri
            return connection
        self._uri = last
        return self._open(last)

    def read_from_upgraded_copy(self, upgrade: Callable[[sqlite3.Connection], None]) -> None:
        """Serve every later connection from an in-memory copy of the store that ``upgrade``
        (inside one transaction) has brought to the current schema; the file is not touched."""
        uri = f"file:che-bench-store-{next(_snapshot_numbers)}?mode=memory&cache=shared"
        snapshot = sqlite3.connect(uri, uri=True, isolation_level=None)
        with closing(self.connect()) as source:
            source.backup(snapshot)
        snapshot.execute("BEGIN")
        upgrade(snapshot)
        snapshot.execute("COMMIT")
        self._snapshot, self._uri = snapshot, uri

    def _candidate_uris(self) -> list[str]:
        uri = self.path.absolute().as_uri()
        writer_at_work = self.path.with_name(self.path.name + "-wal").exists()
        first = f"{uri}?mode=ro" if writer_at_work else f"{uri}?mode=rw"
        return list(dict.fromkeys([first, f"{uri}?mode=ro", f"{uri}?immutable=1"]))

    def _open(self, uri: str) -> sqlite3.Connection:
        connection = sqlite3.connect(
            uri, uri=True, timeout=self._busy_timeout_s, isolation_level=None
        )
        connection.execute("PRAGMA query_only = ON")
        return connection
