"""Follow the kernel log for Xid lines: ``<host_root>/dev/kmsg``, a fake log file, or the journal.

``KmsgSource`` runs one thread that feeds every kernel message through one ``KernelLogParser`` (it is
stateful: the fallen-off-the-bus report spans several lines) and hands each ``KernelXid`` to ``sink``.

What it reads, in order:

- ``/dev/kmsg`` (a character device): one record per ``read()``, which must be given a buffer large
  enough for the whole record or the kernel answers EINVAL; EPIPE means the ring buffer overwrote
  records we had not read yet (counted, logged, reading goes on). A fresh open starts at the oldest
  record still in the buffer, so records stamped before ``start_monotonic_seconds`` are skipped unless
  ``read_history``. Only records of the kernel facility count: anything root writes into /dev/kmsg is
  stamped with the user facility, so a copied Xid line cannot pose as a driver report. Each record is
  parsed as one unit: a newline the kernel escaped inside it (from a process name) is data, not a line.
- a regular file or a FIFO at that path (the fake kernel log of tests, ``gpu-agent demo`` and
  ``gpu-agent inject``): newline-separated records, buffered across reads, followed like ``tail -f``;
  a truncated file is read again from its start, a replaced one is reopened. Lines that are not kmsg
  records (dmesg or syslog text) go to the parser as they are.
- when the path is missing or cannot be read: ``journalctl -k -f -o json --since now`` (the journal's
  kernel messages, one JSON object per record, so a newline inside a record stays data there too;
  run through ``agent.host.processes``: a scrubbed environment, its process group killed on stop),
  but only when host_root is ``/``; under any other root the journal would describe
  the wrong machine. With neither, the source reports itself degraded through ``status()`` and keeps
  looking for the path, so a fake log created later is picked up.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.host.paths import HostPaths
from agent.host.processes import ProcessStream
from agent.logs import get_logger
from agent.watch.kernel_log import KernelLogParser, KernelXid, parse_kmsg_record

log = get_logger()

KMSG_PATH = "/dev/kmsg"
JOURNAL_COMMAND = (
    "journalctl",
    "-k",
    "-f",
    "-o",
    "json",
    "--since",
    "now",
    "--output-fields=MESSAGE,_SOURCE_MONOTONIC_TIMESTAMP",
)
# Large enough for any record (the kernel's limit is 8 KiB with its metadata); smaller buffers get EINVAL.
READ_BUFFER_BYTES = 16 * 1024
# A "line" longer than this in a fake log is garbage, not a record: drop it rather than grow forever.
MAX_LINE_BYTES = 64 * 1024
# How long the thread sleeps or blocks before it looks at the stop flag again; bounds stop() latency.
POLL_SECONDS = 0.1
# How often a missing kernel log path is looked for again (an open() attempt: cheap), and how long a
# journalctl that ended waits before it is started again (a process: not in a tight loop).
PATH_RETRY_SECONDS = 0.25
JOURNAL_RETRY_SECONDS = 5.0
_KERNEL_FACILITY = 0


class KmsgSource:
    """A thread following the kernel log; ``start()``, ``stop()``, ``status()``.

    ``start_monotonic_seconds`` is the agent's start on the kernel's monotonic clock (``time.monotonic()``,
    the clock of kmsg timestamps); None means the moment this source is built. ``journal_command`` is the
    argv that follows the journal's kernel messages when the path cannot be read; the default one runs only
    when host_root is ``/``, an explicit one under any root (the caller vouches that it describes that host).
    """

    def __init__(
        self,
        paths: HostPaths,
        sink: Callable[[KernelXid], object],
        start_monotonic_seconds: float | None,
        read_history: bool = False,
        journal_command: Sequence[str] | None = None,
    ) -> None:
        self._path = paths.path(KMSG_PATH)
        self._sink = sink
        self._start_monotonic_seconds = time.monotonic() if start_monotonic_seconds is None else start_monotonic_seconds
        self._read_history = read_history
        if journal_command is not None:
            self._journal_command: tuple[str, ...] | None = tuple(journal_command)
        elif paths.root.resolve() == Path("/"):
            self._journal_command = JOURNAL_COMMAND
        else:
            self._journal_command = None
        self._parser = KernelLogParser()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # written by stop(): the device wait sleeps until a record or this, not a poll timeout
        self._wake: tuple[int, int] | None = None
        self._state_lock = threading.Lock()
        self._ok = False
        self._detail = "not started"
        self._last_device_sequence: int | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KmsgSource already started")
        self._wake = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="xid-kmsg", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 2.0) -> None:
        """Stop the thread (at once on the kernel log device, within POLL_SECONDS on a file or the
        journal) and end a journalctl it runs."""
        self._stop.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            if self._wake is not None and not self._thread.is_alive():
                for fd in self._wake:
                    os.close(fd)
                self._wake = None

    def status(self) -> tuple[bool, str]:
        """(ok, detail): ok while a kernel log is being followed; detail says which, or what is wrong."""
        with self._state_lock:
            return self._ok, self._detail

    def _set_status(self, ok: bool, detail: str) -> None:
        with self._state_lock:
            changed = (ok, detail) != (self._ok, self._detail)
            self._ok, self._detail = ok, detail
        if changed:
            (log.info if ok else log.warning)("kernel log source", ok=ok, detail=detail)

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                problem = self._follow_path()
            except Exception as exc:  # one broken reader must not end Xid watching for good
                log.exception("kernel log reader failed")
                problem = f"{self._path}: {exc}"
            if self._stop.is_set():
                break
            if problem is None:
                continue
            if self._journal_command is None:
                self._set_status(False, problem)
                self._stop.wait(PATH_RETRY_SECONDS)
                continue
            problem = self._follow_journal(problem, self._journal_command)
            if self._stop.is_set():
                break
            self._set_status(False, problem)
            self._stop.wait(JOURNAL_RETRY_SECONDS)

    def _follow_path(self) -> str | None:
        """Read the kmsg path until stopped or it must be reopened (None) or cannot be read (the reason)."""
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            return f"{self._path}: {exc.strerror or exc}"
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISCHR(mode):
                return self._follow_device(fd)
            if stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
                return self._follow_stream(fd, regular=stat.S_ISREG(mode))
            return f"{self._path}: neither the kernel log device nor a file"
        finally:
            os.close(fd)

    def _follow_device(self, fd: int) -> str | None:
        self._set_status(True, f"reading {self._path} (kernel ring buffer)")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if self._wake is not None:
            poller.register(self._wake[0], select.POLLIN)
        while not self._stop.is_set():
            try:
                record = os.read(fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                # No timeout: an idle node's kernel log costs no wake-ups (stop() writes to the pipe).
                poller.poll(None if self._wake is not None else POLL_SECONDS * 1000)
                continue
            except BrokenPipeError:  # records the kernel overwrote before they were read
                log.warning("kernel log: records were overwritten before they could be read")
                continue
            except OSError as exc:
                return f"{self._path}: read failed: {exc.strerror or exc}"
            if not record:
                # /dev/kmsg never reports end of file; a device that does (a container's /dev/null bound
                # over it) carries no kernel log.
                return f"{self._path}: reads end of file, not a kernel log"
            parsed = parse_kmsg_record(record)
            if parsed is not None:
                # A reopen (after a read error) starts again at the oldest record in the ring buffer;
                # sequence numbers say which of those were handled already.
                if self._last_device_sequence is not None and parsed[0] <= self._last_device_sequence:
                    continue
                self._last_device_sequence = parsed[0]
            self._handle_line(record)
        return None

    def _follow_stream(self, fd: int, regular: bool) -> str | None:
        kind = "file" if regular else "FIFO"
        self._set_status(True, f"following {self._path} ({kind})")
        pending = bytearray()
        opened = os.fstat(fd)
        while not self._stop.is_set():
            try:
                chunk = os.read(fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                chunk = b""
            if chunk:
                pending += chunk
                self._drain_lines(pending)
                continue
            if regular and os.fstat(fd).st_size < os.lseek(fd, 0, os.SEEK_CUR):
                log.info("kernel log truncated; reading it from the start", path=str(self._path))
                os.lseek(fd, 0, os.SEEK_SET)
                pending.clear()
                continue
            if self._replaced(opened):
                return None
            self._stop.wait(POLL_SECONDS)
        return None

    def _replaced(self, opened: os.stat_result) -> bool:
        try:
            now = os.stat(self._path)
        except FileNotFoundError:
            return False  # removed: keep the open file until a new one appears
        return (now.st_ino, now.st_dev) != (opened.st_ino, opened.st_dev)

    def _drain_lines(self, pending: bytearray) -> None:
        while True:
            end = pending.find(b"\n")
            if end < 0:
                if len(pending) > MAX_LINE_BYTES:
                    log.warning(
                        "kernel log: dropped bytes without a newline", path=str(self._path), dropped_bytes=len(pending)
                    )
                    pending.clear()
                return
            line = bytes(pending[:end])
            del pending[: end + 1]
            # A line starting with a space is a record's KEY=value metadata (SUBSYSTEM=, DEVICE=).
            if line.strip() and not line.startswith(b" "):
                self._handle_line(line)

    def _follow_journal(self, kmsg_problem: str, argv: tuple[str, ...]) -> str:
        """Follow the journal until stopped or journalctl ends; returns why it is not followed any more."""
        command = " ".join(argv)
        try:
            # A follower: no deadline; it ends when stopped (its group killed) or when it exits.
            journal = ProcessStream(argv, timeout_seconds=None, separate_errors=True, error_limit_bytes=512)
        except OSError as exc:
            return f"{kmsg_problem}; {argv[0]}: {exc.strerror or exc}"
        self._set_status(True, f"following `{command}` ({kmsg_problem})")
        pending = bytearray()
        with journal:
            while not self._stop.is_set():
                chunk = journal.read_within(READ_BUFFER_BYTES, POLL_SECONDS)
                if chunk == b"":
                    break
                if chunk is not None:
                    pending += chunk
                    self._drain_journal(pending)
        reason = journal.errors().splitlines()
        said = f": {reason[-1]}" if reason else ""
        return f"{kmsg_problem}; `{command}` exited with status {journal.returncode}{said}"

    def _drain_journal(self, pending: bytearray) -> None:
        while True:
            end = pending.find(b"\n")
            if end < 0:
                if len(pending) > MAX_LINE_BYTES:
                    pending.clear()
                return
            line = bytes(pending[:end])
            del pending[: end + 1]
            record = _journal_record(line)
            if record is not None:
                # --since now did the filtering by time; the stamp is for the Xid's own record.
                self._emit(self._parser.feed_record(*record))

    # -- records ------------------------------------------------------------------------------

    def _handle_line(self, line: bytes) -> None:
        parsed = parse_kmsg_record(line)
        if parsed is None:
            xids = self._parser.feed(line.decode("utf-8", errors="replace"))
            self._emit([x for x in xids if self._recent(x.timestamp_seconds)])
            return
        priority = int(line.split(b",", 1)[0])
        if priority >> 3 != _KERNEL_FACILITY:
            return
        _, monotonic_seconds, message = parsed
        if not self._recent(monotonic_seconds):
            return
        self._emit(self._parser.feed_record(message, monotonic_seconds))

    def _recent(self, monotonic_seconds: float | None) -> bool:
        if self._read_history or monotonic_seconds is None:
            return True
        return monotonic_seconds >= self._start_monotonic_seconds

    def _emit(self, xids: list[KernelXid]) -> None:
        for xid in xids:
            try:
                self._sink(xid)
            except Exception:  # a failing consumer must not stop the reader
                log.exception("kernel log sink failed", xid=xid.xid, pci_bus_id=xid.pci_bus_id)


def _journal_record(line: bytes) -> tuple[str, float | None] | None:
    """One line of `journalctl -o json` -> (message, kernel monotonic seconds); None for anything else.

    The journal keeps each kernel record whole, newlines included; MESSAGE is a string, or an array
    of byte values when it is not valid UTF-8."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list) and all(isinstance(b, int) and 0 <= b < 256 for b in message):
        message = bytes(message).decode("utf-8", errors="replace")
    if not isinstance(message, str):
        return None
    stamp = entry.get("_SOURCE_MONOTONIC_TIMESTAMP")
    seconds = int(stamp) / 1_000_000 if isinstance(stamp, str) and stamp.isdecimal() else None
    return message, seconds
