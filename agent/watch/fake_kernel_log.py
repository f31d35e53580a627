"""Write a fake kernel log under a host_root tree: for tests, ``gpu-agent demo`` and ``gpu-agent inject``.

``append_kmsg`` appends records in /dev/kmsg's own format (``PRI,SEQ,USEC,FLAGS;message``) to
``<host_root>/dev/kmsg``, which ``KmsgSource`` follows like a file. It refuses a character device:
writing into a real /dev/kmsg would put a forged line into the machine's kernel log.
``xid_line`` builds the NVRM line a driver prints for an Xid.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import stat
import time

from agent.host.paths import HostPaths
from agent.watch import xid_catalog
from agent.watch.kernel_log import RECOVERY_ACTION_XID, normalise_pci_bus_id
from agent.watch.kmsg import KMSG_PATH

# Enough of the file's end to hold its last record (records stay far below this).
_TAIL_BYTES = 64 * 1024
_RECORD_SEQUENCE = re.compile(rb"[0-9]{1,10},([0-9]{1,20}),[0-9]{1,20},[^;]*;")
# A FIFO cannot be read back for its last sequence number; records written to one are numbered here.
_fifo_sequence = itertools.count()
_DEFAULT_154_TEXT = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"


def _escape(message: str) -> bytes:
    """Escape as the kernel does for /dev/kmsg: control bytes, bytes >= 0x7f and backslash become \\xNN."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if byte < 0x20 or byte >= 0x7F or byte == 0x5C:
            out += f"\\x{byte:02x}".encode("ascii")
        else:
            out.append(byte)
    return bytes(out)


def _record(sequence: int, level: int, monotonic_seconds: float, message: str) -> bytes:
    usec = int(monotonic_seconds * 1_000_000)
    return f"{level},{sequence},{usec},-;".encode("ascii") + _escape(message) + b"\n"


def _last_sequence(fd: int) -> int | None:
    size = os.fstat(fd).st_size
    tail = os.pread(fd, _TAIL_BYTES, max(0, size - _TAIL_BYTES))
    for line in reversed(tail.split(b"\n")):
        match = _RECORD_SEQUENCE.match(line)
        if match is not None:
            return int(match.group(1))
    return None


def append_kmsg(paths: HostPaths, message: str, level: int = 3, monotonic_seconds: float | None = None) -> None:
    """Append one kernel-facility record to ``<host_root>/dev/kmsg`` (created if missing).

    ``level`` is the syslog level (3 = err, what NVRM uses for Xids); ``monotonic_seconds`` the record's
    kernel timestamp, now (``time.monotonic()``) by default. A multi-line message stays one record, with
    its newlines escaped as the kernel escapes them. Safe against concurrent writers (flock on the file).
    """
    if not 0 <= level <= 7:
        raise ValueError(f"kernel log level must be 0..7, got {level}")
    target = paths.path(KMSG_PATH)
    stamp = time.monotonic() if monotonic_seconds is None else monotonic_seconds
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = 0
    if stat.S_ISCHR(mode):
        raise ValueError(f"{target} is a character device (a real kernel log); refusing to write a fake record")
    if stat.S_ISFIFO(mode):
        # Non-blocking: with no reader the open fails (ENXIO) instead of hanging the caller.
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(fd, _record(next(_fifo_sequence), level, stamp, message))
        finally:
            os.close(fd)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        last = _last_sequence(fd)
        os.write(fd, _record(0 if last is None else last + 1, level, stamp, message))
    finally:
        os.close(fd)


def xid_line(
    pci_bus_id: str,
    xid: int,
    pid: int | None = None,
    process: str | None = None,
    text: str | None = None,
) -> str:
    """The NVRM line a driver prints for an Xid, with the bus id in the kernel's short form.

    ``xid_line("00000000:3B:00.0", 79)`` ->
    ``NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.``
    ``text`` defaults to the catalog name (for 154, a change to "GPU Reset Required").
    """
    normalised = normalise_pci_bus_id(pci_bus_id)
    if normalised is None:
        raise ValueError(f"not a PCI bus id: {pci_bus_id!r}")
    domain, bus, device_function = normalised.split(":")
    device = device_function.split(".")[0]
    short = f"PCI:{int(domain, 16):04x}:{bus.lower()}:{device.lower()}"
    if text is None:
        info = xid_catalog.lookup(xid)
        if xid == RECOVERY_ACTION_XID:
            text = _DEFAULT_154_TEXT
        else:
            text = f"{info.name}." if info is not None else "Unknown error."
    pid_field = str(pid) if pid is not None else "'<unknown>'"
    name_field = process if process is not None else "<unknown>"
    return f"NVRM: Xid ({short}): {xid}, pid={pid_field}, name={name_field}, {text}"
