"""The SQLite store on real files: WAL, migrations, corruption recovery, retention, threads."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from action_kinds import ActionKind, action_spec
from helpers import make_event

from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.rules.model import ActionOutcome, Decision, Outcome, Target
from agent.state import RemediationCount, RemediationFailing
from agent.store import schema as schema_module
from agent.store.database import DB_NAME, RETENTION_SECONDS, Store, StoreError
from agent.store.db import TableCache
from agent.store.schema import MIGRATIONS
from agent.store.selector import parse_ack_selector

T0 = 1_780_000_000.0
DAY = 86400.0
UUID = "GPU-5e1b7a3c-0003-4d2e-9f10-6a7b8c9d0e03"
GPU3 = Target(3, UUID)


def event(key: str, at: float = T0, **data: Any) -> Event:
    return make_event(
        EventKind.XID,
        3,
        uuid=UUID,
        message="Xid 48 on GPU 3",
        timestamp_seconds=at,
        source="kmsg",
        key=key,
        suggested_action=SuggestedAction.RESET_GPU,
        **data,
    )


def outcome(
    outcome: Outcome = Outcome.SUCCESS,
    at: float = T0,
    rule: str = "reset",
    step: int = 0,
    action: ActionKind | None = ActionKind.RESET_GPU,
    target: Target = GPU3,
    key: str = "e",
) -> ActionOutcome:
    spec = action_spec(action) if action is not None else None
    decision = Decision(rule, event(key, at), target, spec, step, 1, "because", dry_run=outcome is Outcome.DRY_RUN)
    return ActionOutcome(decision, outcome, "detail", at, at + 2.5)


def sql(path: Path, query: str) -> list[tuple[Any, ...]]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute(query).fetchall()
    finally:
        connection.close()


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        yield opened


# -- file, WAL, schema -------------------------------------------------------------------------


def test_creates_a_wal_database_at_the_current_schema(tmp_path: Path) -> None:
    state = tmp_path / "var" / "lib" / "gpu-agent"
    with Store.open(state, now_seconds=T0) as opened:
        assert opened.path == state / DB_NAME
        opened.record_event(event("a"))
        assert (state / f"{DB_NAME}-wal").exists()  # the write-ahead log, while open
    assert state.stat().st_mode & 0o777 == 0o700
    assert sql(state / DB_NAME, "PRAGMA journal_mode") == [("wal",)]
    assert sql(state / DB_NAME, "PRAGMA user_version") == [(len(MIGRATIONS),)]
    tables = {row[0] for row in sql(state / DB_NAME, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"events", "remediations", "circuits", "acks", "remediation_totals"} <= tables


def test_migrations_run_once_and_keep_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("kept"))
    newer = (*MIGRATIONS, ("ALTER TABLE events ADD COLUMN note TEXT NOT NULL DEFAULT 'migrated'",))
    monkeypatch.setattr(schema_module, "MIGRATIONS", newer)
    for _ in range(2):  # the second open finds nothing left to do
        with Store.open(tmp_path, now_seconds=T0) as opened:
            assert [e.event.key for e in opened.events()] == ["kept"]
    db = tmp_path / DB_NAME
    assert sql(db, "PRAGMA user_version") == [(len(newer),)]
    assert sql(db, "SELECT key, note FROM events") == [("kept", "migrated")]


@pytest.mark.parametrize(
    "failing",
    [
        "ALTER TABLE no_such_table ADD COLUMN x",  # OperationalError
        "INSERT INTO events (key, kind, severity, message, source, suggested_action, data, ts)"
        " VALUES ('kept', 'xid', 'info', '', '', 'none', '{}', 0)",  # IntegrityError
    ],
)
def test_a_failed_migration_is_an_error_and_leaves_the_old_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("kept"))
    broken = (*MIGRATIONS, ("ALTER TABLE events ADD COLUMN note TEXT", failing))
    monkeypatch.setattr(schema_module, "MIGRATIONS", broken)
    with pytest.raises(StoreError):
        Store.open(tmp_path, now_seconds=T0)
    db = tmp_path / DB_NAME
    assert sql(db, "PRAGMA user_version") == [(len(MIGRATIONS),)]
    assert "note" not in {row[1] for row in sql(db, "PRAGMA table_info(events)")}
    assert sql(db, "SELECT key FROM events") == [("kept",)]  # a bug in a migration never costs the history
    assert sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name) == []


def test_a_database_from_a_newer_agent_is_kept_aside(tmp_path: Path) -> None:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("from-the-future"))
    sql(tmp_path / DB_NAME, f"PRAGMA user_version = {len(MIGRATIONS) + 5}")
    with Store.open(tmp_path, now_seconds=T0 + 7) as opened:
        assert opened.events() == []
    aside = tmp_path / f"{DB_NAME}.newer-{int(T0 + 7)}"
    assert sql(aside, "SELECT key FROM events") == [("from-the-future",)]


# -- corruption ---------------------------------------------------------------------------------


def test_a_file_that_is_not_a_database_is_kept_aside(tmp_path: Path) -> None:
    garbage = b"this is not an SQLite database\n" * 200
    (tmp_path / DB_NAME).write_bytes(garbage)
    (tmp_path / f"{DB_NAME}-wal").write_bytes(b"stale log of the broken file")
    with structlog.testing.capture_logs() as logs, Store.open(tmp_path, now_seconds=T0) as opened:
        assert opened.record_event(event("fresh"))
        assert [e.event.key for e in opened.events()] == ["fresh"]
    aside = tmp_path / f"{DB_NAME}.corrupt-{int(T0)}"
    assert aside.read_bytes() == garbage
    assert (tmp_path / f"{DB_NAME}.corrupt-{int(T0)}-wal").read_bytes() == b"stale log of the broken file"
    (logged,) = [entry for entry in logs if entry["event"].startswith("state database unusable")]
    assert logged["log_level"] == "error"
    assert logged["kept_aside"] == str(aside) and "bad header" in logged["error"]


def test_a_damaged_database_is_kept_aside(tmp_path: Path) -> None:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        for n in range(300):
            opened.record_event(event(f"e{n}", message_padding="x" * 500))
    db = tmp_path / DB_NAME
    raw = bytearray(db.read_bytes())
    page_size = sql(db, "PRAGMA page_size")[0][0]
    assert len(raw) > 8 * page_size
    raw[2 * page_size : 6 * page_size] = b"\xa5" * (4 * page_size)  # scribble over b-tree pages
    db.write_bytes(bytes(raw))
    with Store.open(tmp_path, now_seconds=T0) as opened:
        assert opened.events() == []
        assert opened.record_event(event("after"))
    assert (tmp_path / f"{DB_NAME}.corrupt-{int(T0)}").exists()


def test_two_corruptions_in_the_same_second_keep_both(tmp_path: Path) -> None:
    for _ in range(2):
        (tmp_path / DB_NAME).write_bytes(b"garbage" * 1000)
        Store.open(tmp_path, now_seconds=T0).close()
    assert (tmp_path / f"{DB_NAME}.corrupt-{int(T0)}").exists()
    assert (tmp_path / f"{DB_NAME}.corrupt-{int(T0)}.1").exists()


def test_an_unusable_state_dir_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(StoreError, match="file is a regular file, not a directory"):
        Store.open(tmp_path / "file" / "state")


# -- retention ----------------------------------------------------------------------------------


def test_open_prunes_rows_older_than_the_retention_but_keeps_totals(tmp_path: Path) -> None:
    old = T0 - RETENTION_SECONDS - 1
    with Store.open(tmp_path, now_seconds=old) as opened:
        opened.record_event(event("old", at=old))
        opened.record_outcome(outcome(at=old, key="old"))
        opened.record_event(event("recent", at=T0 - DAY))
        opened.record_outcome(outcome(at=T0 - DAY, key="recent"))
    with Store.open(tmp_path, now_seconds=T0) as opened:
        assert [e.event.key for e in opened.events()] == ["recent"]
        assert [r.event_key for r in opened.remediations()] == ["recent"]
        assert opened.remediation_counts() == [RemediationCount("reset", "reset_gpu", "success", 2)]
        # A pruned, handled key is a new event again: thirty days later it is news.
        assert opened.record_event(event("old", at=T0))


# -- events -------------------------------------------------------------------------------------


def test_record_event_says_whether_the_event_still_needs_handling(store: Store, tmp_path: Path) -> None:
    assert store.record_event(event("a")) is True
    assert store.record_event(event("a")) is True  # stored, not handled yet: offered again
    store.mark_handled("a")
    assert store.handled("a")
    assert store.record_event(event("a")) is False
    assert not store.handled("never-seen")
    store.close()
    with Store.open(tmp_path, now_seconds=T0) as reopened:
        assert reopened.record_event(event("a")) is False


def test_events_round_trip_with_data_that_is_not_plain_json(store: Store) -> None:
    @dataclasses.dataclass(frozen=True)
    class Decode:
        unit: str
        link: int

    store.record_event(
        event("a", at=T0, xid=48, nvlink=Decode("RLW", 2), sources=("kmsg", "nvml"), level=Severity.FATAL)
    )
    (stored,) = store.events()
    assert stored.handled is False
    assert stored.event.data == {
        "xid": 48,
        "nvlink": {"unit": "RLW", "link": 2},
        "sources": ["kmsg", "nvml"],
        "level": "fatal",
    }
    assert dataclasses.replace(stored.event, data={}) == dataclasses.replace(event("a"), data={})


def test_rows_an_earlier_agent_wrote_read_back_by_column_name(tmp_path: Path) -> None:
    """The events table is read by column name: a row written by an earlier agent (the same schema,
    its own column order in the INSERT) comes back as the event it stored."""
    Store.open(tmp_path, now_seconds=T0).close()
    connection = sqlite3.connect(tmp_path / DB_NAME)
    with connection:
        connection.execute(
            "INSERT INTO events (ts, data, suggested_action, source, message, uuid, gpu, severity, kind, key, handled)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
            (T0, '{"xid": 48}', "reset_gpu", "kmsg", "Xid 48 on GPU 3", UUID, 3, "critical", "xid", "old-row"),
        )
    connection.close()
    with Store.open(tmp_path, now_seconds=T0) as reopened:
        (stored,) = reopened.events()
    assert stored.handled is True
    assert stored.event == event("old-row", xid=48) and stored.event.data == {"xid": 48}


def test_events_since_and_limit_give_the_newest_oldest_first(store: Store) -> None:
    for n in range(10):
        store.record_event(event(f"e{n}", at=T0 + n))
    assert [e.event.key for e in store.events(since_seconds=T0 + 5)] == ["e5", "e6", "e7", "e8", "e9"]
    assert [e.event.key for e in store.events(limit=3)] == ["e7", "e8", "e9"]


# -- remediations, attempts, circuits -------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "counted"),
    [
        (Outcome.SUCCESS, True),
        (Outcome.FAILED, True),
        (Outcome.REFUSED, True),
        (Outcome.DRY_RUN, True),
        (Outcome.SUPPRESSED, False),
    ],
)
def test_what_counts_as_an_attempt(store: Store, result: Outcome, counted: bool) -> None:
    store.record_outcome(outcome(result, at=T0))
    key = Target(3, UUID).key
    assert store.attempts("reset", key, T0 - 1) == ([T0] if counted else [])
    assert store.last_attempt("reset", key) == (T0 if counted else None)
    (row,) = store.remediations()
    assert (row.outcome, row.counted, row.dry_run) == (result, counted, result is Outcome.DRY_RUN)


def test_a_decision_without_action_never_counts(store: Store) -> None:
    store.record_outcome(outcome(Outcome.SUCCESS, action=None))
    assert store.attempts("reset", Target(3, UUID).key, 0) == []
    assert store.remediation_counts() == [RemediationCount("reset", "none", "success", 1)]


def test_attempts_are_per_rule_and_target_and_window(store: Store) -> None:
    store.record_outcome(outcome(at=T0))
    store.record_outcome(outcome(at=T0 + 10, rule="other"))
    store.record_outcome(outcome(at=T0 + 20, target=Target(2, "GPU-other")))
    store.record_outcome(outcome(at=T0 + 30))
    key = Target(3, UUID).key
    assert store.attempts("reset", key, T0) == [T0, T0 + 30]
    assert store.attempts("reset", key, T0 + 1) == [T0 + 30]
    assert store.last_attempt("reset", key) == T0 + 30


def test_record_outcome_stores_the_decision_and_marks_its_event_handled(store: Store) -> None:
    store.record_outcome(outcome(at=T0, key="synthesized"))
    assert store.handled("synthesized")
    assert store.record_event(event("synthesized")) is False
    (row,) = store.remediations()
    assert (row.rule, row.action, row.params, row.target_key, row.gpu, row.uuid, row.service) == (
        "reset",
        "reset_gpu",
        {},
        f"gpu:{UUID}",
        3,
        UUID,
        None,
    )
    assert (row.started_seconds, row.finished_seconds, row.attempt, row.step, row.reason, row.detail) == (
        T0,
        T0 + 2.5,
        1,
        0,
        "because",
        "detail",
    )


def test_the_exhausted_step_opens_the_circuit_once(store: Store) -> None:
    key = Target(3, UUID).key
    store.record_outcome(outcome(Outcome.SUCCESS, at=T0, step=-1, action=ActionKind.ALERTMANAGER))
    store.record_outcome(outcome(Outcome.SUPPRESSED, at=T0 + 5, step=-1, action=None))
    assert store.circuit_open("reset", key)
    (circuit,) = store.circuits()
    assert (circuit.rule, circuit.target_key, circuit.gpu, circuit.uuid, circuit.opened_seconds) == (
        "reset",
        key,
        3,
        UUID,
        T0,
    )
    assert store.attempts("reset", key, 0) == []  # the on_exhausted actions are not ladder attempts


def test_open_circuit_directly(store: Store) -> None:
    store.open_circuit("r", Target(service="sglang"), "operator says stop", now_seconds=T0)
    assert store.circuit_open("r", "service:sglang")
    assert store.circuits()[0].reason == "operator says stop"


def test_remediation_counts_are_lifetime_totals(store: Store) -> None:
    for result in (Outcome.SUCCESS, Outcome.SUCCESS, Outcome.FAILED):
        store.record_outcome(outcome(result))
    store.record_outcome(outcome(Outcome.SUCCESS, rule="app", action=ActionKind.RESTART_SERVICE))
    assert store.remediation_counts() == [
        RemediationCount("app", "restart_service", "success", 1),
        RemediationCount("reset", "reset_gpu", "failed", 1),
        RemediationCount("reset", "reset_gpu", "success", 2),
    ]


# -- ack ------------------------------------------------------------------------------------------


def test_ack_closes_circuits_retires_attempts_and_keeps_history(store: Store, tmp_path: Path) -> None:
    gpu3, gpu2, svc = Target(3, UUID), Target(2, "GPU-two"), Target(1, "GPU-one", "sglang")
    for rule, target in (("reset", gpu3), ("reset", gpu2), ("app", svc), ("app", gpu3)):
        store.record_outcome(outcome(at=T0, rule=rule, target=target))
        store.record_outcome(outcome(Outcome.SUPPRESSED, at=T0 + 1, rule=rule, target=target, step=-1, action=None))
    assert store.ack("gpu:2", now_seconds=T0 + 10) == 1
    assert not store.circuit_open("reset", gpu2.key) and store.circuit_open("reset", gpu3.key)
    assert store.ack("service:sglang") == 1
    assert store.ack(UUID) == 2  # both rules' state for GPU 3
    assert store.ack("reset") == 0  # nothing left for it
    assert store.circuits() == [] and store.attempts("reset", gpu3.key, 0) == []
    assert len(store.remediations()) == 8
    assert all(r.acked for r in store.remediations() if r.counted)
    assert sql(tmp_path / DB_NAME, "SELECT selector, reset FROM acks ORDER BY id") == [
        ("gpu:2", 1),
        ("service:sglang", 1),
        (UUID, 2),
        ("reset", 0),
    ]


def test_ack_all(store: Store) -> None:
    store.record_outcome(outcome(rule="a"))
    store.record_outcome(outcome(rule="b", step=-1, action=None, outcome=Outcome.SUPPRESSED))
    assert store.ack("all") == 2
    assert store.circuits() == [] and store.ack("all") == 0


def test_ack_reboot_withdraws_the_recommendation_and_all_does_too(store: Store, tmp_path: Path) -> None:
    flag = tmp_path / "reboot-recommended"
    store.record_outcome(outcome(rule="reboot"))  # a rule named like the selector is not re-armed by it
    assert store.acknowledge(parse_ack_selector("reboot"), "boot").reboot is False  # none to withdraw
    flag.write_text('{"reason": "Xid 79"}')
    result = store.acknowledge(parse_ack_selector("reboot"), "boot")
    assert (result.reboot, result.rearmed) == (True, 0)
    assert not flag.exists()
    flag.write_text('{"reason": "Xid 79"}')
    assert store.acknowledge(parse_ack_selector("all"), "boot").reboot is True
    assert not flag.exists()


# -- rules that cannot fix their fault ---------------------------------------------------------------


def test_a_rule_is_failing_from_its_last_failure_until_a_success_or_an_ack(store: Store) -> None:
    """What GpuAgentRemediationFailing fires on: the last finished attempt per target (dry runs,
    interruptions and on_exhausted steps do not count), and a rule whose circuit is open."""
    assert store.failing_rules() == []
    store.record_outcome(outcome(Outcome.FAILED, at=T0, rule="reset"))
    store.record_outcome(outcome(Outcome.REFUSED, at=T0, rule="restart", target=Target(service="sglang")))
    store.record_outcome(outcome(Outcome.DRY_RUN, at=T0, rule="observed"))
    assert store.failing_rules() == [RemediationFailing("reset", "failed"), RemediationFailing("restart", "refused")]
    store.record_outcome(outcome(Outcome.SUCCESS, at=T0 + 60, rule="reset"))  # the next attempt helped
    store.record_outcome(outcome(Outcome.INTERRUPTED, at=T0 + 60, rule="restart", target=Target(service="sglang")))
    assert store.failing_rules() == [RemediationFailing("restart", "refused")]
    # the attempts ran out: the circuit is open until an ack, whatever the last outcome was
    store.record_outcome(outcome(Outcome.SUPPRESSED, at=T0 + 120, rule="reset", step=-1, action=None))
    assert store.failing_rules() == [RemediationFailing("reset", "exhausted"), RemediationFailing("restart", "refused")]
    store.ack("reset")
    store.ack("service:sglang")
    assert store.failing_rules() == []


# -- threads and processes --------------------------------------------------------------------------


def errors_of_threads(writer: Callable[[str], None], names: tuple[str, ...]) -> list[BaseException]:
    """Run writer(name) in a thread per name, all at once; what they raised."""
    errors: list[BaseException] = []

    def guarded(name: str) -> None:
        try:
            writer(name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_concurrent_writers_share_one_store(store: Store) -> None:
    def writer(name: str) -> None:
        for n in range(150):
            store.record_event(event(f"{name}-{n}", at=T0 + n))
            store.record_outcome(outcome(at=T0 + n, rule=name, key=f"{name}-o{n}"))
            store.mark_handled(f"{name}-{n}")
            store.attempts(name, Target(3, UUID).key, 0)

    assert errors_of_threads(writer, ("t1", "t2")) == []
    assert len(store.events(limit=10_000)) == 600  # 300 events plus the 300 outcomes' events
    assert {c.rule: c.count for c in store.remediation_counts()} == {"t1": 150, "t2": 150}


def test_a_table_cache_reads_again_only_after_a_write_that_may_have_changed_its_table(tmp_path: Path) -> None:
    reads: list[str] = []

    def read(store: Store) -> list[RemediationCount]:
        reads.append(str(store.path))
        return store.remediation_counts()

    cache: TableCache[Store, list[RemediationCount]] = TableCache("remediation_totals", read)
    with Store.open(tmp_path, now_seconds=T0) as store, Store.open(tmp_path, now_seconds=T0) as cli:
        assert cache.get(store) == [] and cache.get(store) == []
        store.record_event(event("e1", at=T0))  # writes only the events table, and says so
        assert cache.get(store) == [] and len(reads) == 1
        store.record_outcome(outcome(at=T0, rule="r", key="k1"))  # names no tables: may be any
        assert [c.count for c in cache.get(store)] == [1] and len(reads) == 2
        cli.record_outcome(outcome(at=T0 + 1, rule="r", key="k2"))  # another connection
        assert [c.count for c in cache.get(store)] == [2] and len(reads) == 3
        assert [c.count for c in cache.get(store)] == [2] and len(reads) == 3
        assert [c.count for c in cache.get(cli)] == [2] and len(reads) == 4  # another database


class _WalSwitchLocked(sqlite3.Connection):
    """A real connection whose first `locked_answers` WAL switches answer "database is locked", as
    SQLite's does (without its busy handler) while another connection is switching the new file."""

    locked_answers = 0

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.startswith("PRAGMA journal_mode") and _WalSwitchLocked.locked_answers > 0:
            _WalSwitchLocked.locked_answers -= 1
            raise sqlite3.OperationalError("database is locked")
        return super().execute(sql, *args)


@pytest.fixture
def wal_switch_locked(monkeypatch: pytest.MonkeyPatch) -> type[_WalSwitchLocked]:
    real_connect = sqlite3.connect
    monkeypatch.setattr(
        schema_module.sqlite3,
        "connect",
        lambda *args, **kwargs: real_connect(*args, **kwargs, factory=_WalSwitchLocked),
    )
    return _WalSwitchLocked


def test_a_new_file_being_switched_by_another_connection_is_waited_for(
    tmp_path: Path, wal_switch_locked: type[_WalSwitchLocked]
) -> None:
    wal_switch_locked.locked_answers = 5
    with Store.open(tmp_path, now_seconds=T0) as store:
        store.ack("cli")
    assert wal_switch_locked.locked_answers == 0


def test_a_wal_switch_locked_past_the_busy_timeout_is_an_error(
    tmp_path: Path, wal_switch_locked: type[_WalSwitchLocked], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema_module, "BUSY_TIMEOUT_SECONDS", 0.05)
    wal_switch_locked.locked_answers = 10_000
    with pytest.raises(StoreError, match="database is locked"):
        Store.open(tmp_path, now_seconds=T0)


def test_two_stores_on_one_file_from_two_threads(tmp_path: Path) -> None:
    """The daemon writes while `gpu-agent ack` (another process, another connection) writes too."""

    def writer(name: str) -> None:
        with Store.open(tmp_path, now_seconds=T0) as own:
            for n in range(100):
                own.record_outcome(outcome(at=T0 + n, rule=name, key=f"{name}-{n}"))
                if n % 10 == 0:
                    own.ack(name)

    assert errors_of_threads(writer, ("daemon", "cli")) == []
    with Store.open(tmp_path, now_seconds=T0) as reader:
        assert len(reader.remediations(limit=1000)) == 200
        assert [c.count for c in reader.remediation_counts()] == [100, 100]


def test_the_database_from_before_a_downgrade_is_reused_after_the_next_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older agent (a downgraded package) sets this agent's database aside as newer than its
    schema and starts afresh; the agent of the next upgrade puts the history back, keeps the older
    agent's aside (the newest of those only), and the CLI leaves the files alone."""
    # The agent of the upgrade has one migration more than the older one: the older agent is this
    # code with its own schema (every table it reads is there), the newer one adds a column.
    newer_agent = (*MIGRATIONS, ("ALTER TABLE events ADD COLUMN note TEXT NOT NULL DEFAULT ''",))
    monkeypatch.setattr(schema_module, "MIGRATIONS", newer_agent)
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("before-the-downgrade"))
    for cycle in (1, 2):  # two downgrades and upgrades: no file piles up
        monkeypatch.setattr(schema_module, "MIGRATIONS", MIGRATIONS)
        with Store.open(tmp_path, now_seconds=T0 + 10 * cycle) as opened:
            assert opened.events() == []
            opened.record_event(event(f"during-downgrade-{cycle}"))
        monkeypatch.setattr(schema_module, "MIGRATIONS", newer_agent)
        with Store.open(tmp_path, now_seconds=T0 + 10 * cycle + 1, reuse_newer=False) as cli:
            assert [e.event.key for e in cli.events()] == [f"during-downgrade-{cycle}"]
        with Store.open(tmp_path, now_seconds=T0 + 10 * cycle + 2) as opened:
            assert [e.event.key for e in opened.events()] == ["before-the-downgrade"]
        left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm")))
        assert left == [DB_NAME, f"{DB_NAME}.older-{int(T0 + 10 * cycle + 2)}"]
        aside = tmp_path / left[1]
        assert sql(aside, "SELECT key FROM events") == [(f"during-downgrade-{cycle}",)]


def test_a_current_database_newer_still_is_not_taken_for_the_older_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database from before a downgrade lies aside, and the current one is from a newer agent
    still: that one is set aside as newer, as always, never mistaken for the older agent's."""
    newer_agent = (*MIGRATIONS, ("ALTER TABLE events ADD COLUMN note TEXT NOT NULL DEFAULT ''",))
    monkeypatch.setattr(schema_module, "MIGRATIONS", newer_agent)
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("before-the-downgrade"))
    monkeypatch.setattr(schema_module, "MIGRATIONS", MIGRATIONS)
    Store.open(tmp_path, now_seconds=T0 + 10).close()  # the older agent sets it aside
    monkeypatch.setattr(schema_module, "MIGRATIONS", newer_agent)
    sql(tmp_path / DB_NAME, f"PRAGMA user_version = {len(newer_agent) + 1}")  # a newer agent's still
    with Store.open(tmp_path, now_seconds=T0 + 20) as opened:
        assert opened.events() == []
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm")))
    assert names == [DB_NAME, f"{DB_NAME}.newer-{int(T0 + 10)}", f"{DB_NAME}.newer-{int(T0 + 20)}"]


def test_a_database_still_too_new_stays_aside(tmp_path: Path) -> None:
    with Store.open(tmp_path, now_seconds=T0) as opened:
        opened.record_event(event("from-the-future"))
    sql(tmp_path / DB_NAME, f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    for when in (T0 + 1, T0 + 2):
        with Store.open(tmp_path, now_seconds=when) as opened:
            assert opened.events() == []
    assert (tmp_path / f"{DB_NAME}.newer-{int(T0 + 1)}").exists()
    assert not list(tmp_path.glob(f"{DB_NAME}.older-*"))
