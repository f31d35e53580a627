"""`gpu-agent tune apply` and `tune undo` against a real daemon process on a simulated H200 node
with a real stand-in sglang server: the recommendation goes in force for exactly the swept GPU as a
drop-in the daemon reloads, `plan` says where the limit comes from, /metrics shows the sweep, and
undo puts the profile's own limit back. The bad day: nothing to apply, a request refused before a
step is set, a stale recommendation, a drop-in the config rejects, a reload the daemon refuses, a
kill between the write and the reload, observe mode."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import RunningAgent
from helpers import wait_until
from tune.test_sweep import node, sweep_json, tune

from agent import api
from agent.store.database import Store

pytestmark = pytest.mark.real_daemon

DROPIN = Path("agent.d") / "90-tune.yaml"


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--config", str(config)], capture_output=True, text=True, timeout=60
    )


def metric_lines(text: str, name: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(name + "{"))


def test_apply_puts_the_recommendation_in_force_and_undo_takes_it_back(tmp_path: Path) -> None:
    with node(tmp_path, power_limit="700") as (agent, backend):
        config = agent.config_path
        dropin = config.parent / DROPIN
        code, _, err = tune(agent, "apply")
        assert code == 1 and "refused: no sweep has run on this node: nothing to apply" in err, err

        # Every argument is checked before anything is set: no row, no table, no step.
        code, out, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "100", "--step", "150", "--dwell", "2"
        )
        assert code == 1 and out == "", out
        assert "refused: 100 W is outside GPU 0's power limit range 200-700 W" in err, err
        with Store.open(agent.state_dir) as store:
            assert store.last_tune() is None

        code, document = sweep_json(
            agent, "--from", "700", "--to", "400", "--step", "150", "--dwell", "3", "--tolerance", "0.5"
        )
        assert code == 0, document
        recommendation = document["recommendation"]
        assert recommendation["setting"] == 400 and recommendation["targets"].startswith("GPU 0 (GPU-")
        (swept,) = document["swept"]
        assert (swept["gpu"], swept["whole_model"], swept["profile"], swept["profile_alone"]) == (0, False, 0, False)
        # GPU 1 shares its profile: the snippet is a profile of GPU 0's own, before the model's.
        assert f'- match: {{uuid: "{swept["uuid"]}"}}  # before policy.gpus[0]' in recommendation["snippet"]
        # The lowest step measured is best: the optimum may lie lower, and the flag that goes there.
        assert recommendation["edge"].endswith("(extend the sweep with --to 250)"), recommendation["edge"]

        # The fleet sees it: one series per step and kind, and the recommendation.
        metrics = agent.metrics()
        labels = 'gpu_model="NVIDIA H200",kind="power",service="sglang"'
        assert metric_lines(metrics, "gpu_agent_tune_recommended") == [
            f'gpu_agent_tune_recommended{{{labels},setting="400"}} 1.0'
        ]
        assert len(metric_lines(metrics, "gpu_agent_tune_tokens_per_joule")) == 3  # 700 (current), 550, 400

        applied = cli(config, "tune", "apply")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert f"tune {document['id']}: 400 W in force for GPU 0 (" in applied.stdout
        assert "reloaded" in applied.stdout
        text = dropin.read_text()
        assert "power_limit_watts: 400" in text and swept["uuid"] in text and "locked_clocks" not in text
        wait_until(lambda: backend.power_limit_watts(0) == 400.0, 30, "the daemon enforcing 400 W on GPU 0")
        assert backend.power_limit_watts(1) == 700.0  # not swept: left as its profile says
        line = next(n for n, text in enumerate(dropin.read_text().splitlines(), 1) if "- match:" in text)
        plan = cli(config, "plan", "--json")
        sources = json.loads(plan.stdout)["profile_sources"]
        assert sources["0"]["settings"]["power_limit_watts"] == f"{dropin}:{line}"
        assert sources["0"]["settings"]["persistence"] == "policy.gpus[0]"  # the rest of the profile kept
        assert sources["1"]["settings"]["power_limit_watts"] == "policy.gpus[0]"
        shown = "".join(cli(config, "plan").stdout.split())  # a long path wraps within 100 columns
        assert "".join(f"GPU 0: policy.gpus[0]; power_limit_watts from {dropin}:{line}".split()) in shown

        undone = cli(config, "tune", "undo")
        assert undone.returncode == 0 and f"removed {dropin}" in undone.stdout, undone.stdout + undone.stderr
        assert not dropin.exists()
        wait_until(lambda: backend.power_limit_watts(0) == 700.0, 30, "the profile's 700 W back on GPU 0")
        again = cli(config, "tune", "undo")
        assert again.returncode == 0 and "nothing to undo" in again.stdout

        # Stale: the profile the sweep measured against says something else now. Nothing is written.
        original = config.read_text()
        config.write_text(original.replace("power_limit_watts: 700", "power_limit_watts: 650"))
        stale = cli(config, "tune", "apply")
        assert stale.returncode == 1 and not dropin.exists()
        assert "recommendation is stale: GPU 0's power_limit_watts in the config is 650.0 now, 700.0" in stale.stderr
        config.write_text(original)

        # A drop-in the config rejects (another one, broken): refused before anything is written.
        broken = config.parent / "agent.d" / "10-site.yaml"
        broken.write_text("policy:\n  gpu_overrides:\n    - match: {index: 0}\n      power_limit_watts: -5\n")
        rejected = cli(config, "tune", "apply")
        assert rejected.returncode == 1 and not dropin.exists()
        assert f"the config would be rejected, so nothing was written: {broken}:4" in rejected.stderr
        broken.unlink()

        # A reload the daemon refuses (a setting only a restart applies): the file goes back as it was.
        config.write_text(original.replace(f"state_dir: {agent.state_dir}", f"state_dir: {tmp_path / 'other'}"))
        refused = cli(config, "tune", "apply")
        assert refused.returncode == 1 and "the daemon refused the reload" in refused.stderr, refused.stderr
        assert not dropin.exists() and backend.power_limit_watts(0) == 700.0
        config.write_text(original)

        # A kill after the temporary file was half written: the loader never reads it, the next apply
        # replaces it; a kill after the rename and before the reload: SIGHUP (or apply again) finishes.
        temporary = dropin.parent / ".90-tune.yaml.gpu-agent.tmp"
        temporary.write_text("policy:\n  gpu_overrides:\n    - match: {ind")
        assert cli(config, "check-config").returncode == 0
        assert cli(config, "tune", "apply").returncode == 0 and not temporary.exists()
        wait_until(lambda: backend.power_limit_watts(0) == 400.0, 30, "400 W again")
        dropin.write_text(dropin.read_text().replace("power_limit_watts: 400", "power_limit_watts: 550"))
        agent.signal(signal.SIGHUP)
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the file on disk read at the reload")

        # Observe mode: the drop-in is written and read, and the output says nothing will set it.
        assert cli(config, "tune", "undo").returncode == 0
        wait_until(lambda: backend.power_limit_watts(0) == 700.0, 30, "the profile's 700 W back before observe mode")
        config.write_text(original.replace("mode: enforce", "mode: observe"))
        agent.signal(signal.SIGHUP)
        wait_until(lambda: power_item(agent)["mode"] == "observe", 30, "the reload to observe mode")
        observed = cli(config, "tune", "apply")
        assert observed.returncode == 0 and dropin.exists(), observed.stderr
        assert "note: power_limit is in observe mode: the daemon reads the new value and reports it as drift" in (
            observed.stdout
        )
        wait_until(lambda: power_item(agent)["desired"] == "400 W", 30, "the drop-in planned")
        assert power_item(agent)["status"] == "drift"
        assert backend.power_limit_watts(0) == 700.0  # never set in observe mode


def power_item(agent: RunningAgent) -> dict[str, Any]:
    items = api.call(agent.socket_path, "status")["policy"]["items"]
    return dict(next(i for i in items if (i["item"], i["gpu"]) == ("power_limit", 0)))
