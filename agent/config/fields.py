"""What every section of the config shares: the strict base model and the checks several fields make
(what `run` needs, checked by `gpu-agent check-config` too)."""

from __future__ import annotations

import socket
from typing import TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    # allow_inf_nan=False: `.inf` as a power limit or `.nan` as an interval is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_Model = TypeVar("_Model", bound=BaseModel)


def one_of_set(model: _Model, *names: str) -> _Model:
    """`model`, unless none of its fields `names` is set: "needs a and/or b", "needs at least one of a, b, c"."""
    if all(getattr(model, name) is None for name in names):
        listed = " and/or ".join(names) if len(names) == 2 else "at least one of " + ", ".join(names)
        raise ValueError(f"needs {listed}")
    return model


UNIX_SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL


def no_line_breaks(value: str) -> str:
    """CR, LF and NUL end a header line or an argv string early, or smuggle a second one in."""
    for character, name in (("\r", "CR"), ("\n", "LF"), ("\x00", "NUL")):
        if character in value:
            raise ValueError(f"must not contain {name} ({value!r})")
    return value


def http_url(value: str) -> str:
    """An http:// or https:// URL with a host: no file://, no bare host:port, no control characters."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"must be an http:// or https:// URL without spaces or control characters ({value!r})")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"must be an http:// or https:// URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, not {value!r}")
    return value


def absolute_argv(argv: list[str]) -> list[str]:
    """argv as run without a shell: an absolute program (no PATH lookup: which binary runs must not
    depend on the environment the agent inherited) and no line breaks or NUL in any string."""
    if not argv[0].startswith("/"):
        raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
    for arg in argv:
        no_line_breaks(arg)
    return argv


def listen_address(value: str) -> tuple[int, str]:
    """HOST:PORT or [IPV6]:PORT -> (address family, host) as the metrics server binds it; ValueError
    when the host is malformed, unknown, or not an address of this machine."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise ValueError("must be HOST:PORT with a port in 1-65535")
    if not host.isascii() or any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(f"HOST must be an IP address or a host name, not {host!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"an IPv6 address goes in brackets, as [::1]:{port}")
    bare = host.removeprefix("[").removesuffix("]") or "0.0.0.0"  # noqa: S104  # nosec B104  # as metrics does
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    # Bind port 0 of that address: refused here when `run` could not listen there (not an address of
    # this host, a name that does not resolve), without taking the port a running agent holds.
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((bare, 0))
    except (OSError, UnicodeError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot listen on {bare}: {reason}") from None
    return family, bare
