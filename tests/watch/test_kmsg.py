"""KmsgSource on real files and FIFOs under a tmp host_root, and the fake kernel log writer.

Every test runs a real reader thread; waits are bounded polls. Nothing here touches the real /dev or
the real journal: the journal fallback runs a stand-in script given as the journal command.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from agent.host.paths import HostPaths
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.kernel_log import KernelXid, parse_kmsg_record, parse_line
from agent.watch.kmsg import KmsgSource

WAIT_SECONDS = 1.5
LINE_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


class Reader:
    """A started KmsgSource and what it delivered."""

    def __init__(self, paths: HostPaths, **kwargs: object) -> None:
        self.xids: list[KernelXid] = []
        self._lock = threading.Lock()
        kwargs.setdefault("start_monotonic_seconds", None)
        self.source = KmsgSource(paths, self._sink, **kwargs)  # type: ignore[arg-type]
        self.source.start()

    def _sink(self, xid: KernelXid) -> None:
        with self._lock:
            self.xids.append(xid)

    def codes(self) -> list[int]:
        with self._lock:
            return [x.xid for x in self.xids]

    def wait_codes(self, codes: list[int]) -> None:
        wait_until(lambda: self.codes() == codes, WAIT_SECONDS, lambda: f"Xids {codes} (delivered: {self.codes()})")

    def wait_status(self, text: str) -> None:
        wait_until(
            lambda: text in self.source.status()[1],
            WAIT_SECONDS,
            lambda: f"a status saying {text!r} (status: {self.source.status()})",
        )

    def quiet(self, seconds: float = 0.3) -> list[int]:
        """What was delivered after waiting long enough for the reader to have seen everything written."""
        time.sleep(seconds)
        return self.codes()


@pytest.fixture
def paths(tmp_path: Path) -> HostPaths:
    (tmp_path / "dev").mkdir()
    return HostPaths.at(tmp_path)


@pytest.fixture
def readers() -> Iterator[list[Reader]]:
    started: list[Reader] = []
    yield started
    for reader in started:
        reader.source.stop()


@pytest.fixture
def start(paths: HostPaths, readers: list[Reader]) -> Callable[..., Reader]:
    def make(**kwargs: object) -> Reader:
        reader = Reader(paths, **kwargs)
        readers.append(reader)
        return reader

    return make


def kmsg_file(paths: HostPaths) -> Path:
    return paths.path("/dev/kmsg")


# -- history and ordering -------------------------------------------------------------------------------


def test_records_before_start_are_skipped_and_later_ones_read(paths: HostPaths, start: Callable[..., Reader]) -> None:
    now = time.monotonic()
    append_kmsg(paths, xid_line("0000:3b:00", 13), monotonic_seconds=now - 30)
    append_kmsg(paths, xid_line("0000:3b:00", 31), monotonic_seconds=now - 1)
    reader = start(start_monotonic_seconds=now)
    append_kmsg(paths, xid_line("0000:3b:00", 43))
    reader.wait_codes([43])
    assert reader.quiet() == [43]
    assert reader.xids[0].timestamp_seconds is not None
    assert reader.xids[0].timestamp_seconds >= now
    assert reader.source.status() == (True, f"following {kmsg_file(paths)} (file)")


def test_read_history_reads_every_record(paths: HostPaths, start: Callable[..., Reader]) -> None:
    now = time.monotonic()
    append_kmsg(paths, xid_line("0000:3b:00", 13), monotonic_seconds=now - 30)
    reader = start(start_monotonic_seconds=now, read_history=True)
    append_kmsg(paths, xid_line("0000:3b:00", 43))
    reader.wait_codes([13, 43])
    assert reader.xids[0].timestamp_seconds == pytest.approx(now - 30, abs=1e-5)


def test_default_start_is_when_the_source_is_built(paths: HostPaths, start: Callable[..., Reader]) -> None:
    append_kmsg(paths, xid_line("0000:3b:00", 13))
    time.sleep(0.01)
    reader = start()
    append_kmsg(paths, xid_line("0000:3b:00", 31))
    reader.wait_codes([31])
    assert reader.quiet() == [31]


def test_plain_dmesg_lines_are_parsed_and_filtered_by_their_stamp(
    paths: HostPaths, start: Callable[..., Reader]
) -> None:
    now = time.monotonic()
    with open(kmsg_file(paths), "a", encoding="utf-8") as log:
        log.write(f"[{now - 100:.6f}] {xid_line('0000:3b:00', 13)}\n")
        log.write(f"[{now + 1:.6f}] {xid_line('0000:3b:00', 31)}\n")
        log.write(f"{xid_line('0000:3b:00', 43)}\n")  # no stamp: nothing to filter on
    reader = start(start_monotonic_seconds=now)
    reader.wait_codes([31, 43])


def test_user_facility_records_are_not_kernel_reports(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    usec = int(time.monotonic() * 1_000_000)
    with open(kmsg_file(paths), "a", encoding="utf-8") as log:
        # What `echo ... > /dev/kmsg` produces: facility user (1), level 3 -> priority 11.
        log.write(f"11,5,{usec},-;{LINE_79}\n")
        log.write(f"3,6,{usec},-;{xid_line('0000:3b:00', 13)}\n")
    reader.wait_codes([13])
    assert reader.quiet() == [13]


# -- stream handling -------------------------------------------------------------------------------------


def test_record_split_across_writes_is_read_once_complete(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    record = f"3,1,{int(time.monotonic() * 1_000_000)},-;{LINE_79}\n".encode()
    fd = os.open(kmsg_file(paths), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, record[:25])
        wait_until(lambda: reader.source.status()[0], WAIT_SECONDS, "the reader following the log")
        assert reader.quiet() == []
        os.write(fd, record[25:-1])
        assert reader.quiet() == []
        os.write(fd, record[-1:])
        reader.wait_codes([79])
    finally:
        os.close(fd)
    assert reader.xids[0].pci_bus_id == "00000000:3B:00.0"


def test_metadata_continuation_lines_are_ignored(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    usec = int(time.monotonic() * 1_000_000)
    metadata = " SUBSYSTEM=pci\n DEVICE=+pci:0000:b3:00.0\n"
    with open(kmsg_file(paths), "a", encoding="utf-8") as log:
        log.write(f"3,7,{usec},-;{xid_line('0000:3b:00', 13)}\n{metadata}")
        # Metadata between the lines of one multi-line report must not push its header out of the parser's reach.
        log.write(f"3,8,{usec},-;NVRM: The NVIDIA GPU 0000:b3:00.0\n{metadata}")
        log.write(f"3,9,{usec},-;NVRM: (PCI ID: 10de:2335) installed in this system has\n{metadata}")
        log.write(f"3,10,{usec},-;NVRM: fallen off the bus and is not responding to commands.\n{metadata}")
    reader.wait_codes([13, 79])
    assert reader.quiet() == [13, 79]
    assert reader.xids[1].pci_bus_id == "00000000:B3:00.0"


def test_truncated_file_is_read_from_its_start(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    append_kmsg(paths, xid_line("0000:3b:00", 13, text="Graphics Exception: " + "x" * 300))
    reader.wait_codes([13])
    with open(kmsg_file(paths), "w", encoding="utf-8"):
        pass  # truncate, as `: > kmsg` or logrotate's copytruncate does
    time.sleep(0.25)
    append_kmsg(paths, xid_line("0000:3b:00", 31))
    reader.wait_codes([13, 31])
    assert reader.quiet() == [13, 31]


def test_replaced_file_is_reopened(paths: HostPaths, start: Callable[..., Reader], tmp_path: Path) -> None:
    reader = start()
    append_kmsg(paths, xid_line("0000:3b:00", 13))
    reader.wait_codes([13])
    other = HostPaths.at(tmp_path / "other")
    append_kmsg(other, xid_line("0000:3b:00", 31))
    os.replace(other.path("/dev/kmsg"), kmsg_file(paths))
    reader.wait_codes([13, 31])


def test_fifo_as_the_kernel_log(paths: HostPaths, start: Callable[..., Reader]) -> None:
    os.mkfifo(kmsg_file(paths))
    reader = start()
    wait_until(
        lambda: reader.source.status() == (True, f"following {kmsg_file(paths)} (FIFO)"),
        WAIT_SECONDS,
        "the reader following the FIFO",
    )
    append_kmsg(paths, xid_line("0000:3b:00", 13))
    record = f"3,9,{int(time.monotonic() * 1_000_000)},-;{xid_line('0000:3b:00', 31)}\n".encode()
    fd = os.open(kmsg_file(paths), os.O_WRONLY)
    try:
        os.write(fd, record[:40])
        time.sleep(0.15)
        os.write(fd, record[40:] + record)  # the rest, then a whole second copy in the same write
    finally:
        os.close(fd)
    reader.wait_codes([13, 31, 31])
    # Writers come and go; the reader keeps the FIFO open and sees the next one.
    append_kmsg(paths, xid_line("0000:3b:00", 43))
    reader.wait_codes([13, 31, 31, 43])


def test_fallen_off_bus_printed_as_three_records_is_one_xid_79(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    append_kmsg(paths, "NVRM: The NVIDIA GPU 0000:b3:00.0")
    append_kmsg(paths, "NVRM: (PCI ID: 10de:2335) installed in this system has")
    append_kmsg(paths, "NVRM: fallen off the bus and is not responding to commands.")
    append_kmsg(paths, "NVRM: GPU 0000:b3:00.0: GPU has fallen off the bus.")  # the driver's repeat
    reader.wait_codes([79])
    assert reader.quiet() == [79]
    (xid,) = reader.xids
    assert xid.pci_bus_id == "00000000:B3:00.0"
    assert xid.fallen_off_bus
    assert "installed in this system has fallen off the bus" in xid.text


def test_fallen_off_bus_as_one_multi_line_record_is_one_xid_79(paths: HostPaths, start: Callable[..., Reader]) -> None:
    reader = start()
    append_kmsg(
        paths,
        "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:2335) installed in this system has\n"
        "NVRM: fallen off the bus and is not responding to commands.",
    )
    reader.wait_codes([79])
    assert reader.quiet() == [79]
    assert reader.xids[0].pci_bus_id == "00000000:B3:00.0"


def test_a_failing_sink_does_not_stop_the_reader(paths: HostPaths) -> None:
    delivered: list[int] = []

    def sink(xid: KernelXid) -> None:
        if xid.xid == 13:
            raise RuntimeError("consumer bug")
        delivered.append(xid.xid)

    source = KmsgSource(paths, sink, start_monotonic_seconds=None)
    source.start()
    try:
        append_kmsg(paths, xid_line("0000:3b:00", 13))
        append_kmsg(paths, xid_line("0000:3b:00", 31))
        wait_until(lambda: delivered == [31], WAIT_SECONDS, "Xid 31 delivered")
    finally:
        source.stop()


# -- missing and odd kernel logs --------------------------------------------------------------------------


@pytest.fixture
def fake_journalctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `journalctl` first on PATH that records that it ran: it must not run under a fake host_root."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "journalctl-ran"
    script = bin_dir / "journalctl"
    script.write_text(f"#!/bin/sh\ntouch {marker}\nsleep 5\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return marker


def test_missing_kmsg_under_a_fake_root_is_degraded_without_journalctl(
    paths: HostPaths, start: Callable[..., Reader], fake_journalctl: Path
) -> None:
    reader = start()
    wait_until(lambda: reader.source.status()[1] != "not started", WAIT_SECONDS, "the reader to start")
    ok, detail = reader.source.status()
    assert not ok
    assert str(kmsg_file(paths)) in detail
    assert "No such file" in detail
    assert reader.quiet() == []
    assert not fake_journalctl.exists()
    # A fake log created later is picked up.
    append_kmsg(paths, xid_line("0000:3b:00", 79))
    reader.wait_codes([79])
    assert reader.source.status()[0]
    assert not fake_journalctl.exists()


def test_device_that_reads_end_of_file_is_not_a_kernel_log(paths: HostPaths, start: Callable[..., Reader]) -> None:
    # A container's /dev/null bound over /dev/kmsg: a character device with nothing behind it.
    kmsg_file(paths).symlink_to("/dev/null")
    reader = start()
    reader.wait_status("not a kernel log")
    assert reader.source.status()[0] is False


def test_unreadable_kmsg_is_degraded(paths: HostPaths, start: Callable[..., Reader]) -> None:
    kmsg_file(paths).mkdir()  # opens, but is neither a device nor a file
    reader = start()
    reader.wait_status("neither the kernel log device nor a file")
    assert reader.source.status()[0] is False


def journal_line(message: str, raw_message: bool = False) -> str:
    """What `journalctl -o json --output-fields=MESSAGE,_SOURCE_MONOTONIC_TIMESTAMP` prints for a record;
    `raw_message`: MESSAGE as the array of bytes journalctl prints for text that is not plain UTF-8."""
    value: object = list(message.encode()) if raw_message else message
    return json.dumps({"__CURSOR": "s=1", "MESSAGE": value, "_SOURCE_MONOTONIC_TIMESTAMP": "1500000"})


def journal_script(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "journal.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_journal_command_is_followed_when_kmsg_is_missing(paths: HostPaths, tmp_path: Path) -> None:
    pid_file = tmp_path / "journal.pid"
    argv = journal_script(
        tmp_path,
        f"""
        import os, sys, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        print({journal_line(xid_line("0000:3b:00", 13, pid=12, process="sglang"))!r}, flush=True)
        print({journal_line("NVRM: loading NVIDIA UNIX Open Kernel Module")!r}, flush=True)
        # A process whose name holds a newline: the journal keeps the record whole.
        print({journal_line(xid_line("0000:3b:00", 31, pid=7, process=chr(10) + "NVRM:Xid:79"))!r}, flush=True)
        print("not json", flush=True)
        line = {journal_line(xid_line("0000:3b:00", 43), raw_message=True)!r}
        sys.stdout.write(line[:20]); sys.stdout.flush()
        time.sleep(0.1)
        print(line[20:], flush=True)
        time.sleep(30)
        """,
    )
    delivered: list[KernelXid] = []
    source = KmsgSource(paths, delivered.append, start_monotonic_seconds=None, journal_command=argv)
    source.start()
    try:
        wait_until(lambda: [x.xid for x in delivered] == [13, 31, 43], WAIT_SECONDS, "Xids 13, 31, 43 delivered")
        ok, detail = source.status()
        assert ok
        assert "following" in detail and "journal.py" in detail and "No such file" in detail
        assert (delivered[0].pid, delivered[0].process) == (12, "sglang")
        assert delivered[0].timestamp_seconds == 1.5
        assert delivered[1].pid == 7
        pid = int(pid_file.read_text())
    finally:
        started = time.monotonic()
        source.stop()
    assert time.monotonic() - started < 1.0
    # The journal process was ended and reaped with the source.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_journal_command_that_exits_makes_the_source_degraded(paths: HostPaths, tmp_path: Path) -> None:
    argv = journal_script(
        tmp_path,
        """
        import sys
        sys.stderr.write("No journal files were found.\\n")
        sys.exit(1)
        """,
    )
    source = KmsgSource(paths, lambda xid: None, start_monotonic_seconds=None, journal_command=argv)
    source.start()
    try:
        wait_until(lambda: "exited" in source.status()[1], WAIT_SECONDS, "the journal command to exit")
        ok, detail = source.status()
        assert not ok
        assert "exited with status 1: No journal files were found." in detail
    finally:
        source.stop()


def test_journal_command_that_cannot_run_is_reported(paths: HostPaths, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-journalctl")
    source = KmsgSource(paths, lambda xid: None, start_monotonic_seconds=None, journal_command=[missing])
    source.start()
    try:
        wait_until(lambda: missing in source.status()[1], WAIT_SECONDS, "a status naming the missing command")
        assert source.status()[0] is False
    finally:
        source.stop()


def test_stop_is_prompt(paths: HostPaths) -> None:
    append_kmsg(paths, xid_line("0000:3b:00", 13))
    source = KmsgSource(paths, lambda xid: None, start_monotonic_seconds=None)
    source.start()
    wait_until(lambda: source.status()[0], WAIT_SECONDS, "the reader following the log")
    started = time.monotonic()
    source.stop()
    assert time.monotonic() - started < 0.5
    assert not any(t.name == "xid-kmsg" and t.is_alive() for t in threading.enumerate())


# -- the fake kernel log writer ---------------------------------------------------------------------------


def test_append_kmsg_writes_numbered_kernel_records(paths: HostPaths) -> None:
    before = time.monotonic()
    append_kmsg(paths, "NVRM: first")
    append_kmsg(paths, "NVRM: second\nwith a newline and a \\ backslash and é", level=4)
    lines = kmsg_file(paths).read_bytes().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(b"3,0,")
    assert lines[1].startswith(b"4,1,")
    assert b"\\x0a" in lines[1] and b"\\x5c" in lines[1]
    first = parse_kmsg_record(lines[0])
    second = parse_kmsg_record(lines[1])
    assert first is not None and second is not None
    assert first[0] == 0 and first[2] == "NVRM: first"
    assert before <= first[1] <= time.monotonic()
    assert second[2] == "NVRM: second\nwith a newline and a \\ backslash and é"


def test_append_kmsg_continues_the_sequence_after_other_lines(paths: HostPaths) -> None:
    append_kmsg(paths, "NVRM: one", monotonic_seconds=12.5)
    with open(kmsg_file(paths), "a", encoding="utf-8") as log:
        log.write(" SUBSYSTEM=pci\nplain text\n")
    append_kmsg(paths, "NVRM: two")
    last = parse_kmsg_record(kmsg_file(paths).read_bytes().splitlines()[-1])
    assert last is not None and last[0] == 1
    first = parse_kmsg_record(kmsg_file(paths).read_bytes().splitlines()[0])
    assert first is not None and first[1] == 12.5


def test_append_kmsg_concurrent_writers_keep_records_whole(paths: HostPaths) -> None:
    def write(n: int) -> None:
        for i in range(25):
            append_kmsg(paths, f"NVRM: writer {n} record {i} " + "y" * 200)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    records = [parse_kmsg_record(line) for line in kmsg_file(paths).read_bytes().splitlines()]
    assert all(record is not None for record in records)
    assert sorted(record[0] for record in records if record is not None) == list(range(100))


def test_append_kmsg_creates_the_dev_directory(tmp_path: Path) -> None:
    paths = HostPaths.at(tmp_path / "fresh-root")
    append_kmsg(paths, "NVRM: hello")
    assert stat.S_ISREG(paths.path("/dev/kmsg").stat().st_mode)


def test_append_kmsg_refuses_a_character_device(paths: HostPaths) -> None:
    kmsg_file(paths).symlink_to("/dev/null")
    with pytest.raises(ValueError, match="character device"):
        append_kmsg(paths, "NVRM: nope")


def test_append_kmsg_rejects_a_bad_level(paths: HostPaths) -> None:
    with pytest.raises(ValueError, match=r"0\.\.7"):
        append_kmsg(paths, "NVRM: x", level=8)
    assert not kmsg_file(paths).exists()


def test_append_kmsg_to_a_fifo_without_reader_fails_instead_of_hanging(paths: HostPaths) -> None:
    os.mkfifo(kmsg_file(paths))
    with pytest.raises(OSError):
        append_kmsg(paths, "NVRM: nobody listens")


@pytest.mark.parametrize(
    ("bus", "short"),
    [
        ("00000000:3B:00.0", "PCI:0000:3b:00"),
        ("0000:3b:00", "PCI:0000:3b:00"),
        ("PCI:0001:5d:00", "PCI:0001:5d:00"),
        ("db:00.0", "PCI:0000:db:00"),
    ],
)
def test_xid_line_uses_the_kernel_short_bus_form(bus: str, short: str) -> None:
    assert xid_line(bus, 13).startswith(f"NVRM: Xid ({short}): 13, ")


def test_xid_line_reads_back_through_the_parser() -> None:
    line = xid_line("00000000:5D:00.0", 79, pid=4242, process="python3")
    assert line == "NVRM: Xid (PCI:0000:5d:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
    parsed = parse_line(line)
    assert parsed is not None
    assert (parsed.xid, parsed.pci_bus_id, parsed.pid, parsed.process) == (79, "00000000:5D:00.0", 4242, "python3")
    assert parsed.text == "GPU has fallen off the bus."


def test_xid_line_defaults() -> None:
    assert xid_line("0000:3b:00", 79) == LINE_79
    recovery = parse_line(xid_line("0000:3b:00", 154))
    assert recovery is not None and recovery.recovery_action == "GPU Reset Required"
    unknown = parse_line(xid_line("0000:3b:00", 997, text="Something new"))
    assert unknown is not None and (unknown.xid, unknown.text) == (997, "Something new")
    with pytest.raises(ValueError, match="not a PCI bus id"):
        xid_line("GPU-1234", 13)


# -- records are split only where the kernel splits them ------------------------------------------------


def test_a_newline_in_a_process_name_cannot_forge_a_kernel_record(
    paths: HostPaths, start: Callable[..., Reader]
) -> None:
    reader = start()
    # The kernel escapes the newline of a 12-byte process name as \x0a inside the driver's Xid 13 record.
    append_kmsg(paths, xid_line("0000:3b:00", 13, pid=4242, process="\nNVRM:Xid:79"))
    append_kmsg(paths, xid_line("0000:3b:00", 31, pid=4243, process="\nNVRM:Xid:43,"))
    reader.wait_codes([13, 31])
    assert reader.quiet() == [13, 31]
    assert [(x.pid, x.pci_bus_id) for x in reader.xids] == [(4242, "00000000:3B:00.0"), (4243, "00000000:3B:00.0")]


def test_a_process_name_at_the_start_of_a_kernel_record_is_not_a_driver_report(
    paths: HostPaths, start: Callable[..., Reader]
) -> None:
    reader = start()
    # The kernel's segfault report starts with the process name (at most 15 bytes).
    append_kmsg(paths, "NVRM:Xid:79 [4242]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4", level=6)
    append_kmsg(
        paths, 'EXT4-fs (loop0): Unrecognized mount option "NVRM: Xid (PCI:0000:3b:00): 43, x" or missing value'
    )
    append_kmsg(paths, xid_line("0000:3b:00", 31))
    reader.wait_codes([31])
    assert reader.quiet() == [31]
