"""The SQLite connection every part of the store shares (agent.store.database): one connection behind a lock,
and transactions and queries whose sqlite3 errors become `StoreError`."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StoreError(Exception):
    """The database could not be used (disk full, permissions, locked past the busy timeout)."""


#: What a write transaction that names no tables may have written: every table.
UNKNOWN_TABLES = "*"


class Database:
    """The connection and the two ways the store's parts use it."""

    def __init__(self, path: Path, connection: sqlite3.Connection) -> None:
        self.path = path
        self._db = connection
        self._lock = threading.Lock()
        # Commits through this connection, by table; UNKNOWN_TABLES for a writer that did not say.
        self._own_writes: Counter[str] = Counter()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def change_mark(self, table: str) -> tuple[int, int, int]:
        """A value that differs from the last one asked for whenever `table` may have changed since:
        a commit by any other connection (SQLite's data_version: `gpu-agent ack` writes from its own
        process), or one through this connection that wrote `table` or did not say what it wrote.
        A reader that keeps a table in memory reads it again only then (`TableCache`)."""
        with self._lock:
            try:
                others = int(self._db.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc
            return others, self._own_writes[UNKNOWN_TABLES], self._own_writes[table]

    @contextlib.contextmanager
    def _transaction(self, tables: tuple[str, ...] = (UNKNOWN_TABLES,)) -> Iterator[sqlite3.Connection]:
        """A write transaction; `tables` are those it may write (for `change_mark`), by default any."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc
            try:
                yield self._db
                self._db.execute("COMMIT")
                self._own_writes.update(tables)
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"{self.path}: {exc}") from exc
                raise

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from exc


D = TypeVar("D", bound="Database")


class TableCache(Generic[D, T]):
    """What `read(database)` returned last, read again only when `table` may have changed since
    (`Database.change_mark`) or another database is asked: the loop's reads of tables that change
    once in a while (an ack, a remediation) cost one PRAGMA instead of a query. Its errors are
    `StoreError`, as a read's."""

    def __init__(self, table: str, read: Callable[[D], T]) -> None:
        self.table = table
        self._read = read
        self._last: tuple[D, tuple[int, int, int], T] | None = None

    def get(self, database: D) -> T:
        mark = database.change_mark(self.table)
        last = self._last
        if last is not None and last[0] is database and last[1] == mark:
            return last[2]
        value = self._read(database)
        self._last = (database, mark, value)
        return value
