"""run_hook: an operator's program, run directly (never a shell) with the event as JSON on stdin.

The environment is minimal plus `GPU_AGENT_{EVENT_KIND,GPU,GPU_UUID,XID,RULE,SEVERITY,SERVICE}`
(empty when unknown); a timeout kills its process group; output is captured. The hook file must
not be group/world writable (nor any directory from `/` down to it, or to a link on the way,
unless sticky) and, when the agent runs as root, must be owned by root (as must those
directories). The check runs on the descriptor that is then executed (agent.trust.run_trusted):
a link swapped after the check cannot change what runs.
"""

from __future__ import annotations

import json
from typing import ClassVar, Final

from pydantic import Field, field_validator

from agent.rules.actions.base import (
    Result,
    event_payload,
    failed,
    gpu_of,
    refused,
    service_of,
    success,
    uuid_of,
    xid_of,
)
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, Lane
from agent.rules.model import Decision
from agent.rules.params import ActionParams
from agent.trust import UntrustedError, executable_problem, run_trusted

DEFAULT_HOOK_TIMEOUT_SECONDS = 60.0


class RunHookParams(ActionParams):
    kind: ClassVar[str] = "run_hook"

    argv: list[str] = Field(min_length=1)
    timeout_seconds: float = Field(default=DEFAULT_HOOK_TIMEOUT_SECONDS, gt=0, le=3600)

    @field_validator("argv")
    @classmethod
    def _absolute_program(cls, argv: list[str]) -> list[str]:
        # No PATH lookup and no shell: what runs as root must not depend on the environment.
        if not argv[0].startswith("/"):
            raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
        return argv


def hook_env(decision: Decision) -> dict[str, str]:
    event = decision.event
    gpu, xid = gpu_of(decision), xid_of(event)
    return {
        "GPU_AGENT_EVENT_KIND": event.kind.value,
        "GPU_AGENT_GPU": "" if gpu is None else str(gpu),
        "GPU_AGENT_GPU_UUID": uuid_of(decision) or "",
        "GPU_AGENT_XID": "" if xid is None else str(xid),
        "GPU_AGENT_RULE": decision.rule,
        "GPU_AGENT_SEVERITY": event.severity.value,
        "GPU_AGENT_SERVICE": service_of(decision) or "",
    }


def run_hook(decision: Decision, params: RunHookParams, ctx: ActionContext) -> Result:
    program = params.argv[0]
    stdin = json.dumps(event_payload(decision, ctx.hostname), default=str).encode()
    try:
        result = run_trusted(params.argv, params.timeout_seconds, stdin=stdin, extra_env=hook_env(decision))
    except UntrustedError as exc:
        return refused(str(exc))
    except OSError as exc:
        return failed(f"cannot run hook {program}: {exc.strerror or exc}")
    if result.timed_out:
        return failed(
            f"hook {program} timed out after {params.timeout_seconds:g} s (process group killed): {result.output}"
        )
    detail = f"hook {program} {result.describe()}"
    return success(detail) if result.returncode == 0 else failed(detail)


def _check(params: RunHookParams) -> list[tuple[str, str]]:
    """The program is one the agent would run (agent.trust): refused now, not at 3 a.m. when a fault needs it."""
    problem = executable_problem(params.argv[0])
    return [] if problem is None else [("argv[0]", problem)]


ACTION: Final = ActionType(
    RunHookParams,
    run_hook,
    does=(
        "Runs `argv` (never a shell) with the event as JSON on stdin and `GPU_AGENT_*` variables, in a scrubbed "
        "environment; its process group is killed at `timeout_seconds`; the program and every directory above "
        "it must be root's alone."
    ),
    # The operator's own program: it runs in observe mode too (an operator who wants nothing run
    # configures no hooks). What it does is not the agent's to know, so it waits for the whole node.
    changes_node=False,
    lane=Lane.NODE,
    check=_check,
)
