"""sd_notify without libsystemd: one datagram per message to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


class SdNotifier:
    """Sends READY=1, STATUS=..., WATCHDOG=1, STOPPING=1 to systemd (no-op when not under systemd)."""

    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._socket: socket.socket | None = None

    @classmethod
    def from_environment(cls) -> SdNotifier:
        address = os.environ.get("NOTIFY_SOCKET") or None
        usec_text = os.environ.get("WATCHDOG_USEC", "")
        pid_text = os.environ.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; a child must not ping for us.
        for_us = not pid_text or (pid_text.isdigit() and int(pid_text) == os.getpid())
        usec = int(usec_text) if usec_text.isdigit() and int(usec_text) > 0 and for_us else None
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_seconds(self) -> float | None:
        return self.watchdog_usec / 1_000_000 if self.watchdog_usec else None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            # Never block: a manager that stopped reading (its queue full) must not stall the loop or
            # the exit path; a dropped STATUS= is harmless and a dropped WATCHDOG=1 is what a stall means.
            self._socket.sendto("\n".join(fields).encode(), socket.MSG_DONTWAIT, target)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
