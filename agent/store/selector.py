"""What a `gpu-agent ack` selector names, read once and range-checked, and what an ack did (`AckResult`).

The CLI refuses a bad selector before anything is opened (argparse's exit 2), the daemon's API answers
it with an error, and the store builds its conditions from the parsed form only, so no number it binds
is out of SQLite's range.

Selectors: `all`; a rule name; `gpu:INDEX`, `gpu:UUID` or a bare `GPU-...` UUID; `xid:CODE@GPU` (GPU:
an index or a UUID); `service:NAME`; `reboot` (the reboot recommendation: dealt with, or not to be
followed; `all` includes it). An index is ASCII digits (`gpu:²` names no index: it is read as a
UUID and matches nothing), within NVML's device index (an unsigned int); a code within the codes the
agent reads from the kernel log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.backend.base import MAX_XID

ALL = "all"
REBOOT = "reboot"
#: NVML names a device by an unsigned int.
MAX_GPU_INDEX = 2**32 - 1


@dataclass(frozen=True)
class AckSelector:
    text: str  # as given: what the acknowledgement is recorded as
    every: bool = False  # `all`
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    xid: int | None = None  # `xid:CODE@GPU`: that Xid on that GPU only
    service: str | None = None
    rule: str | None = None
    reboot: bool = False  # `reboot`, or `all`: the reboot recommendation

    @property
    def names_gpu(self) -> bool:
        return self.gpu_index is not None or self.gpu_uuid is not None

    def xid_marks(self) -> tuple[int | str | None, int | None] | None:
        """(GPU, Xid) of the Xid marks it takes out of the health window: `all` every one, a GPU
        selector that GPU's, `xid:CODE@GPU` one; None for rule and service selectors."""
        if self.every:
            return None, None
        if not self.names_gpu:
            return None
        return self.gpu_index if self.gpu_index is not None else self.gpu_uuid, self.xid


def _index(text: str, what: str, selector: str) -> int | None:
    """An index in ASCII digits, range-checked; None when `text` is no number (a UUID)."""
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    if value > MAX_GPU_INDEX:
        raise ValueError(f"{selector!r}: {what} {text} is not a GPU index (0-{MAX_GPU_INDEX})")
    return value


def parse_ack_selector(text: str) -> AckSelector:
    """The selector `text` names; ValueError (its message for the operator) when a number in it is out of range."""
    if text == ALL:
        return AckSelector(text, every=True, reboot=True)
    if text == REBOOT:
        return AckSelector(text, reboot=True)
    if text.startswith("GPU-"):
        return AckSelector(text, gpu_uuid=text)
    kind, sep, value = text.partition(":")
    if sep and kind == "gpu" and value:
        index = _index(value, "GPU", text)
        return AckSelector(text, gpu_index=index, gpu_uuid=value if index is None else None)
    if sep and kind == "service" and value:
        return AckSelector(text, service=value)
    code, at, gpu = value.partition("@")
    if sep and kind == "xid" and at and gpu and code.isascii() and code.isdigit():
        if not 1 <= int(code) <= MAX_XID:
            raise ValueError(f"{text!r}: Xid {code} is not a code the driver reports (1-{MAX_XID})")
        index = _index(gpu, "GPU", text)
        return AckSelector(text, gpu_index=index, gpu_uuid=gpu if index is None else None, xid=int(code))
    return AckSelector(text, rule=text)


@dataclass(frozen=True)
class AckResult:
    """What one `gpu-agent ack` did: rule/target pairs re-armed, missing GPUs acknowledged gone (their
    UUIDs), Xid marks taken out of the health window ((GPU, Xid) pairs) and whether a reboot
    recommendation was withdrawn. As JSON: `asdict`."""

    rearmed: int
    gone: tuple[str, ...]
    cleared: tuple[tuple[int, int], ...]
    reboot: bool = False

    @classmethod
    def from_json(cls, document: Any) -> AckResult:
        """The daemon's answer; ValueError when it is not in this form."""
        try:
            return cls(
                rearmed=int(document["rearmed"]),
                gone=tuple(str(uuid) for uuid in document["gone"]),
                cleared=tuple((int(gpu), int(xid)) for gpu, xid in document["cleared"]),
                reboot=document.get("reboot") is True,  # a daemon from before `ack reboot` leaves it out
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an ack result: {exc}") from None
