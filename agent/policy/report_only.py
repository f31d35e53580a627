"""What report-only items (driver, VBIOS, next boot) share: the change they plan is work for the
operator, and `apply` refuses it rather than pretend.

A report-only drift still lists one change, so `gpu-agent plan` says what to do ("install driver
580.159.04 with the distribution's packages"); `apply` raises `ChangeFailed` with the same words,
which makes `gpu-agent apply` exit 1: the node is not in policy and the agent cannot put it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.policy.item import ChangeFailed


@dataclass(frozen=True)
class OperatorTask:
    """Work only the operator can do; `text` says what, `why` why the agent does not do it."""

    task: str
    why: str

    @property
    def text(self) -> str:
        return f"{self.task} (report-only: {self.why})"


def refuse(changes: Sequence[OperatorTask]) -> str:
    """`apply` of a report-only item."""
    raise ChangeFailed("; ".join(change.text for change in changes) or "report-only item: nothing to apply")
