"""Which settings a GPU gets and where each comes from (agent.policy.profiles), the drop-ins beside
agent.yaml (agent.policy.dropins), and what check-config says about profiles that can never count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.backend.base import GpuIdentity
from agent.config import AgentConfig, ConfigError
from agent.policy.dropins import TUNE_DROPIN, load_checked_config, without_dropin
from agent.policy.profiles import covers, resolve_profile, shadowed

H200 = GpuIdentity(0, "GPU-aaaa", "NVIDIA H200", "0000:01:00.0", "", "", 0)
H200_1 = GpuIdentity(1, "GPU-bbbb", "NVIDIA H200", "0000:02:00.0", "", "", 0)
RTX = GpuIdentity(4, "GPU-cccc", "NVIDIA RTX PRO 6000 Blackwell Server Edition", "0000:05:00.0", "", "", 0)

AGENT_YAML = """\
policy:
  gpus:
    - match: {model: "NVIDIA H200*"}
      power_limit_watts: 600
      locked_clocks: {gpu_mhz: [1980, 1980]}
      persistence: enabled
      ecc: enabled
"""


def config_dir(tmp_path: Path, dropins: dict[str, str] | None = None, agent_yaml: str = AGENT_YAML) -> Path:
    tmp_path.chmod(0o755)
    (tmp_path / "agent.yaml").write_text(agent_yaml)
    if dropins is not None:
        (tmp_path / "agent.d").mkdir(mode=0o755)
        for name, text in dropins.items():
            (tmp_path / "agent.d" / name).write_text(text)
    return tmp_path / "agent.yaml"


def policy(**values: object) -> AgentConfig:
    return AgentConfig.model_validate({"policy": values})


def test_an_override_changes_only_the_keys_it_sets_and_the_last_word_wins() -> None:
    config = policy(
        gpus=[
            {"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 600, "persistence": "enabled"},
            {"match": {"model": "NVIDIA RTX*"}, "power_limit_watts": 300},
        ],
        gpu_overrides=[
            {"match": {"uuid": "GPU-AAAA"}, "power_limit_watts": 450},
            {"match": {"index": 0}, "power_limit_watts": 500, "ecc": "enabled"},
            {"match": {"index": 9}, "persistence": "disabled"},
        ],
    )
    zero = resolve_profile(config.policy, H200)
    assert zero is not None and zero.number == 0 and zero.overrides == (0, 1)
    assert (zero.profile.power_limit_watts, zero.profile.persistence, zero.profile.ecc) == (500, "enabled", "enabled")
    assert zero.sources == {
        "power_limit_watts": "policy.gpu_overrides[1]",
        "persistence": "policy.gpus[0]",
        "ecc": "policy.gpu_overrides[1]",
    }
    assert zero.from_overrides() == {"power_limit_watts": "policy.gpu_overrides[1]", "ecc": "policy.gpu_overrides[1]"}
    one = resolve_profile(config.policy, H200_1)
    assert one is not None and one.profile.power_limit_watts == 600 and one.from_overrides() == {}
    # A GPU no profile matches takes what its overrides set; one nothing matches has none.
    alone = resolve_profile(policy(gpu_overrides=[{"match": {"index": 4}, "ecc": "enabled"}]).policy, RTX)
    assert alone is not None and alone.number is None and alone.profile.ecc == "enabled"
    assert resolve_profile(policy().policy, RTX) is None


def test_drop_ins_are_read_after_agent_yaml_in_name_order_each_override_knowing_its_line(tmp_path: Path) -> None:
    path = config_dir(
        tmp_path,
        {
            "10-site.yaml": "policy:\n  gpu_overrides:\n    - match: {index: 0}\n      power_limit_watts: 550\n",
            TUNE_DROPIN: "# tune\npolicy:\n  gpu_overrides:\n    - match: {uuid: GPU-aaaa}\n      power_limit_watts: 450\n",
            "README": "not a drop-in",
            ".90-tune.yaml.gpu-agent.tmp": "policy:\n  gpu_overrides:\n    - match: {ind",  # a kill mid-write
        },
    )
    config = load_checked_config(path)
    origins = [o.origin for o in config.policy.gpu_overrides]
    assert origins == [f"{tmp_path}/agent.d/10-site.yaml:3", f"{tmp_path}/agent.d/{TUNE_DROPIN}:4"]
    resolved = resolve_profile(config.policy, H200)
    assert resolved is not None and resolved.profile.power_limit_watts == 450
    assert resolved.sources["power_limit_watts"] == f"{tmp_path}/agent.d/{TUNE_DROPIN}:4"
    assert resolved.profile.locked_clocks is not None and resolved.profile.ecc == "enabled"  # kept from agent.yaml
    # The policy apart from the tune's drop-in: what a sweep measures against.
    assert [o.origin for o in without_dropin(config.policy).gpu_overrides] == origins[:1]
    # What `tune apply` and `undo` check before they write: the drop-in as it would be.
    removed = load_checked_config(path, {TUNE_DROPIN: None})
    assert [o.power_limit_watts for o in removed.policy.gpu_overrides] == [550]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("mode: enforce\n", "agent.d/20-x.yaml:1 mode: a drop-in sets only policy.gpu_overrides"),
        ("policy:\n  gpus: []\n", "agent.d/20-x.yaml:2 policy.gpus: a drop-in sets only policy.gpu_overrides"),
        (
            "policy:\n  gpu_overrides:\n    - match: {index: 0}\n      power_limit_watts: 0\n",
            "agent.d/20-x.yaml:4 policy.gpu_overrides[0].power_limit_watts: must be > 0",
        ),
        ("policy:\n  gpu_overrides:\n    - {power_limit_watts: 300}\n", "policy.gpu_overrides[0].match: required"),
    ],
)
def test_a_drop_in_the_config_rejects_is_an_error_naming_its_file_and_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = config_dir(tmp_path, {"20-x.yaml": text})
    with pytest.raises(ConfigError) as refused:
        load_checked_config(path)
    assert problem in str(refused.value.problems[0]), refused.value.problems


def test_a_drop_in_others_may_write_is_refused(tmp_path: Path) -> None:
    path = config_dir(
        tmp_path, {"10-site.yaml": "policy:\n  gpu_overrides:\n    - match: {index: 0}\n      ecc: enabled\n"}
    )
    (tmp_path / "agent.d").chmod(0o777)
    with pytest.raises(ConfigError, match=r"refused: .*writable by group or others"):
        load_checked_config(path)
    (tmp_path / "agent.d").chmod(0o755)
    (tmp_path / "agent.d" / "10-site.yaml").chmod(0o666)
    with pytest.raises(ConfigError, match="refused"):
        load_checked_config(path)


def test_what_can_never_count_is_named() -> None:
    """The issue's case: a snippet for "NVIDIA H200" pasted after the "NVIDIA H200*" profile."""
    config = policy(
        gpus=[
            {"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 600},
            {"match": {"model": "NVIDIA H200"}, "power_limit_watts": 450},
            {"match": {"model": "NVIDIA RTX*"}, "power_limit_watts": 300},
            {"match": {"uuid": "GPU-aaaa"}, "power_limit_watts": 500},  # may be an H200 or not: not certain
        ],
        gpu_overrides=[
            {"match": {"index": 0, "model": "NVIDIA H200"}, "power_limit_watts": 500},
            {"match": {"model": "NVIDIA H200*"}, "ecc": "enabled"},  # matches more, sets something else
            {"match": {"index": 0}, "power_limit_watts": 450, "ecc": "enabled"},
        ],
    )
    assert shadowed(config.policy) == [
        'policy.gpus[1] (match {model: "NVIDIA H200"}) is never used: policy.gpus[0] (match {model: "NVIDIA H200*"})'
        " matches every GPU it matches, and the first matching profile wins (move it before, or make it a"
        " policy.gpu_overrides entry, which changes only the keys it sets)",
        'policy.gpu_overrides[0] (match {model: "NVIDIA H200", index: 0}) changes nothing: policy.gpu_overrides[2],'
        " read later, matches every GPU it matches and sets power_limit_watts again",
    ]
    assert covers(config.policy.gpus[0].match, config.policy.gpus[1].match)
    assert not covers(config.policy.gpus[1].match, config.policy.gpus[0].match)
    assert not covers(config.policy.gpus[0].match, config.policy.gpus[3].match)


def test_check_config_lists_the_drop_ins_and_warns_about_shadowed_profiles(tmp_path: Path) -> None:
    shadowing = AGENT_YAML + '    - match: {model: "NVIDIA H200"}\n      power_limit_watts: 450\n'
    path = config_dir(
        tmp_path,
        {TUNE_DROPIN: "policy:\n  gpu_overrides:\n    - match: {index: 0}\n      power_limit_watts: 450\n"},
        agent_yaml=shadowing + "remediation: {rules_dirs: []}\n",
    )
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_CONFIG"}
    run = [sys.executable, "-m", "agent.cli", "check-config", "--config", str(path)]
    checked = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60)
    strict = subprocess.run([*run, "--strict"], capture_output=True, text=True, env=env, timeout=60)
    assert checked.returncode == 0, checked.stderr
    assert f"policy drop-ins, read after {path} in this order:\n  {tmp_path}/agent.d/{TUNE_DROPIN}" in checked.stdout
    assert 'warning: policy.gpus[1] (match {model: "NVIDIA H200"}) is never used' in checked.stderr
    assert strict.returncode == 1
