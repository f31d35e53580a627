"""Kernel-log Xid parser: real-format corpus, multi-line streams, /dev/kmsg records, properties."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.watch import xid_catalog
from agent.watch.kernel_log import (
    KernelLogParser,
    KernelXid,
    NvlinkDecode,
    normalise_pci_bus_id,
    parse_kmsg_record,
    parse_line,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
CORPUS_LINES = (FIXTURES / "kernel-log-corpus.txt").read_text(encoding="utf-8").splitlines()
CORPUS = json.loads((FIXTURES / "kernel-log-corpus.json").read_text(encoding="utf-8"))["cases"]
STREAMS = json.loads((FIXTURES / "kernel-log-streams.json").read_text(encoding="utf-8"))["streams"]


def expected_xid(fields: dict[str, Any], raw: str) -> KernelXid:
    nvlink = fields["nvlink"]
    decoded = None if nvlink is None else NvlinkDecode(**{**nvlink, "debug_data": tuple(nvlink["debug_data"])})
    return KernelXid(**{**fields, "nvlink": decoded, "raw": raw})


def feed_all(lines: list[str]) -> list[KernelXid]:
    parser = KernelLogParser()
    return [event for line in lines for event in parser.feed(line)]


# ---------------------------------------------------------------- corpus


def test_corpus_files_agree() -> None:
    assert [case["line"] for case in CORPUS] == CORPUS_LINES
    positives = [case for case in CORPUS if case["expected"] is not None]
    assert len(positives) >= 40
    assert len(CORPUS) - len(positives) >= 20
    assert all(case["source"] for case in CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[f"line{number}" for number in range(1, len(CORPUS) + 1)])
def test_corpus_line(case: dict[str, Any]) -> None:
    line = case["line"]
    expected = None if case["expected"] is None else expected_xid(case["expected"], line)
    assert parse_line(line) == expected
    # A parser that has seen nothing else gives the same answer.
    assert KernelLogParser().feed(line) == ([] if expected is None else [expected])


def test_corpus_xids_are_all_in_the_catalog() -> None:
    for case in CORPUS:
        if case["expected"] is not None:
            assert xid_catalog.lookup(case["expected"]["xid"]) is not None, case["line"]


def test_corpus_covers_the_required_shapes() -> None:
    positives = [expected_xid(case["expected"], case["line"]) for case in CORPUS if case["expected"] is not None]
    raws = [event.raw for event in positives]
    assert any("(PCI:" not in raw and "Xid (" in raw for raw in raws)  # no PCI: tag
    assert any("(PCI:3b:00)" in raw for raw in raws)  # no domain
    assert any(re.search(r"\(PCI:[0-9a-f:]+\.0\)", raw) for raw in raws)  # with function
    assert any(re.match(r"\[\s*[0-9]+\.[0-9]+\] NVRM", raw) for raw in raws)  # dmesg
    assert any(raw.startswith("[Fri ") for raw in raws)  # dmesg -T
    assert any(re.match(r"[A-Z][a-z]{2} [0-9]{2} [0-9:]{8} \S+ kernel: NVRM", raw) for raw in raws)  # journal
    assert any(re.match(r"[0-9]+,[0-9]+,[0-9]+,-;NVRM", raw) for raw in raws)  # kmsg
    assert any(re.match(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T", raw) for raw in raws)  # ISO syslog
    assert any("pid='<unknown>'" in raw for raw in raws) and any("pid=<unknown>" in raw for raw in raws)
    assert any(event.pid is not None and event.process is None for event in positives)
    assert any(event.pid is None and "pid=" not in event.raw for event in positives)
    assert any(event.nvlink is not None and event.nvlink.fatal for event in positives)
    assert any(event.nvlink is not None and event.nvlink.fatal is False for event in positives)
    assert {event.recovery_action for event in positives} >= {
        "Drain and Reset",
        "GPU Reset Required",
        "Node Reboot Required",
    }
    assert any(event.fallen_off_bus and "Xid" not in event.raw for event in positives)


# ---------------------------------------------------------------- streams


@pytest.mark.parametrize("stream", STREAMS, ids=[stream["name"] for stream in STREAMS])
def test_stream(stream: dict[str, Any]) -> None:
    expected = [expected_xid(fields, fields["raw"]) for fields in stream["expected"]]
    assert feed_all(stream["lines"]) == expected


def test_one_event_when_the_driver_reports_a_lost_gpu_twice() -> None:
    lost = next(stream for stream in STREAMS if stream["name"] == "xid79-then-driver-repeats-fallen-off")
    events = feed_all(lost["lines"])
    assert [(event.xid, event.pci_bus_id, event.pid) for event in events] == [(79, "00000000:05:00.0", 1173)]
    # Without the state, the same lines look like two losses.
    stateless = [event for event in map(parse_line, lost["lines"]) if event is not None]
    assert [event.xid for event in stateless] == [79, 79]


def test_multi_line_record_in_one_feed_call() -> None:
    record = (
        b"3,812,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this"
        b" system has\\x0aNVRM: fallen off the bus and is not responding to commands.\n"
        b" SUBSYSTEM=pci\n DEVICE=+pci:0000:b3:00.0\n"
    )
    parsed = parse_kmsg_record(record)
    assert parsed is not None
    sequence, seconds, message = parsed
    assert (sequence, seconds) == (812, 1843.308145)
    assert message.count("\n") == 2
    events = KernelLogParser().feed(message)
    assert len(events) == 1
    event = events[0]
    assert (event.xid, event.pci_bus_id, event.fallen_off_bus) == (79, "00000000:B3:00.0", True)
    assert event.text == (
        "The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus"
        " and is not responding to commands."
    )
    assert event.raw == message
    assert parse_line(message) == event


def test_header_context_expires() -> None:
    parser = KernelLogParser()
    assert parser.feed("NVRM: The NVIDIA GPU 0000:b3:00.0") == []
    for number in range(3):
        assert parser.feed(f"[ 10.{number}] usb 1-1: new high-speed USB device number {number}") == []
    (event,) = parser.feed("NVRM: GPU has fallen off the bus.")
    assert event.pci_bus_id is None
    assert event.raw == "NVRM: GPU has fallen off the bus."


def test_header_fills_in_a_missing_bus_id() -> None:
    parser = KernelLogParser()
    parser.feed("NVRM: GPU at PCI:0000:5c:00: GPU-0f3e2a71-9d44-4c1b-8e5a-7b6c5d4e3f21")
    parser.feed("NVRM: GPU Board Serial Number: 1320000000009")
    (event,) = parser.feed("NVRM: Xid: 79, GPU has fallen off the bus.")
    assert (event.xid, event.pci_bus_id) == (79, "00000000:5C:00.0")


def test_repeated_xids_other_than_79_are_all_reported() -> None:
    line = "[ 100.000001] NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=python3, Graphics Exception"
    assert len(feed_all([line, line, line])) == 3


def test_lost_gpu_dedup_windows() -> None:
    first = "[ 500.000000] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    # Within seconds on the same GPU: the same loss.
    assert len(feed_all([first, "[ 509.000000] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."])) == 1
    # Far apart in monotonic time: a new loss (after a reboot or a recovered GPU).
    assert len(feed_all([first, "[ 600.000000] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."])) == 2
    # Another GPU at the same instant: another loss.
    assert len(feed_all([first, "[ 500.000000] NVRM: GPU 0000:5e:00.0: GPU has fallen off the bus."])) == 2
    # No timestamps: close lines are the same report, distant lines a new one.
    plain = "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    filler = [f"NVRM: unrelated message {number}" for number in range(20)]
    assert len(feed_all([plain, *filler[:3], plain])) == 1
    assert len(feed_all([plain, *filler, plain])) == 2


def test_feed_ignores_blank_lines_and_line_endings() -> None:
    parser = KernelLogParser()
    assert parser.feed("") == []
    assert parser.feed("\n") == []
    (event,) = parser.feed("NVRM: Xid (PCI:0000:3b:00): 31, pid=5, name=x, MMU Fault\r\n")
    assert event.raw == "NVRM: Xid (PCI:0000:3b:00): 31, pid=5, name=x, MMU Fault"


# `gpu-agent xid parse` reads whatever arrives on stdin: hostile lines must not go quadratic.
PATHOLOGICAL = {
    "spaces after name=": "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=" + " " * 50_000 + "x",
    "unclosed recovery labels": "NVRM: Xid (PCI:0000:3b:00): 154, " + "recovery action changed from 0x0 (" * 5_000,
    "unclosed nvlink registers": "NVRM: Xid (PCI:0000:3b:00): 145, RLW " + "(0x1 " * 10_000,
    "long bracketed prefix": "x: " + "[a] " * 10_000 + "NVRM: Xid (PCI:0000:3b:00): 13, x",
    "long word prefix": "a" * 100_000 + " NVRM: Xid (PCI:0000:3b:00): 13, x",
    "many headers in one record": "NVRM: The NVIDIA GPU 0000:b3:00.0\n" * 5_000,
}


@pytest.mark.parametrize("line", PATHOLOGICAL.values(), ids=PATHOLOGICAL.keys())
def test_pathological_lines_parse_in_linear_time(line: str) -> None:
    start = time.perf_counter()
    KernelLogParser().feed(line)
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------- /dev/kmsg


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            b"4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, b\n",
            (1234, 5.678901, "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, b"),
        ),
        # Continuation lines carry metadata only.
        (b"6,17,1000000,c;hello\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n", (17, 1.0, "hello")),
        # Newer kernels append fields (caller id) after the flags.
        (
            b"6,18,2500000,-,caller=T812;nvidia 0000:3b:00.0: enabling device\n",
            (18, 2.5, "nvidia 0000:3b:00.0: enabling device"),
        ),
        # The kernel escapes backslash and non-printable bytes, UTF-8 included.
        (b"5,19,0,-;caf\\xc3\\xa9 \\x5c path\n", (19, 0.0, "caf\u00e9 \\ path")),
        (b"5,20,7,-;no newline at end", (20, 7e-06, "no newline at end")),
        (b"5,21,7,-;", (21, 7e-06, "")),
    ],
)
def test_parse_kmsg_record(record: bytes, expected: tuple[int, float, str]) -> None:
    assert parse_kmsg_record(record) == expected


@pytest.mark.parametrize(
    "record", [b"", b"\n", b"garbage", b"4,1234;msg", b"4,x,5,-;msg", b" SUBSYSTEM=pci\n", b"4,1,2,-msg\n"]
)
def test_parse_kmsg_record_rejects_non_records(record: bytes) -> None:
    assert parse_kmsg_record(record) is None


def test_kmsg_record_time_reaches_the_event() -> None:
    parser = KernelLogParser()
    records = [
        b"3,900,44643002804,-;NVRM: Xid (PCI:0000:05:00): 79, pid=1173, GPU has fallen off the bus.\n",
        b"3,901,44643002806,-;NVRM: GPU 0000:05:00.0: GPU has fallen off the bus.\n",
        b"4,902,44650000000,-;NVRM: Xid (PCI:0000:05:00): 154, GPU recovery action changed"
        b" from 0x0 (None) to 0x2 (Node Reboot Required)\n",
    ]
    events = []
    for record in records:
        parsed = parse_kmsg_record(record)
        assert parsed is not None
        _, seconds, message = parsed
        events += parser.feed(message, timestamp_seconds=seconds)
    assert [(event.xid, event.timestamp_seconds) for event in events] == [(79, 44643.002804), (154, 44650.0)]
    assert events[1].recovery_action == "Node Reboot Required"
    # A stamp inside the text wins over the one passed in.
    (event,) = KernelLogParser().feed("[ 7.25] NVRM: Xid (PCI:0000:05:00): 13, x", timestamp_seconds=99.0)
    assert event.timestamp_seconds == 7.25


def test_kmsg_prefixed_line_gives_monotonic_seconds() -> None:
    event = parse_line("4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    assert event is not None
    assert event.timestamp_seconds == 5.678901


# ---------------------------------------------------------------- PCI bus ids


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("PCI:0000:3b:00", "00000000:3B:00.0"),
        ("0000:3b:00", "00000000:3B:00.0"),
        ("3b:00", "00000000:3B:00.0"),
        ("3b:00.0", "00000000:3B:00.0"),
        ("0000:3b:00.1", "00000000:3B:00.1"),
        ("PCI:0004:01:00", "00000004:01:00.0"),
        ("0000:10:1c", "00000000:10:1C.0"),
        ("00000000:3B:00.0", "00000000:3B:00.0"),
        ("0000:3B:00.0", "00000000:3B:00.0"),
        ("pci:0018:01:00", "00000018:01:00.0"),
        ("  0000:3b:00  ", "00000000:3B:00.0"),
        ("abcdef12:ff:1f.7", "ABCDEF12:FF:1F.7"),
    ],
)
def test_normalise_pci_bus_id(text: str, expected: str) -> None:
    assert normalise_pci_bus_id(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "3b",
        "0000:3b",
        "0000:3b:20",
        "0000:3b:00.8",
        "1:0:0",
        "123456789:3b:00",
        "0000:3g:00",
        "GPU-1234",
        "10de:26b5",
    ],
)
def test_normalise_pci_bus_id_rejects(text: str) -> None:
    assert normalise_pci_bus_id(text) is None


# ---------------------------------------------------------------- properties

FRAGMENTS = [
    "NVRM: ",
    "NVRM:",
    "Xid",
    " Xid ",
    "(PCI:0000:3b:00)",
    "(0000:3b:00.0)",
    "(PCI:3b:00 GPU-I:01)",
    "(",
    ")",
    ": ",
    ",",
    " ",
    "79",
    "13",
    "154",
    "145",
    "1001",
    "0",
    "pid=",
    "1234",
    "'<unknown>'",
    "name=",
    "python3",
    "GPU has fallen off the bus.",
    "fallen off the bus",
    "GPU 0000:3b:00.0: ",
    "The NVIDIA GPU 0000:b3:00.0",
    "GPU at PCI:0000:05:00: GPU-aaaa",
    "RLW_REMAP Nonfatal XC1 i0 Link 02 (0x00000004 0x00000040 0x0)",
    "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    "\n",
    "[ 12.500000] ",
    "[Sun Nov 29 10:00:00 2026] ",
    "Nov 29 10:00:00 host kernel: ",
    "Nov 29 10:00:00 host app[1]: ",
    "4,1,2500000,-;",
]
kernelish_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=14).map("".join)
any_text = st.one_of(st.text(), kernelish_text, st.binary().map(lambda raw: raw.decode("utf-8", errors="replace")))


def assert_not_invented(line: str, events: list[KernelXid]) -> None:
    if "Xid" not in line and "fallen off the bus" not in line:
        assert events == []
    numbers = {int(digits) for digits in re.findall(r"[0-9]{1,9}", line)}
    for event in events:
        assert event.xid in numbers or (event.xid == 79 and "fallen off the bus" in line)
        assert 1 <= event.xid <= 999
        assert event.fallen_off_bus == (event.xid == 79)
        assert event.pci_bus_id is None or normalise_pci_bus_id(event.pci_bus_id) == event.pci_bus_id


@settings(max_examples=300, deadline=None)
@given(any_text)
def test_parse_line_never_raises_nor_invents(line: str) -> None:
    event = parse_line(line)
    assert_not_invented(line, [] if event is None else [event])


@settings(max_examples=200, deadline=None)
@given(st.lists(any_text, max_size=12))
def test_feed_never_raises_nor_invents(lines: list[str]) -> None:
    parser = KernelLogParser()
    for line in lines:
        assert_not_invented(line, parser.feed(line))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_parse_kmsg_record_never_raises(record: bytes) -> None:
    parsed = parse_kmsg_record(record)
    if parsed is not None:
        sequence, seconds, message = parsed
        assert sequence >= 0 and seconds >= 0
        assert isinstance(message, str)


bus_parts = st.tuples(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))


@given(bus_parts)
def test_normalise_round_trips_nvml_form(parts: tuple[int, int, int, int]) -> None:
    domain, bus, device, function = parts
    nvml = f"{domain:08X}:{bus:02X}:{device:02X}.{function}"
    assert normalise_pci_bus_id(nvml) == nvml
    assert normalise_pci_bus_id(nvml.lower()) == nvml
    assert normalise_pci_bus_id(f"PCI:{domain:04x}:{bus:02x}:{device:02x}.{function}") == nvml
    if function == 0:
        assert normalise_pci_bus_id(f"{domain:04x}:{bus:02x}:{device:02x}") == nvml


@given(st.text(max_size=30))
def test_normalise_is_idempotent(text: str) -> None:
    once = normalise_pci_bus_id(text)
    if once is not None:
        assert normalise_pci_bus_id(once) == once


process_names = st.text(
    alphabet=st.characters(whitelist_categories=("L", "N"), whitelist_characters="_-.:[]"), min_size=1, max_size=15
)
messages = (
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789.:()_", min_size=1, max_size=60)
    .map(str.strip)
    .filter(bool)
)
prefixes = st.sampled_from(
    ["", "[ 12.500000] ", "[Sun Nov 29 10:00:00 2026] ", "Nov 29 10:00:00 gpu-node kernel: ", "6,99,12500000,-;"]
)


@given(
    st.integers(1, 999),
    bus_parts,
    st.one_of(st.none(), st.integers(0, 4_000_000)),
    st.one_of(st.none(), process_names),
    messages,
    prefixes,
)
def test_generated_xid_lines_parse_back(
    code: int,
    parts: tuple[int, int, int, int],
    pid: int | None,
    process: str | None,
    message: str,
    prefix: str,
) -> None:
    domain, bus, device, _ = parts
    fields = ""
    if pid is not None or process is not None:
        fields = f"pid={pid if pid is not None else chr(39) + '<unknown>' + chr(39)}, name={process or '<unknown>'}, "
    line = f"{prefix}NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{device:02x}): {code}, {fields}{message}"
    event = parse_line(line)
    assert event is not None
    assert event.xid == code
    assert event.pci_bus_id == f"{domain:08X}:{bus:02X}:{device:02X}.0"
    assert event.pid == pid
    assert event.process == process
    assert event.text == message
    assert event.raw == line
    assert event.timestamp_seconds == (12.5 if prefix in ("[ 12.500000] ", "6,99,12500000,-;") else None)


def test_a_kernel_record_is_one_unit_whatever_newlines_it_holds() -> None:
    forged = b"3,40,5000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=\\x0aNVRM:Xid:79, Graphics Exception\n"
    parsed = parse_kmsg_record(forged)
    assert parsed is not None
    _, seconds, message = parsed
    (event,) = KernelLogParser().feed_record(message, seconds)
    assert (event.xid, event.pid, event.pci_bus_id) == (13, 4242, "00000000:3B:00.0")
    # The same text split into lines, as the parser used to read it, holds the forged report.
    assert [e.xid for e in KernelLogParser().feed(message)] == [13, 79]


@pytest.mark.parametrize(
    "message",
    [
        "NVRM:Xid:79 [4242]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4",
        "NVRM: Xid: 79, pid=1, name=x, GPU has fallen off the bus.",
        "NVRM: Xid (): 79, pid=1, name=x, GPU has fallen off the bus.",
        'EXT4-fs (loop0): Unrecognized mount option "NVRM: Xid (PCI:0000:3b:00): 43, x" or missing value',
    ],
)
def test_a_kernel_record_needs_the_drivers_whole_xid_report(message: str) -> None:
    assert KernelLogParser().feed_record(message, 1.0) == []


def test_a_kernel_record_keeps_mig_attribution() -> None:
    message = "NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:00): 43, pid=7, name=python3, Ch 00000008"
    (event,) = KernelLogParser().feed_record(message, 2.0)
    assert (event.xid, event.pci_bus_id, event.process, event.timestamp_seconds) == (
        43,
        "00000000:3B:00.0",
        "python3",
        2.0,
    )
