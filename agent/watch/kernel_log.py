"""Kernel-log Xid parser: NVRM lines from dmesg, the journal, syslog or /dev/kmsg -> KernelXid.

Pure functions over the text the caller passes; no I/O. Formats accepted (all seen in the wild):

- ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.``, with or
  without ``PCI:``, without the domain, with a function ``.0``, with MIG ``GPU-I:05 GPU-CI:00``
  attribution, with ``pid='<unknown>'``/``name=<unknown>`` or no pid/name at all.
- prefixes: none, dmesg ``[12345.678901]`` (optionally ``[ T1946]``), ``dmesg -T`` wall-clock brackets,
  journal/syslog ``Nov 29 10:00:00 host kernel:`` and ISO timestamps, /dev/kmsg ``4,1234,5678901,-;``.
- NVLink5 Xids 144-150 (``145, RLW_REMAP Nonfatal XC0 i0 Link 02 (0x... 0x... ...)``) are decoded.
- Xid 154 ``GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)``.
- "fallen off the bus" messages without an Xid number, single-line (``NVRM: GPU 0000:05:00.0: GPU has
  fallen off the bus.``) and multi-line (``NVRM: The NVIDIA GPU 0000:b3:00.0`` / ``NVRM: (PCI ID: ...)
  installed in this system has`` / ``NVRM: fallen off the bus and is not responding to commands.``);
  they become Xid 79. The stateful parser emits one event when the same loss is printed several ways.

Only lines that the kernel wrote count: a line whose syslog sender is not ``kernel`` (say, a program
logging a copy of an Xid line) yields nothing.

A /dev/kmsg record is one unit (:meth:`KernelLogParser.feed_record`): the kernel splits records, and
the bytes it escaped inside one (a newline in a process name arrives as ``\\x0a``) stay data of that
record. A record counts only when its message starts with ``NVRM:`` (the driver's prefix), and an Xid in
a record needs the driver's ``(PCI:...)`` device field: a process name (at most 15 bytes, printed at the
start of messages such as a segfault report) can then not spell a whole Xid report.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from dataclasses import dataclass

from agent.backend.base import MAX_XID
from agent.printable import printable

FALLEN_OFF_BUS_XID = 79  # "GPU has fallen off the bus": only a reboot (or a repair) brings the GPU back
RECOVERY_ACTION_XID = 154
NVLINK5_XIDS = range(144, 151)

# A second report of the same lost GPU arrives within microseconds of the first; a real second loss
# of the same GPU cannot happen before a reboot. These windows only need to separate the two.
_DEDUP_WINDOW_SECONDS = 10.0
_DEDUP_WINDOW_LINES = 16
_DEDUP_MEMORY = 64
# Lines after a header that may still belong to its report: the multi-line fallen-off-the-bus message
# has two more lines; the "GPU at PCI:...: GPU-<uuid>" header is followed by the board serial, then the Xid.
_PENDING_MAX_LINES = 3

_NVRM = "NVRM:"
_FALLEN_OFF_BUS = "fallen off the bus"
_HEX = "[0-9a-fA-F]"
_BDF_PATTERN = rf"(?:{_HEX}{{1,8}}:)?{_HEX}{{2}}:{_HEX}{{2}}(?:\.[0-7])?"

_KMSG_PREFIX = re.compile(r"\s*[0-9]{1,10},[0-9]{1,20},([0-9]{1,20}),[^;]*;", re.ASCII)
_KMSG_RECORD = re.compile(rb"([0-9]{1,10}),([0-9]{1,20}),([0-9]{1,20}),[^;\n]*;")
_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")
_MONOTONIC_STAMP = re.compile(r"\[\s*([0-9]{1,12}\.[0-9]{1,9})\s*\]", re.ASCII)
# "host ident[pid]: " (then maybe "[12345.678] ") right before NVRM: the sender of the line.
_SENDER = re.compile(r"(?:^|\s)([\w.@/-]+)(?:\[[0-9]+\])?:\s*(?:\[[^\]]*\]\s*)*$", re.ASCII)
# A syslog/journal line: timestamp (classic or ISO), optional host, then "ident[pid]: ".
_SYSLOG_HEADER = re.compile(
    r"\s*(?:<[0-9]{1,3}>)?"
    r"(?:[A-Z][a-z]{2}\s+[0-9]{1,2}\s+[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?"
    r"|[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:[.,][0-9]+)?(?:Z|[+-][0-9]{2}:?[0-9]{2})?)"
    r"\s+(?:(?P<ident>[\w.@/-]+)(?:\[[0-9]+\])?:\s|\S+\s+(?P<hosted>[\w.@/-]+)(?:\[[0-9]+\])?:\s)",
    re.ASCII,
)

_XID = re.compile(r"NVRM:\s*Xid\s*(?:\((?P<device>[^)]*)\))?\s*:\s*(?P<code>[0-9]{1,9})(?=,|\s|$)", re.ASCII)
# In a kernel record the driver's device field is required: ``(PCI:0000:3b:00)``, ``(0000:3b:00.0)``, with
# MIG attribution after it. Even its shortest form is longer than a process name can be.
_RECORD_XID = re.compile(
    rf"NVRM:\s*Xid\s*\((?P<device>(?:PCI:)?{_BDF_PATTERN}(?:\s[^)]*)?)\)\s*:\s*(?P<code>[0-9]{{1,9}})(?=,|\s|$)",
    re.ASCII,
)
# A line that starts like an Xid report but whose number is missing, non-numeric or out of range is
# a truncated or corrupt report: it yields nothing rather than a guess.
_XID_LIKE = re.compile(r"NVRM:\s*Xid\b", re.ASCII)
_PID = re.compile(r"pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)\s*(?:,\s*|$)", re.ASCII)
_PID_NUMBER = re.compile(r"[0-9]{1,10}", re.ASCII)
_NAME = re.compile(r"name=(?P<name>[^,]*)(?:,\s*|$)")
_RECOVERY = re.compile(
    r"recovery action changed from\s+0x[0-9a-fA-F]+\s*\([^()]*\)\s*to\s+0x[0-9a-fA-F]+\s*\((?P<to>[^()]*)\)",
    re.ASCII | re.IGNORECASE,
)
_GPU_BDF = re.compile(rf"\bGPU(?:\s+at)?\s+(?:PCI:)?(?P<bdf>{_BDF_PATTERN})\b", re.ASCII)
_HEADER = re.compile(
    rf"NVRM:\s*(?:The NVIDIA GPU\s+(?P<lost>{_BDF_PATTERN})\b|GPU at\s+(?:PCI:)?(?P<at>{_BDF_PATTERN}):\s*GPU-)",
    re.ASCII,
)
_BUS_ID = re.compile(
    rf"(?:[Pp][Cc][Ii]:)?(?:({_HEX}{{1,8}}):)?({_HEX}{{2}}):({_HEX}{{2}})(?:\.([0-7]))?",
    re.ASCII,
)
_NEWLINE = re.compile(r"\r\n|\r|\n")

_NVLINK_UNIT = re.compile(r"(?P<unit>[A-Z][A-Z0-9_]*(?:/[A-Z][A-Z0-9_]*)*)(?=[\s,]|$)", re.ASCII)
_NVLINK_FATAL = re.compile(r"\b(non-?fatal|fatal)\b", re.ASCII | re.IGNORECASE)
_NVLINK_XC = re.compile(r"\bXC([01])\b", re.ASCII)
_NVLINK_INJECTED = re.compile(r"\bi([0-9]{1,3})\b", re.ASCII)
_NVLINK_LINK = re.compile(r"\bLink\s+([0-9]{1,3})\b", re.ASCII)
_NVLINK_REGISTERS = re.compile(r"\(\s*(0x[0-9a-fA-F]{1,16}(?:[\s,]+0x[0-9a-fA-F]{1,16})*)\s*[,]?\s*\)", re.ASCII)
_HEX_WORD = re.compile(r"0x([0-9a-fA-F]{1,16})", re.ASCII)


@dataclass(frozen=True)
class NvlinkDecode:
    """Fields of an NVLink5 Xid (144-150) message, each None when the line lacks it.

    NVIDIA's format: ``<unit> <Fatal|Nonfatal> XC<cross-contain> i<injected> Link <n> (<intrInfo>
    <errorStatus> <errorDebugData...>)``; ``intr_info`` and ``error_status`` feed NVIDIA's decode table.
    """

    unit: str | None
    fatal: bool | None
    cross_contain: bool | None
    injected: bool | None
    link: int | None
    intr_info: int | None
    error_status: int | None
    debug_data: tuple[int, ...]


@dataclass(frozen=True)
class KernelXid:
    """One Xid reported in the kernel log.

    ``text`` is the message after the Xid number with the leading ``pid=``/``name=`` fields removed
    (they are in ``pid``/``process``); for a numberless fallen-off-the-bus report it is the NVRM message.
    ``fallen_off_bus`` is True for every Xid 79, whether the line carried the number or only the words.
    ``timestamp_seconds`` is the kernel's monotonic time (dmesg/kmsg prefix), never wall-clock time.
    """

    xid: int
    pci_bus_id: str | None
    pid: int | None
    process: str | None
    text: str
    nvlink: NvlinkDecode | None
    recovery_action: str | None
    fallen_off_bus: bool
    timestamp_seconds: float | None
    raw: str


def normalise_pci_bus_id(text: str) -> str | None:
    """Any PCI address the driver or NVML prints -> NVML's ``00000000:3B:00.0`` form; None if not one.

    Accepts ``PCI:0000:3b:00``, ``0000:3b:00``, ``3b:00``, ``0000:3b:00.0`` and NVML's own form.
    """
    match = _BUS_ID.fullmatch(text.strip())
    if match is None:
        return None
    domain_hex, bus_hex, device_hex, function = match.groups()
    device = int(device_hex, 16)
    # PCI has 32 devices per bus; a larger number means this was not a bus address at all.
    if device > 0x1F:
        return None
    return f"{int(domain_hex or '0', 16):08X}:{int(bus_hex, 16):02X}:{device:02X}.{function or '0'}"


def parse_kmsg_record(record: bytes) -> tuple[int, float, str] | None:
    """One ``/dev/kmsg`` record -> (sequence number, monotonic seconds, message).

    The record is ``PRI,SEQ,USEC,FLAGS[,...];message`` followed by continuation lines that start with a
    space and carry ``KEY=value`` metadata (dropped). The kernel escapes non-printable bytes as ``\\xNN``
    (so a multi-line printk arrives as one record with ``\\x0a``); they are unescaped here. The message
    may then hold newlines, which are data of this one record: give it to
    :meth:`KernelLogParser.feed_record`, never to ``feed`` (which splits lines). Returns None for anything
    that is not a record.
    """
    first_line = record.partition(b"\n")[0]
    match = _KMSG_RECORD.match(first_line)
    if match is None:
        return None
    body = _KMSG_ESCAPE.sub(lambda escape: bytes([int(escape.group(1), 16)]), first_line[match.end() :])
    return int(match.group(2)), int(match.group(3)) / 1_000_000, body.decode("utf-8", errors="replace")


def parse_line(line: str) -> KernelXid | None:
    """Parse one kernel-log line (or one multi-line record) without context; None when it reports no Xid."""
    events = KernelLogParser().feed(line)
    return events[0] if events else None


@dataclass(frozen=True)
class _Line:
    raw: str
    message: str | None  # from "NVRM:" on; None if the line is not an NVRM line written by the kernel
    timestamp_seconds: float | None


@dataclass
class _Pending:
    """Context from a header line that a following line of the same report may need."""

    bus_id: str | None
    timestamp_seconds: float | None
    raw_lines: list[str]
    fragments: list[str]
    joins_text: bool
    lines_left: int = _PENDING_MAX_LINES


class KernelLogParser:
    """Stateful parser for a stream of kernel-log lines (multi-line reports, duplicate Xid 79 reports)."""

    def __init__(self) -> None:
        self._line_number = 0
        self._pending: _Pending | None = None
        # (bus id, line number, monotonic seconds) of recent Xid 79 events, to drop repeat reports.
        self._recent_lost: deque[tuple[str | None, int, float | None]] = deque(maxlen=_DEDUP_MEMORY)

    def feed(self, line: str, timestamp_seconds: float | None = None) -> list[KernelXid]:
        """Feed one line (a string with embedded newlines is split); returns the Xids it completes.

        ``timestamp_seconds`` is the monotonic time known from outside the text (the /dev/kmsg record
        header, see :func:`parse_kmsg_record`); a stamp inside the line takes precedence.
        """
        events: list[KernelXid] = []
        for piece in _NEWLINE.split(line):
            if piece.strip() == "":
                continue
            event = self._feed_one(piece, timestamp_seconds)
            if event is not None:
                events.append(event)
        return events

    def feed_record(self, message: str, timestamp_seconds: float | None) -> list[KernelXid]:
        """Feed the message of one kernel record (:func:`parse_kmsg_record`); returns the Xids it completes.

        The record is one unit whatever bytes it holds: a newline in it (a process name's, or a
        multi-line printk's) never starts a new line, so text a process controls cannot start a report.
        """
        if not message.startswith(_NVRM):
            # Not a driver message: it still ends any report a header began.
            self._line_number += 1
            self._pending = None
            return []
        event = self._feed_one(message, timestamp_seconds, record=True)
        return [] if event is None else [event]

    def _feed_one(self, piece: str, timestamp_seconds: float | None, record: bool = False) -> KernelXid | None:
        self._line_number += 1
        line = _Line(raw=piece, message=piece, timestamp_seconds=timestamp_seconds) if record else _split_line(piece)
        if line.timestamp_seconds is None and timestamp_seconds is not None:
            line = dataclasses.replace(line, timestamp_seconds=timestamp_seconds)
        pending = self._pending
        if pending is not None:
            pending.lines_left -= 1
            if pending.lines_left < 0:
                self._pending = pending = None
        message = line.message
        if message is None:
            return None
        if _XID_LIKE.match(message) is not None:
            self._pending = None
            xid_match = (_RECORD_XID if record else _XID).match(message)
            event = _xid_event(line, message, xid_match, pending) if xid_match is not None else None
            return self._unless_duplicate(event) if event is not None else None
        if _FALLEN_OFF_BUS in message:
            self._pending = None
            return self._unless_duplicate(_fallen_off_bus_event(line, message, pending))
        header = _HEADER.match(message)
        if header is not None:
            lost = header.group("lost")
            self._pending = _Pending(
                bus_id=normalise_pci_bus_id(lost or header.group("at")),
                timestamp_seconds=line.timestamp_seconds,
                raw_lines=[line.raw],
                fragments=[_fragment(message)],
                joins_text=lost is not None,
            )
        elif pending is not None:
            pending.raw_lines.append(line.raw)
            pending.fragments.append(_fragment(message))
        return None

    def _unless_duplicate(self, event: KernelXid) -> KernelXid | None:
        if event.xid != FALLEN_OFF_BUS_XID:
            return event
        for bus_id, line_number, timestamp in self._recent_lost:
            if bus_id is not None and event.pci_bus_id is not None and bus_id != event.pci_bus_id:
                continue
            if timestamp is not None and event.timestamp_seconds is not None:
                if abs(event.timestamp_seconds - timestamp) <= _DEDUP_WINDOW_SECONDS:
                    return None
            elif self._line_number - line_number <= _DEDUP_WINDOW_LINES:
                return None
        self._recent_lost.append((event.pci_bus_id, self._line_number, event.timestamp_seconds))
        return event


def _split_line(raw: str) -> _Line:
    """Find the NVRM message, the monotonic timestamp and whether the kernel is the sender."""
    start = raw.find(_NVRM)
    if start < 0:
        return _Line(raw=raw, message=None, timestamp_seconds=None)
    prefix = raw[:start]
    timestamp: float | None = None
    kmsg = _KMSG_PREFIX.match(prefix)
    if kmsg is not None:
        timestamp = int(kmsg.group(1)) / 1_000_000
        prefix = prefix[kmsg.end() :]
    if not _sent_by_kernel(prefix):
        return _Line(raw=raw, message=None, timestamp_seconds=None)
    stamps = _MONOTONIC_STAMP.findall(prefix)
    if timestamp is None and stamps:
        timestamp = float(stamps[-1])
    return _Line(raw=raw, message=raw[start:], timestamp_seconds=timestamp)


def _sent_by_kernel(prefix: str) -> bool:
    """False when the text before NVRM names a syslog sender other than the kernel."""
    header = _SYSLOG_HEADER.match(prefix)
    if header is not None and (header.group("ident") or header.group("hosted")) != "kernel":
        return False
    sender = _SENDER.search(prefix)
    return sender is None or sender.group(1) == "kernel"


def _fragment(message: str) -> str:
    text = message.strip()
    return text[len(_NVRM) :].strip() if text.startswith(_NVRM) else text


def _xid_event(line: _Line, message: str, match: re.Match[str], pending: _Pending | None) -> KernelXid | None:
    code = int(match.group("code"))
    if not 1 <= code <= MAX_XID:
        return None
    device = (match.group("device") or "").split()
    bus_id = normalise_pci_bus_id(device[0]) if device else None
    if bus_id is None and pending is not None:
        bus_id = pending.bus_id
    rest = message[match.end() :].lstrip()
    rest = rest[1:].lstrip() if rest.startswith(",") else rest
    pid: int | None = None
    process: str | None = None
    pid_match = _PID.match(rest)
    if pid_match is not None:
        token = pid_match.group("pid")
        pid = int(token) if _PID_NUMBER.fullmatch(token) else None
        rest = rest[pid_match.end() :]
    name_match = _NAME.match(rest)
    if name_match is not None:
        name = name_match.group("name").strip()
        process = name if name and name != "<unknown>" else None
        rest = rest[name_match.end() :]
    text = rest.strip()
    recovery = _RECOVERY.search(text) if code == RECOVERY_ACTION_XID else None
    timestamp = line.timestamp_seconds
    if timestamp is None and pending is not None:
        timestamp = pending.timestamp_seconds
    # What a process controls (its name, text after it) leaves here escaped: nothing downstream
    # (events, logs, status, labels) sees a raw control character or terminal escape.
    return KernelXid(
        xid=code,
        pci_bus_id=bus_id,
        pid=pid,
        process=printable(process) if process is not None else None,
        text=printable(text),
        nvlink=_decode_nvlink(text) if code in NVLINK5_XIDS else None,
        recovery_action=printable(recovery.group("to").strip()) if recovery is not None else None,
        fallen_off_bus=code == FALLEN_OFF_BUS_XID,
        timestamp_seconds=timestamp,
        raw=printable(line.raw),
    )


def _fallen_off_bus_event(line: _Line, message: str, pending: _Pending | None) -> KernelXid:
    own_bus = _GPU_BDF.search(message)
    bus_id = normalise_pci_bus_id(own_bus.group("bdf")) if own_bus is not None else None
    # One multi-line printk (one record) reads as one sentence, like the same report over several records.
    text = " ".join(_fragment(part) for part in _NEWLINE.split(message) if part.strip())
    raw = line.raw
    timestamp = line.timestamp_seconds
    if pending is not None:
        bus_id = bus_id or pending.bus_id
        # Continuation lines of a multi-line printk carry no stamp of their own.
        timestamp = timestamp if timestamp is not None else pending.timestamp_seconds
        if pending.joins_text:
            text = " ".join([*pending.fragments, text])
            raw = "\n".join([*pending.raw_lines, line.raw])
    return KernelXid(
        xid=FALLEN_OFF_BUS_XID,
        pci_bus_id=bus_id,
        pid=None,
        process=None,
        text=printable(text),
        nvlink=None,
        recovery_action=None,
        fallen_off_bus=True,
        timestamp_seconds=timestamp,
        raw=printable(raw, keep_newlines=True),
    )


def _decode_nvlink(text: str) -> NvlinkDecode | None:
    unit = _NVLINK_UNIT.match(text)
    fatal = _NVLINK_FATAL.search(text)
    cross_contain = _NVLINK_XC.search(text)
    injected = _NVLINK_INJECTED.search(text)
    link = _NVLINK_LINK.search(text)
    registers_match = _NVLINK_REGISTERS.search(text)
    registers = [int(word, 16) for word in _HEX_WORD.findall(registers_match.group(1))] if registers_match else []
    if not any((unit, fatal, cross_contain, injected, link, registers)):
        return None
    return NvlinkDecode(
        unit=unit.group("unit") if unit is not None else None,
        fatal=fatal.group(1).lower() == "fatal" if fatal is not None else None,
        cross_contain=cross_contain.group(1) == "1" if cross_contain is not None else None,
        injected=int(injected.group(1)) != 0 if injected is not None else None,
        link=int(link.group(1)) if link is not None else None,
        intr_info=registers[0] if registers else None,
        error_status=registers[1] if len(registers) > 1 else None,
        debug_data=tuple(registers[2:]),
    )
