"""Config loading: valid shapes, and errors that name file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, Mode, config_from_text, load_config

DESIGN_EXAMPLE = """\
mode: observe
backend: nvml
simulated: {profile: h200x8}
host_root: /
state_dir: /var/lib/gpu-agent
metrics: {listen: "0.0.0.0:9481"}
api: {socket: /run/gpu-agent/agent.sock}
policy:
  node: {transparent_hugepages: never, nouveau: blacklisted,
         triton_cache: {path: /var/cache/triton, owner: root, group: root, mode: "0755",
                        services: [sglang]}}
  gpus:
    - match: {model: "NVIDIA RTX PRO 6000*"}
      power_limit_watts: 260
      locked_clocks: {gpu_mhz: [1500, 1500]}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
      persistence: enabled
      ecc: enabled
services:
  - {name: sglang, unit: sglang.service, health_url: "http://127.0.0.1:30000/health", gpus: all}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_text(text, "agent.yaml")
    return [str(p) for p in info.value.problems]


def test_design_example_loads() -> None:
    config = config_from_text(DESIGN_EXAMPLE)
    assert config.mode is Mode.OBSERVE
    profile = config.policy.gpus[0]
    assert profile.power_limit_watts == 260
    assert profile.fan_curve is not None and profile.fan_curve.points == [(30, 30), (50, 65), (75, 100)]
    assert profile.fan_curve.hysteresis_celsius == 3
    assert config.policy.node.transparent_hugepages is not None
    assert config.policy.node.transparent_hugepages.enabled == "never"
    assert config.policy.node.triton_cache is not None and config.policy.node.triton_cache.mode_bits == 0o755
    assert config.service_unit("sglang") == "sglang.service"
    assert config.service_unit("vllm") == "vllm.service"


def test_defaults_are_observe_mode_and_change_nothing() -> None:
    config = AgentConfig()
    assert config.mode is Mode.OBSERVE
    assert config.writable_items() == frozenset()
    assert config.metrics.listen.endswith(":9481")


def test_per_item_mode_override() -> None:
    config = config_from_text("mode: observe\npolicy: {modes: {power_limit: enforce}}")
    assert config.writable_items() == {"power_limit"}
    config = config_from_text("mode: enforce\npolicy: {modes: {fan_curve: observe}}")
    assert "fan_curve" not in config.writable_items() and "power_limit" in config.writable_items()


def test_error_names_file_line_and_field() -> None:
    text = "mode: enforce\npolicy:\n  gpus:\n    - match: {index: 0}\n      power_limit_watts: 0\n"
    assert problems(text) == ["agent.yaml:5 policy.gpus[0].power_limit_watts: must be > 0"]


def test_unknown_key_is_an_error_with_a_suggestion() -> None:
    text = "mode: enforce\npolicy:\n  gpus:\n    - match: {index: 0}\n      power_limit_wats: 300\n"
    assert problems(text) == [
        "agent.yaml:5 policy.gpus[0].power_limit_wats: unknown key (did you mean 'power_limit_watts'?)"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mode: enforcing\n", "agent.yaml:1 mode: must be 'observe' or 'enforce'"),
        ("backend: cuda\n", "agent.yaml:1 backend: must be 'nvml' or 'simulated'"),
        ("policy:\n  gpus:\n    - power_limit_watts: 300\n", "agent.yaml:3 policy.gpus[0].match: required"),
        (
            "policy:\n  gpus:\n    - match: {}\n",
            "agent.yaml:3 policy.gpus[0].match: needs at least one of model, uuid, index",
        ),
        (
            "policy:\n  gpus:\n    - match: {index: 0}\n      locked_clocks: {gpu_mhz: [1500, 1400]}\n",
            "agent.yaml:4 policy.gpus[0].locked_clocks.gpu_mhz: min 1500 MHz is above max 1400 MHz",
        ),
        (
            "policy:\n  gpus:\n    - match: {index: 0}\n      fan_curve: [[50, 60], [40, 70]]\n",
            "agent.yaml:4 policy.gpus[0].fan_curve: temperatures must be strictly increasing",
        ),
        (
            "policy:\n  gpus:\n    - match: {index: 0}\n      fan_curve: [[30, 101]]\n",
            "agent.yaml:4 policy.gpus[0].fan_curve[0][1]: must be <= 100",
        ),
        (
            "policy:\n  node:\n    triton_cache: {path: /x, mode: 755}\n",
            'agent.yaml:3 policy.node.triton_cache.mode: must be a quoted octal string such as "0755"',
        ),
        (
            "policy:\n  node:\n    triton_cache: {path: relative/dir}\n",
            "agent.yaml:3 policy.node.triton_cache.path: must be an absolute path",
        ),
        ("metrics: {listen: 'nohost'}\n", "agent.yaml:1 metrics.listen: must be HOST:PORT with a port in 1-65535"),
        ("services:\n  - {name: a}\n  - {name: a}\n", "agent.yaml:1 services: duplicate service names: a"),
        ("mode: observe\nmode: enforce\n", "agent.yaml:2 mode: duplicate key"),
        ("mode: [observe\n", "agent.yaml:2: invalid YAML: expected ',' or ']', but got '<stream end>'"),
        ("- just\n- a list\n", "agent.yaml:1: must be a YAML mapping"),
    ],
)
def test_invalid_configs(text: str, expected: str) -> None:
    assert expected in problems(text)


def test_union_errors_report_the_deepest_branch_only() -> None:
    assert problems("services:\n  - {name: a, gpus: [1, -1]}\n") == ["agent.yaml:2 services[0].gpus[1]: must be >= 0"]


def test_load_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(DESIGN_EXAMPLE)
    assert load_config(path).policy.gpus[0].ecc == "enabled"


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'nope.yaml'}: cannot read: No such file")


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("# nothing yet\n")
    assert load_config(path) == AgentConfig()
