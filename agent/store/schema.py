"""The database file: its schema (append-only migrations) and opening it. A file that is not a
healthy SQLite database at a schema this agent knows is set aside (its name kept, with the reason
and the time) and a new one started: the agent keeps running on a damaged disk's leftovers. One an
older agent set aside as newer than its schema (a downgrade) is reused by the next agent that
reads that schema."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

from agent.host import file_reads
from agent.logs import get_logger
from agent.store.alerts import ALERTS_MIGRATION
from agent.store.holds import HOLDS_MIGRATION
from agent.store.tunes import TUNES_MIGRATION

log = get_logger()

# Other processes (the CLI: `gpu-agent ack` while the daemon runs) wait this long for the write lock.
BUSY_TIMEOUT_SECONDS = 5.0

#: Schema migrations: MIGRATIONS[n] takes a database from user_version n to n + 1. Append only.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            key TEXT NOT NULL UNIQUE,
            kind TEXT NOT NULL,
            severity TEXT NOT NULL,
            gpu INTEGER,
            uuid TEXT,
            message TEXT NOT NULL,
            source TEXT NOT NULL,
            suggested_action TEXT NOT NULL,
            data TEXT NOT NULL,
            ts REAL NOT NULL,
            handled INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX events_ts ON events (ts)",
        """CREATE TABLE remediations (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,
            finished REAL NOT NULL,
            rule TEXT NOT NULL,
            action TEXT NOT NULL,
            params TEXT NOT NULL,
            target_key TEXT NOT NULL,
            gpu INTEGER,
            uuid TEXT,
            service TEXT,
            event_key TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            step INTEGER NOT NULL,
            outcome TEXT NOT NULL,
            reason TEXT NOT NULL,
            detail TEXT NOT NULL,
            dry_run INTEGER NOT NULL,
            counted INTEGER NOT NULL,
            acked INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX remediations_attempts ON remediations (rule, target_key, ts)",
        "CREATE INDEX remediations_ts ON remediations (ts)",
        """CREATE TABLE circuits (
            rule TEXT NOT NULL,
            target_key TEXT NOT NULL,
            gpu INTEGER,
            uuid TEXT,
            service TEXT,
            opened_at REAL NOT NULL,
            reason TEXT NOT NULL,
            PRIMARY KEY (rule, target_key)
        )""",
        """CREATE TABLE acks (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,
            selector TEXT NOT NULL,
            reset INTEGER NOT NULL
        )""",
        """CREATE TABLE remediation_totals (
            rule TEXT NOT NULL,
            action TEXT NOT NULL,
            outcome TEXT NOT NULL,
            count INTEGER NOT NULL,
            PRIMARY KEY (rule, action, outcome)
        )""",
    ),
    (
        # present: the GPU answered at the daemon's last look. acked: an operator said this missing GPU
        # is gone for good (`gpu-agent ack gpu:UUID`); it is not expected until it answers again.
        """CREATE TABLE gpu_inventory (
            boot_id TEXT NOT NULL,
            uuid TEXT NOT NULL,
            pci_bus_id TEXT NOT NULL,
            model TEXT NOT NULL,
            gpu INTEGER NOT NULL,
            first_seen REAL NOT NULL,
            last_seen REAL NOT NULL,
            present INTEGER NOT NULL,
            acked INTEGER NOT NULL,
            PRIMARY KEY (boot_id, uuid)
        )""",
        # gpu: the NVML index, -1 for an Xid whose GPU could not be named (kernel line, unknown bus id).
        """CREATE TABLE xid_counts (
            boot_id TEXT NOT NULL,
            gpu INTEGER NOT NULL,
            xid INTEGER NOT NULL,
            uuid TEXT NOT NULL,
            count INTEGER NOT NULL,
            last_seen REAL NOT NULL,
            PRIMARY KEY (boot_id, gpu, xid)
        )""",
        """CREATE TABLE xid_marks (
            boot_id TEXT NOT NULL,
            gpu INTEGER NOT NULL,
            xid INTEGER NOT NULL,
            action TEXT NOT NULL,
            reason TEXT NOT NULL,
            seen REAL NOT NULL,
            PRIMARY KEY (boot_id, gpu, xid)
        )""",
    ),
    # The remediation journal: a row is written (outcome "running") before an action starts, its
    # steps are appended as they complete, and the clock readings let cooldowns survive restarts
    # and wall-clock steps (agent.store.attempt_clock).
    (
        "ALTER TABLE remediations ADD COLUMN steps TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE remediations ADD COLUMN boot_id TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE remediations ADD COLUMN boottime REAL",
        "CREATE INDEX remediations_running ON remediations (outcome) WHERE outcome = 'running'",
    ),
    # Node memory, continued: the throttle watcher's time per clock-event reason (a Prometheus
    # counter that must not go down on a restart) and when each slowdown active now started (a
    # "held 60 s" rule keeps its clock); the service prober's failure streaks and verdicts.
    (
        """CREATE TABLE clock_event_totals (
            boot_id TEXT NOT NULL,
            gpu INTEGER NOT NULL,
            uuid TEXT NOT NULL,
            reason TEXT NOT NULL,
            seconds REAL NOT NULL,
            active_since REAL,
            PRIMARY KEY (boot_id, gpu, reason)
        )""",
        # up: the declared state, NULL before the first verdict.
        """CREATE TABLE probe_streaks (
            boot_id TEXT NOT NULL,
            service TEXT NOT NULL,
            up INTEGER,
            consecutive_failures INTEGER NOT NULL,
            PRIMARY KEY (boot_id, service)
        )""",
    ),
    # How long a slowdown has been held is measured on CLOCK_BOOTTIME (a wall-clock step is not time
    # held): its start on that clock, so a restart on the same boot keeps the hold.
    ("ALTER TABLE clock_event_totals ADD COLUMN active_since_boottime REAL",),
    TUNES_MIGRATION,  # the advisor's journal and per-limit history (agent.store.tunes)
    HOLDS_MIGRATION,  # GPU settings a job holds, with the originals to put back (agent.store.holds)
    ALERTS_MIGRATION,  # the alerts the agent pushes to Alertmanager (agent.store.alerts)
)


class Unusable(Exception):
    def __init__(self, label: str, message: str) -> None:
        super().__init__(message)
        self.label = label  # "corrupt" or "newer": the suffix of the file kept aside


_SQLITE_HEADER = b"SQLite format 3\x00"


def _connect(path: Path) -> sqlite3.Connection:
    """A connection to a healthy database at the current schema, or _Unusable."""
    # Checked before connecting: closing the last connection deletes the write-ahead log, and the
    # log of a file that is not a database at all is worth keeping aside with it.
    with contextlib.suppress(FileNotFoundError), file_reads.open_regular(path, follow_links=False) as existing:
        header = existing.read(len(_SQLITE_HEADER))
        if header and header != _SQLITE_HEADER:
            raise Unusable("corrupt", "not an SQLite database (bad header)")
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False)
    try:
        check = connection.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            raise Unusable("corrupt", f"integrity check failed: {'; '.join(str(row[0]) for row in check[:3])}")
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise Unusable("newer", f"schema version {version} is newer than this agent's {len(MIGRATIONS)}")
        mode = _switch_to_wal(connection)
        if mode != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL mode (got {mode})")
        connection.execute("PRAGMA synchronous = NORMAL")  # durable in WAL mode across crashes
    except sqlite3.DatabaseError as exc:
        connection.close()
        if isinstance(exc, sqlite3.OperationalError):  # locked, unreadable: not the file's fault
            raise
        raise Unusable("corrupt", str(exc)) from exc
    except Unusable:
        connection.close()
        raise
    try:
        # A failing migration is a bug in this agent, not a damaged file: an error, never a reason to start over.
        _migrate(connection)
    except BaseException:
        connection.close()
        raise
    return connection


def _switch_to_wal(connection: sqlite3.Connection) -> str:
    """The journal mode after asking for WAL. Switching a new file needs it to itself, and SQLite
    answers "locked" at once, without its busy handler, while another connection (the CLI opening the
    file the daemon has just created) holds it: wait for that here, as long as a write would."""
    deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
    pause_seconds = 0.002
    while True:
        try:
            return str(connection.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause_seconds > deadline:
                raise
        time.sleep(pause_seconds)
        pause_seconds = min(pause_seconds * 2, 0.1)


def connect_or_replace(path: Path, now_seconds: float, reuse_newer: bool = True) -> sqlite3.Connection:
    if reuse_newer:
        _reuse_newer(path, now_seconds)
    try:
        return _connect(path)
    except Unusable as unusable:
        aside = _set_aside(path, unusable.label, now_seconds)
        log.error("state database unusable, kept aside; starting a new one", error=str(unusable), kept_aside=str(aside))
        return _connect(path)


#: Where SQLite keeps `PRAGMA user_version`: 4 big-endian bytes at this offset of the file's header.
_USER_VERSION_OFFSET = 60


def _schema_version(path: Path) -> int | None:
    """The schema version in a database file's header, read without opening it in SQLite (it is not
    this agent's database until it is reused); None when the file is not one."""
    try:
        with file_reads.open_regular(path, follow_links=False) as found:
            header = found.read(_USER_VERSION_OFFSET + 4)
    except OSError:
        return None
    if len(header) < _USER_VERSION_OFFSET + 4 or not header.startswith(_SQLITE_HEADER):
        return None
    return int.from_bytes(header[_USER_VERSION_OFFSET:], "big")


def _reuse_newer(path: Path, now_seconds: float) -> None:
    """A downgraded package's older agent sets this agent's database aside as `NAME.newer-TIME` and
    starts an empty one; the next upgrade brings an agent that reads the schema again: the newest
    such file goes back in place, with the history from before the downgrade, and the database the
    older agent kept meanwhile is set aside as `NAME.older-TIME` (only the newest of those is kept:
    each downgrade leaves one, and they would pile up). A current file this agent cannot read
    either (a newer agent's, a damaged one) is left to the usual setting aside."""
    current = _schema_version(path)
    if path.exists() and (current is None or current > len(MIGRATIONS)):
        return
    reusable = []
    for candidate in path.parent.glob(f"{path.name}.newer-*"):
        if candidate.name.endswith(("-wal", "-shm")):
            continue
        version = _schema_version(candidate)
        if version is not None and version <= len(MIGRATIONS):
            reusable.append((candidate.stat().st_mtime, candidate.name, candidate))
    if not reusable:
        return
    newest = max(reusable)[2]
    older = _set_aside(path, "older", now_seconds) if path.exists() else None
    _move_with_log(newest, path)
    dropped = []
    for previous in path.parent.glob(f"{path.name}.older-*"):
        if older is not None and previous.name.startswith(older.name):
            continue
        previous.unlink()
        dropped.append(previous.name)
    log.warning(
        "state database from before a downgrade reused",
        reused=newest.name,
        kept_aside=None if older is None else older.name,
        removed=sorted(dropped),
    )


def _migrate(connection: sqlite3.Connection) -> None:
    while True:
        connection.execute("BEGIN IMMEDIATE")
        try:
            # Read under the write lock: another process (the CLI) may have migrated since we looked.
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version < len(MIGRATIONS):
                for statement in MIGRATIONS[version]:
                    connection.execute(statement)
                connection.execute(f"PRAGMA user_version = {version + 1}")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")
        if version >= len(MIGRATIONS):
            return
        log.info("state database migrated", schema_version=version + 1)


def _set_aside(path: Path, label: str, now_seconds: float) -> Path:
    aside = path.with_name(f"{path.name}.{label}-{int(now_seconds)}")
    serial = 0
    while aside.exists():
        serial += 1
        aside = path.with_name(f"{path.name}.{label}-{int(now_seconds)}.{serial}")
    _move_with_log(path, aside)
    return aside


def _move_with_log(source: Path, target: Path) -> None:
    """Rename a database file with its write-ahead log and shared memory: the log belongs to its
    file; applied to another one it would corrupt it."""
    source.rename(target)
    for suffix in ("-wal", "-shm"):
        companion = source.with_name(source.name + suffix)
        if companion.exists():
            companion.rename(target.with_name(target.name + suffix))
