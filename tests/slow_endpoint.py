"""An HTTP endpoint that misbehaves on purpose, run as its own process by the tests.

    python slow_endpoint.py drip                # answers one byte every --interval seconds, forever
    python slow_endpoint.py silent [--answer N]  # accepts and never answers (after answering N requests)
    python slow_endpoint.py file --body PATH     # answers every request 200 with PATH's bytes, read anew
    python slow_endpoint.py chaos [--seed N]     # answers each request with one of CHAOS, drawn at random
    python slow_endpoint.py churn [--series N]   # a page whose every family has new label values each request
    python slow_endpoint.py raw --body PATH      # answers every request with PATH's bytes: status line and all

It prints its port on the first line of stdout once it listens, then one line per event:
`request N` when it has read a request, `gone N` when the client of request N went away
(a write failed or the connection closed).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
DRIP = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Padding: " + b"x" * 10_000


E2E = "sglang:e2e_request_latency_seconds"


def _page(buckets: list[tuple[str, str]], count: str, extra: str = "") -> bytes:
    lines = [f"# TYPE {E2E} histogram"] + [f'{E2E}_bucket{{le="{le}"}} {value}' for le, value in buckets]
    return ("\n".join([*lines, f"{E2E}_count {count}", f"{E2E}_sum 1", extra]) + "\n").encode()


def _good_page(number: int) -> bytes:
    done = number * 10
    return _page(
        [("0.5", str(done // 2)), ("1", str(done)), ("+Inf", str(done))], str(done), "sglang:num_running_reqs 3"
    )


def churned_page(number: int, series: int, every_family: bool = True) -> bytes:
    """A page whose series each carry a label value this request has never had (a server that puts
    a request id or a timestamp in a label): of every family the agent reads (sglang's names), or
    of the generated-token counter only."""
    lines = [f"# TYPE {E2E} histogram"]
    for rank in range(series):
        label = f'request="{number}-{rank}"'
        lines.append(f"sglang:generation_tokens_total{{{label}}} {number}")
        if every_family:
            lines += [f'{E2E}_bucket{{{label},le="{le}"}} {number}' for le in ("0.5", "1", "+Inf")]
            lines += [f"{E2E}_count{{{label}}} {number}", f"{E2E}_sum{{{label}}} {number}"]
            lines += [f"sglang:{name}{{{label}}} 1" for name in ("num_running_reqs", "num_queue_reqs", "token_usage")]
    return ("\n".join(lines) + "\n").encode()


#: What a hostile server answers, one per request in chaos mode: kind -> the body of a 200 answer,
#: or None for the kinds `chaos_answer` handles itself.
CHAOS: dict[str, bytes | None] = {
    "good": None,
    "nan": _page([("0.5", "NaN"), ("+Inf", "NaN")], "NaN"),
    "inf": _page([("0.5", "1"), ("+Inf", "+Inf")], "+Inf", "sglang:num_running_reqs +Inf"),
    "not cumulative": _page([("0.5", "9"), ("1", "3"), ("+Inf", "9")], "9"),
    "le=abc": _page([("abc", "1"), ("+Inf", "2")], "2"),
    "120k buckets": _page([(f"{i / 1000:.3f}", str(i)) for i in range(1, 120_000)] + [("+Inf", "120000")], "120000"),
    "deep json": b"[" * 60_000,
    "garbage": bytes(range(256)) * 40,
    "oversize": b"# " + b"x" * (9 * 1024 * 1024) + b"\n",
    "503": None,
    "drip": None,
    "silent": None,
    "reset": None,
    "not http": None,
    "churn": None,  # every family the agent reads, each series with a label value never seen before
}
#: Series per family of a "churn" answer: under a page's bound (256), so the window's bound is what holds.
CHAOS_CHURN_SERIES = 100


def send_page(conn: socket.socket, body: bytes) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def chaos_answer(conn: socket.socket, kind: str, number: int) -> None:
    body = CHAOS[kind]
    if body is not None or kind == "good":
        send_page(conn, _good_page(number) if body is None else body)
    elif kind == "503":
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    elif kind == "drip":  # headers one byte at a time, for up to 5 s
        for byte in DRIP[:100]:
            conn.sendall(bytes([byte]))
            time.sleep(0.05)
    elif kind == "silent":
        conn.settimeout(5.0)
        with contextlib.suppress(TimeoutError):
            while conn.recv(65536):
                pass
    elif kind == "churn":
        send_page(conn, churned_page(number, CHAOS_CHURN_SERIES))
    elif kind == "not http":
        conn.sendall(b"\x00\xff garbage instead of a status line\r\n\r\n")
    # "reset": the connection is closed unanswered


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_request(conn: socket.socket) -> None:
    """Read the headers and the Content-Length body, so the client is waiting for the answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def serve(conn: socket.socket, number: int, args: argparse.Namespace) -> None:
    mode, body_path = args.mode, args.body
    with conn:
        read_request(conn)
        say(f"request {number}")
        try:
            if number <= args.answer:
                conn.sendall(OK)
                return
            if mode == "chaos":
                chaos_answer(conn, random.Random(args.seed * 1_000_003 + number).choice(list(CHAOS)), number)
                return
            if mode == "churn":
                send_page(conn, churned_page(number, args.series, args.churn == "every-family"))
                return
            if mode == "raw":
                conn.sendall(body_path.read_bytes() if body_path is not None else b"")
                return
            if mode == "file":
                send_page(conn, body_path.read_bytes() if body_path is not None else b"")
                return
            if mode == "drip":
                for byte in DRIP:
                    conn.sendall(bytes([byte]))
                    time.sleep(args.interval)
            else:
                # Silent: wait for the client to give up (recv returns b"" or fails).
                while conn.recv(65536):
                    pass
        except OSError:
            pass
        say(f"gone {number}")


class SlowEndpoint:
    """This script as its own process, for the tests: a server that drips its answer, never
    answers, or answers with a file's bytes."""

    def __init__(self, mode: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), mode, *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, line: str, timeout_seconds: float) -> bool:
        deadline = time.monotonic() + timeout_seconds
        while line not in self.lines and time.monotonic() < deadline:
            time.sleep(0.05)
        return line in self.lines

    def __enter__(self) -> SlowEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("drip", "silent", "file", "chaos", "churn", "raw"))
    parser.add_argument("--seed", type=int, default=1, help="chaos mode: the seed of its choices")
    parser.add_argument("--body", type=Path, help="file mode: the answer's body; raw mode: the answer")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--series", type=int, default=100, help="churn mode: series per family on each page")
    parser.add_argument("--churn", choices=("every-family", "tokens"), default="every-family", help="churn mode: which")
    parser.add_argument("--answer", type=int, default=0, help="answer this many requests normally first")
    args = parser.parse_args()
    server = socket.create_server(("127.0.0.1", 0))
    say(str(server.getsockname()[1]))
    number = 0
    while True:
        conn, _ = server.accept()
        number += 1
        threading.Thread(target=serve, args=(conn, number, args), daemon=True).start()


if __name__ == "__main__":
    main()
