"""An HTTP endpoint that misbehaves on purpose, run as its own process by the tests.

    python slow_endpoint.py drip                # answers one byte every --interval seconds, forever
    python slow_endpoint.py silent [--answer N]  # accepts and never answers (after answering N requests)
    python slow_endpoint.py file --body PATH     # answers every request 200 with PATH's bytes, read anew

It prints its port on the first line of stdout once it listens, then one line per event:
`request N` when it has read a request, `gone N` when the client of request N went away
(a write failed or the connection closed).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
DRIP = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Padding: " + b"x" * 10_000


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


def serve(conn: socket.socket, number: int, mode: str, interval: float, answer: int, body_path: Path | None) -> None:
    with conn:
        read_request(conn)
        say(f"request {number}")
        try:
            if number <= answer:
                conn.sendall(OK)
                return
            if mode == "file":
                body = body_path.read_bytes() if body_path is not None else b""
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                return
            if mode == "drip":
                for byte in DRIP:
                    conn.sendall(bytes([byte]))
                    time.sleep(interval)
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
    parser.add_argument("mode", choices=("drip", "silent", "file"))
    parser.add_argument("--body", type=Path, help="file mode: the answer's body")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--answer", type=int, default=0, help="answer this many requests normally first")
    args = parser.parse_args()
    server = socket.create_server(("127.0.0.1", 0))
    say(str(server.getsockname()[1]))
    number = 0
    while True:
        conn, _ = server.accept()
        number += 1
        threading.Thread(
            target=serve, args=(conn, number, args.mode, args.interval, args.answer, args.body), daemon=True
        ).start()


if __name__ == "__main__":
    main()
