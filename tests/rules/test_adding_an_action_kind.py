"""Adding an action kind is one module under agent/rules/actions/kinds/, and nothing else.

The test does what a contributor does, on a copy of the agent: it writes `cordon_gpu.py` (its
parameters, its handler, what it does, that it changes the node, its lane and the GPUs it touches,
that it is aimed at the fault's GPU, once per GPU in an evaluation) and edits nothing else. Then
the copy's `gpu-agent check-config` accepts a rule using it (the installed agent does not), a daemon
of the copy in enforce mode runs it on an injected Xid through the action worker, a daemon in observe
mode records it as a dry run instead, the copy puts it on the gpus lane with its GPU as footprint, and
the copy's README table has its row.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import running_agent, write_agent_config
from helpers import wait_until

pytestmark = pytest.mark.real_daemon

REPO = Path(__file__).resolve().parents[2]
WAIT_SECONDS = 20.0
POLICY = "  gpus: []\n"

#: The new kind, whole: a contributor's one module.
KIND_MODULE = '''\
"""cordon_gpu: the GPU marked cordoned, so the scheduler's node agent places no new work on it."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Final

from agent.config import AgentConfig
from agent.rules.actions.base import Result, failed, gpu_of, success
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, Footprint, Lane, Once, Targets
from agent.rules.model import Decision
from agent.rules.params import ActionParams


class CordonGpuParams(ActionParams):
    kind: ClassVar[str] = "cordon_gpu"

    reason: str = "cordoned by gpu-agent"


def cordon_gpu(decision: Decision, params: CordonGpuParams, ctx: ActionContext) -> Result:
    gpu = gpu_of(decision)
    if gpu is None:
        return failed("cordon_gpu needs a GPU")
    mark = Path(ctx.config.state_dir) / "cordoned" / f"gpu{gpu}"
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(params.reason + "\\n")
    return success(f"GPU {gpu} cordoned")


def _touches(decision: Decision, config: AgentConfig) -> Footprint:
    gpu = gpu_of(decision)
    return None if gpu is None else frozenset({gpu})


ACTION: Final = ActionType(
    CordonGpuParams,
    cordon_gpu,
    does="Marks the GPU cordoned (`state_dir/cordoned/gpuN`): the scheduler places no new work on it.",
    changes_node=True,
    lane=Lane.GPUS,
    touches=_touches,
    targets=Targets.GPU,
    once=Once.PER_GPU,
)
'''

RULES = """\
rules:
  - name: cordon-on-xid
    match: {xid: {codes: [48]}}
    actions:
      - cordon_gpu: {reason: "Xid 48: uncorrectable ECC"}
"""

#: Run in the copy: the lane and footprint the worker gives a decision of the new kind.
LANE_PROBE = """
import json
from agent.events import Event, EventKind, Severity
from agent.config import AgentConfig
from agent.rules.actions.footprint import footprint, lane
from agent.rules.config import ActionStep
from agent.rules.model import Decision, Target

spec = ActionStep.model_validate({"cordon_gpu": {}}).spec()
event = Event(EventKind.XID, Severity.CRITICAL, 1, None, "Xid 48", 0.0, "test", "xid-48", {"xid": 48})
decision = Decision("cordon-on-xid", event, Target(gpu=1), spec, 0, 1, "Xid 48")
print(json.dumps({"lane": lane(decision).value, "footprint": sorted(footprint(decision, AgentConfig()) or ())}))
"""


def agent_with_a_new_kind(root: Path) -> Path:
    """A copy of the agent package under `root` with the new kind's module added, and nothing else."""
    shutil.copytree(REPO / "agent", root / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    kinds = root / "agent" / "rules" / "actions" / "kinds"
    assert kinds.is_dir(), "the action kinds moved"
    (kinds / "cordon_gpu.py").write_text(KIND_MODULE)
    return root


def in_copy(source: Path | None, *args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with the copy's agent package first on the path (None: the installed one)."""
    argv = [sys.executable, *args, *(["--config", str(config)] if config is not None else [])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=source or REPO)


def write_rules(directory: Path) -> Path:
    directory.mkdir(mode=0o755)
    (directory / "10-cordon.yaml").write_text(RULES)
    os.chmod(directory / "10-cordon.yaml", 0o644)
    return directory


def decisions(source: Path, config: Path) -> list[dict[str, Any]]:
    shown = in_copy(source, "-m", "agent.cli", "events", "--json", "--since", "1h", config=config)
    assert shown.returncode == 0, shown.stderr
    return [r for r in json.loads(shown.stdout)["remediations"] if r["rule"] == "cordon-on-xid"]


def cordoned_on_an_xid(tmp_path: Path, source: Path, mode: str) -> tuple[dict[str, Any], Path]:
    """A daemon of the copy in `mode` meets an Xid 48 on GPU 0: its decision, and where the mark would be."""
    tmp_path.mkdir()
    rules = write_rules(tmp_path / "rules.d")
    with running_agent(tmp_path, source=source, rules_dir=rules, policy=POLICY, mode=mode) as agent:
        agent.notifications.wait_for("READY", "1")
        injected = in_copy(source, "-m", "agent.cli", "inject", "xid", "48", "--gpu", "0", config=agent.config_path)
        assert injected.returncode == 0, injected.stderr
        done = wait_until(
            lambda: [r for r in decisions(source, agent.config_path) if r["outcome"] != "running"],
            WAIT_SECONDS,
            lambda: f"the decision on the Xid; log: {agent.log()[-2000:]}",
        )
        return done[0], agent.state_dir / "cordoned" / "gpu0"


def test_a_new_kind_is_one_module_validated_dispatched_laned_and_observed(tmp_path: Path) -> None:
    source = agent_with_a_new_kind(tmp_path / "src")

    (tmp_path / "check").mkdir()
    config, _ = write_agent_config(tmp_path / "check", rules_dir=write_rules(tmp_path / "check" / "rules.d"))
    checked = in_copy(source, "-m", "agent.cli", "check-config", config=config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    unknown = in_copy(None, "-m", "agent.cli", "check-config", config=config)  # the agent without the module
    assert unknown.returncode == 1 and "rules[0].actions[0].cordon_gpu: unknown key" in unknown.stderr

    enforced, mark = cordoned_on_an_xid(tmp_path / "enforce", source, "enforce")
    assert (enforced["action"], enforced["outcome"], enforced["detail"]) == ("cordon_gpu", "success", "GPU 0 cordoned")
    assert mark.read_text() == "Xid 48: uncorrectable ECC\n"

    observed, mark = cordoned_on_an_xid(tmp_path / "observe", source, "observe")
    assert (observed["action"], observed["outcome"], observed["detail"]) == (
        "cordon_gpu",
        "dry_run",
        "observe mode: would run cordon_gpu on GPU 0 (rule cordon-on-xid)",
    )
    assert not mark.exists()

    probed = in_copy(source, "-c", LANE_PROBE)
    assert probed.returncode == 0, probed.stderr
    assert json.loads(probed.stdout) == {"lane": "gpus", "footprint": [1]}

    table = in_copy(source, "-m", "agent.rules.actions.registry")
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("| `cordon_gpu` |"))
    assert row.endswith("| the fault's GPU | jobs on the GPUs it touches | GPU | not run: recorded as `dry_run` |")
