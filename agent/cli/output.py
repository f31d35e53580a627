"""A command's stdout when it cannot be written: closed at start (`gpu-agent status >&-`), a reader
that went away (`gpu-agent events | head -1`: EPIPE), a full disk (`> /dev/full`: ENOSPC).

`GuardedOutput` stands in for `sys.stdout` while a command runs: every write and flush that fails
raises `OutputError`, which no command catches by mistake (it is no OSError), and `main` ends the
command on it without a traceback. A reader that stopped reading is no failure: the command's exit
code stands. Any other write error is one line on stderr and exit 1, as coreutils do. Either way fd 1
is pointed at /dev/null afterwards, so the interpreter's last flush at exit finds nothing to fail on.
Standard library only: `status` and `--version` start through it."""

from __future__ import annotations

import errno
import os
import sys

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, TextIO


class OutputError(Exception):
    """Writing the command's output failed; `error` says how."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error

    @property
    def reader_gone(self) -> bool:
        return self.error.errno == errno.EPIPE


class GuardedOutput:
    """`stream` (None: stdout was closed when the command started) whose write errors are OutputError."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def _closed(self) -> OutputError:
        return OutputError(OSError(errno.EBADF, "stdout is closed"))

    def write(self, text: str) -> int:
        if self._stream is None:
            raise self._closed()
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise OutputError(exc) from None

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            raise OutputError(exc) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def fileno(self) -> int:
        if self._stream is None:
            raise self._closed().error
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def ended(error: OutputError, code: int) -> int:
    """The exit code after `error`: `code` when the reader went away, else 1 with the reason on stderr."""
    import contextlib  # only on the way out: `status` does not pay for it

    _discard_the_rest()
    if error.reader_gone:
        return code
    with contextlib.suppress(OSError, AttributeError):  # stderr closed too: the exit code says it
        sys.stderr.write(f"gpu-agent: cannot write the output: {error.error.strerror or error.error}\n")
    return 1


def _discard_the_rest() -> None:
    """fd 1 onto /dev/null, when there is one: what is left in the stream's buffer goes there, and the
    interpreter's flush at exit finds nothing to fail on."""
    stream = sys.__stdout__
    if stream is None:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(null)
