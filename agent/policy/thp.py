"""Transparent hugepages: `/sys/kernel/mm/transparent_hugepage/enabled` and `.../defrag`.

The kernel shows every choice with the active one in brackets (`always [madvise] never`) and
takes one word on write. The value lives in kernel memory only: it is lost at reboot, and the
daemon writes it again on its first loop after boot. Operators who need it from the first
instruction on (before the daemon starts) set `transparent_hugepage=never` on the kernel
command line as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.config import AgentConfig, NodePolicy, TransparentHugepages
from agent.policy.base import HostContext, ItemPlan, ItemResult, Outcome, PlanStatus

NAME = "transparent_hugepages"
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


def desired(node: NodePolicy, config: AgentConfig) -> TransparentHugepages | None:
    want = node.transparent_hugepages
    if want is None or (want.enabled is None and want.defrag is None):
        return None
    return want


class _Unusable(Exception):
    """The kernel's THP files cannot serve this desired state; carries the plan status and why."""

    def __init__(self, status: PlanStatus, actual: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.actual = actual
        self.detail = detail


@dataclass(frozen=True)
class _Setting:
    name: str
    path: str
    want: str
    active: str


def _wanted(want: TransparentHugepages) -> list[tuple[str, str]]:
    pairs = ((name, getattr(want, name)) for name in SETTINGS)
    return [(name, value) for name, value in pairs if value is not None]


def _describe(pairs: list[tuple[str, str]]) -> str:
    return " ".join(f"{name}={value}" for name, value in pairs)


def _observe(ctx: HostContext, want: TransparentHugepages) -> list[_Setting]:
    settings: list[_Setting] = []
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
        settings.append(_Setting(name, path, value, choice.active))
    return settings


def plan(ctx: HostContext, want: TransparentHugepages) -> ItemPlan:
    return _plan(ctx, want)


def _plan(ctx: HostContext, want: TransparentHugepages) -> ItemPlan:
    desired_text = _describe(_wanted(want))
    try:
        settings = _observe(ctx, want)
    except _Unusable as exc:
        return ItemPlan(NAME, None, exc.status, desired_text, exc.actual, detail=exc.detail)
    changes = tuple(f"write {s.want} to {s.path}" for s in settings if s.active != s.want)
    return ItemPlan(
        NAME,
        None,
        PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC,
        desired_text,
        _describe([(s.name, s.active) for s in settings]),
        changes=changes,
    )


def apply(ctx: HostContext, want: TransparentHugepages, plan: ItemPlan) -> ItemResult:
    # Read again rather than trust the plan: the value may have changed since it was made.
    try:
        settings = _observe(ctx, want)
    except _Unusable as exc:
        outcome = Outcome.SKIPPED if exc.status is PlanStatus.NOT_APPLICABLE else Outcome.FAILED
        return ItemResult(plan, outcome, exc.detail)
    todo = [s for s in settings if s.active != s.want]
    if not todo:
        return ItemResult(plan, Outcome.UNCHANGED)
    for setting in todo:
        try:
            ctx.paths.write_sysfs(setting.path, setting.want)
        except OSError as exc:
            return ItemResult(plan, Outcome.FAILED, f"cannot write {setting.want} to {setting.path}: {exc.strerror}")
    after = _plan(ctx, want)  # `plan` is the argument here
    written = ", ".join(f"{s.name}={s.want}" for s in todo)
    if after.status is not PlanStatus.IN_SYNC:
        why = f" ({after.detail})" if after.detail else ""
        return ItemResult(plan, Outcome.FAILED, f"wrote {written}, but the kernel now reports {after.actual}{why}")
    return ItemResult(plan, Outcome.APPLIED, f"set {written}; lost at reboot, the daemon sets it again at start")
