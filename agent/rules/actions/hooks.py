"""run_hook: an operator's program, run directly (never a shell) with the event as JSON on stdin.

The environment is minimal plus `GPU_AGENT_{EVENT_KIND,GPU,GPU_UUID,XID,RULE,SEVERITY,SERVICE}`
(empty when unknown); a timeout kills its process group; output is captured. The hook file must
not be group/world writable (nor its directories, unless sticky) and, when the agent runs as root,
must be owned by root (as must its directories).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

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
from agent.rules.model import Decision
from agent.rules.params import RunHookParams
from agent.services import MINIMAL_ENV, run_process


def hook_path_problem(program: str, running_as_root: bool | None = None) -> str | None:
    """Why a hook program must not run, or None. A file someone other than root could change would
    let them run code as the agent; so would a directory above it they could write to."""
    if not program.startswith("/"):
        return f"hook program must be an absolute path, not {program!r}"
    as_root = os.geteuid() == 0 if running_as_root is None else running_as_root
    try:
        real = Path(program).resolve(strict=True)
        info = real.stat()
    except OSError as exc:
        return f"hook {program}: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"hook {real} is not a regular file"
    if info.st_mode & 0o022:
        return f"hook {real} is group or world writable (mode {stat.S_IMODE(info.st_mode):04o})"
    if as_root and info.st_uid != 0:
        return f"hook {real} is not owned by root (uid {info.st_uid})"
    for directory in real.parents:
        dir_info = directory.stat()
        if dir_info.st_mode & 0o022 and not dir_info.st_mode & stat.S_ISVTX:
            return f"directory {directory} of hook {real} is group or world writable"
        if as_root and dir_info.st_uid != 0:
            return f"directory {directory} of hook {real} is not owned by root (uid {dir_info.st_uid})"
    return None


def hook_env(decision: Decision) -> dict[str, str]:
    event = decision.event
    gpu, xid = gpu_of(decision), xid_of(event)
    return {
        **MINIMAL_ENV,
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
    problem = hook_path_problem(program)
    if problem is not None:
        return refused(problem)
    stdin = json.dumps(event_payload(decision, ctx.hostname), default=str).encode()
    try:
        result = run_process(params.argv, params.timeout_seconds, stdin=stdin, env=hook_env(decision))
    except OSError as exc:
        return failed(f"cannot run hook {program}: {exc.strerror or exc}")
    if result.timed_out:
        return failed(
            f"hook {program} timed out after {params.timeout_seconds:g} s (process group killed): {result.output}"
        )
    detail = f"hook {program} {result.describe()}"
    return success(detail) if result.returncode == 0 else failed(detail)
