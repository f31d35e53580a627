"""The push book's life of an alert, on a fake clock and a real store: pending for its `for`, fired
once, resolved when the verdict no longer holds it, delivered and then forgotten; raised at once by a
rule; kept across a restart with no token of a URL in the store."""

from __future__ import annotations

from pathlib import Path

from agent.daemon.alert_book import RAISE_SECONDS, SETTLE_SECONDS, Found, PushBook, url_id
from agent.store.database import Store

URL = "http://am:9093"


class Clock:
    def __init__(self) -> None:
        self.wall = 1_780_000_000.0
        self.boot = 500.0

    def step(self, seconds: float) -> None:
        self.wall += seconds
        self.boot += seconds


def lost(gpu: str = "0", for_seconds: float = 60.0) -> Found:
    return Found("GpuLost", {"alertname": "GpuLost", "gpu": gpu}, {"summary": f"GPU {gpu} lost"}, for_seconds)


def book_on(clock: Clock, store: Store | None = None) -> PushBook:
    return PushBook(lambda: store, "boot-1", clock=lambda: clock.wall, boottime=lambda: clock.boot)


def test_an_alert_waits_its_for_fires_once_and_resolves_when_the_verdict_drops_it() -> None:
    clock = Clock()
    book = book_on(clock)
    assert book.update([lost()], (URL,)) is False  # pending
    assert book.payloads() == {}
    clock.step(59)
    assert book.update([lost()], (URL,)) is False
    clock.step(1)
    assert book.update([lost()], (URL,)) is True  # fired: deliver now
    ((_, body),) = book.payloads()[URL]
    assert (body["labels"], body["annotations"]) == ({"alertname": "GpuLost", "gpu": "0"}, {"summary": "GPU 0 lost"})
    clock.step(30)
    assert book.update([lost()], (URL,)) is False  # still firing: nothing new
    clock.step(1)
    assert book.update([], (URL,)) is True  # resolved
    ((key, body),) = book.payloads()[URL]
    assert body["endsAt"] == "2026-05-28T20:28:11Z"
    book.delivered(URL, [key])
    assert book.active() == [] and book.payloads() == {}


def test_a_condition_that_drops_before_its_for_never_fires() -> None:
    clock = Clock()
    book = book_on(clock)
    book.update([lost()], (URL,))
    clock.step(30)
    assert book.update([], (URL,)) is False
    assert book.active() == []


def test_a_raise_fires_the_matching_alert_at_once_and_expires_unused() -> None:
    clock = Clock()
    book = book_on(clock)
    book.raise_alerts(["GpuLost"], {"gpu": "1", "uuid": "GPU-1"}, overrides={"summary": "raised"})
    # the same name on another GPU is not raised; the raised one's annotations are the rule's
    assert book.update([lost("0"), lost("1")], (URL,)) is True
    assert {row.labels["gpu"]: (row.starts_at is not None, row.annotations["summary"]) for row in book.active()} == {
        "0": (False, "GPU 0 lost"),
        "1": (True, "raised"),
    }
    other = book_on(clock)
    other.raise_alerts(["GpuLost"], {"gpu": "2"})
    clock.step(RAISE_SECONDS + 1)
    assert other.update([lost("2")], (URL,)) is False  # the raise expired before its alert held


def test_an_alert_with_nowhere_to_go_is_not_kept() -> None:
    book = book_on(Clock())
    assert book.update([lost(for_seconds=0)], ()) is False
    assert book.active() == []
    # a rule's step that names its own Alertmanager: that one alert goes there
    book.raise_alerts(["GpuLost"], {"gpu": "0"}, url="http://step-am:9093/?token=secret")
    assert book.update([lost()], ()) is True
    assert list(book.payloads()) == ["http://step-am:9093/?token=secret"]


def test_a_restart_keeps_firing_alerts_settles_before_resolving_and_keeps_no_url(tmp_path: Path) -> None:
    clock = Clock()
    secret = "http://user:pw@am:9093/?token=secret"
    with Store.open(tmp_path / "state") as store:
        book = book_on(clock, store)
        book.update([lost("0", 0), lost("1", 0)], (URL, secret))
        book.update([lost("0", 0)], (URL, secret))  # GPU 1 answers again: its alert resolved
        (resolved,) = [row for row in book.active() if row.ends_at is not None]
        book.delivered(secret, [resolved.key])  # one of the two Alertmanagers has the resolution
        rows = {row.labels["gpu"]: row for row in store.pushed_alerts()}
        assert rows["1"].delivered == (url_id(secret),)
        clock.step(5)
        again = book_on(clock, store)
        assert again.update([], (URL, secret)) is True  # what the last run left is sent again now
        kept = {row.labels["gpu"]: row for row in again.active()}
        assert kept["0"].ends_at is None  # not resolved yet: the first loops may not see all
        assert list(again.payloads()) == [URL, secret] and [k for k, _ in again.payloads()[secret]] == [kept["0"].key]
        clock.step(SETTLE_SECONDS)
        assert again.update([], (URL, secret)) is True  # settled: GPU 0's alert does not hold now
        assert all(row.ends_at is not None for row in again.active())
    database = (tmp_path / "state" / "gpu-agent.db").read_bytes()
    assert b"secret" not in database and b"user:pw" not in database


def test_a_pending_alert_of_another_boot_starts_its_for_again(tmp_path: Path) -> None:
    clock = Clock()
    with Store.open(tmp_path / "state") as store:
        book_on(clock, store).update([lost()], (URL,))
        clock.step(59)
        rebooted = PushBook(lambda: store, "boot-2", clock=lambda: clock.wall, boottime=lambda: 1.0)
        assert rebooted.update([lost()], (URL,)) is False
        assert [row.starts_at for row in rebooted.active()] == [None]
