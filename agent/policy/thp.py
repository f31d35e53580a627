"""Transparent hugepages: `/sys/kernel/mm/transparent_hugepage/enabled` and `.../defrag`.

The kernel shows every choice with the active one in brackets (`always [madvise] never`) and
takes one word on write. The value lives in kernel memory only: it is lost at reboot, and the
daemon writes it again on its first loop after boot. Operators who need it from the first
instruction on (before the daemon starts) set `transparent_hugepage=never` on the kernel
command line as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.config import AgentConfig
from agent.config.desired import NodePolicy, TransparentHugepages
from agent.policy.base import HostContext
from agent.policy.item import ChangeFailed, HostItem, Planned, compared, planned
from agent.policy.plan import ItemPlan, PlanStatus

SYSFS_DIR = "/sys/kernel/mm/transparent_hugepage"
SETTINGS = ("enabled", "defrag")


@dataclass(frozen=True)
class KernelChoice:
    active: str
    offered: tuple[str, ...] | None  # None: the file shows the active word only


def parse_choice(text: str) -> KernelChoice | None:
    """`always [madvise] never` -> madvise active, (always, madvise, never) offered.

    Parsing rule: exactly one bracketed word is the active one. A file holding one bare word
    (`never`) reads as that word active with the offered choices unknown: that is what a plain
    file in a test tree holds after a write. Anything else (several bare words, two bracketed
    words, nothing) has no active value: None.
    """
    words = text.split()
    bracketed = [w for w in words if len(w) > 2 and w.startswith("[") and w.endswith("]")]
    if len(bracketed) == 1:
        return KernelChoice(bracketed[0][1:-1], tuple(w.strip("[]") for w in words))
    if len(words) == 1 and not any(c in words[0] for c in "[]"):
        return KernelChoice(words[0], None)
    return None


class _Unusable(Exception):
    """The kernel's THP files cannot serve this desired state; carries the plan status and why."""

    def __init__(self, status: PlanStatus, actual: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.actual = actual
        self.detail = detail


def _wanted(want: TransparentHugepages) -> list[tuple[str, str]]:
    pairs = ((name, getattr(want, name)) for name in SETTINGS)
    return [(name, value) for name, value in pairs if value is not None]


def _describe(pairs: list[tuple[str, str]]) -> str:
    return " ".join(f"{name}={value}" for name, value in pairs)


@dataclass(frozen=True)
class WriteSetting:
    """Make `word` the active choice of one THP file."""

    name: str
    path: str
    word: str

    @property
    def text(self) -> str:
        return f"write {self.word} to {self.path}"


def _observe(ctx: HostContext, want: TransparentHugepages) -> list[tuple[str, str, str]]:
    """(name, wanted word, active word) per configured file; raises _Unusable."""
    settings: list[tuple[str, str, str]] = []
    for name, value in _wanted(want):
        path = f"{SYSFS_DIR}/{name}"
        try:
            text = ctx.paths.read_text(path)
        except FileNotFoundError:
            raise _Unusable(
                PlanStatus.NOT_APPLICABLE,
                "not offered",
                f"{path} is missing: kernel built without transparent hugepages",
            ) from None
        except OSError as exc:
            raise _Unusable(PlanStatus.ERROR, f"{name} unreadable", f"cannot read {path}: {exc.strerror}") from None
        choice = parse_choice(text)
        if choice is None:
            raise _Unusable(PlanStatus.ERROR, f"{name} unreadable", f"cannot parse {path}: {text.strip()!r}")
        if choice.offered is not None and value not in choice.offered:
            raise _Unusable(
                PlanStatus.ERROR,
                f"{name}={choice.active}",
                f"{name}={value} is not offered by this kernel (choices: {', '.join(choice.offered)})",
            )
        settings.append((name, value, choice.active))
    return settings


class TransparentHugepagesItem(HostItem[TransparentHugepages, WriteSetting]):
    name: Final = "transparent_hugepages"

    def desired(self, node: NodePolicy, config: AgentConfig) -> TransparentHugepages | None:
        want = node.transparent_hugepages
        if want is None or (want.enabled is None and want.defrag is None):
            return None
        return want

    def plan(self, host: HostContext, want: TransparentHugepages) -> Planned[WriteSetting]:
        desired_text = _describe(_wanted(want))
        try:
            settings = _observe(host, want)
        except _Unusable as exc:
            return planned(ItemPlan(self.name, None, exc.status, desired_text, exc.actual, detail=exc.detail))
        changes = [
            WriteSetting(name, f"{SYSFS_DIR}/{name}", value) for name, value, active in settings if active != value
        ]
        return compared(
            self.name, None, desired_text, _describe([(name, active) for name, _, active in settings]), changes
        )

    def apply(self, host: HostContext, changes: Sequence[WriteSetting]) -> str:
        for change in changes:
            try:
                host.paths.write_sysfs(change.path, change.word)
            except OSError as exc:
                raise ChangeFailed(f"cannot write {change.word} to {change.path}: {exc.strerror}") from exc
        written = ", ".join(f"{c.name}={c.word}" for c in changes)
        return f"set {written}; lost at reboot, the daemon sets it again at start"


ITEM: Final = TransparentHugepagesItem()
