"""Config loading: valid shapes, and errors that name file, line and field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, Mode, config_from_text, load_config
from agent.policy.dropins import load_checked_config

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


def test_the_simulated_profile_is_checked_where_the_backend_is_opened(tmp_path: Path) -> None:
    """The config itself never loads a backend: a profile that does not exist passes load_config and
    is a file:line error of load_checked_config, which run, plan, apply, check-config and a reload use."""
    path = tmp_path / "agent.yaml"
    path.write_text("mode: observe\nbackend: simulated\nsimulated:\n  profile: bogus\n")
    assert load_config(path).simulated.profile == "bogus"
    with pytest.raises(ConfigError) as caught:
        load_checked_config(path)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.field) == (str(path), 4, "simulated.profile")
    assert problem.message.startswith("unknown simulated GPU profile 'bogus'")
    path.write_text("backend: simulated\n")  # the default profile: nothing to check
    assert load_checked_config(path).simulated.profile == "h200x8"


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'nope.yaml'}: cannot read: No such file")


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("# nothing yet\n")
    assert load_config(path) == AgentConfig()


# -- what `run` needs, checked by check-config as well -----------------------------------------------

UNKNOWN_GROUP = "gpu-agent-no-such-group"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("metrics: {listen: '999.1.1.1:9481'}\n", "agent.yaml:1 metrics.listen: cannot listen on 999.1.1.1: "),
        ("metrics: {listen: '192.0.2.1:9481'}\n", "agent.yaml:1 metrics.listen: cannot listen on 192.0.2.1: "),
        ("metrics: {listen: '::1:9481'}\n", "agent.yaml:1 metrics.listen: an IPv6 address goes in brackets"),
        ("metrics: {listen: '[::1:9481'}\n", "agent.yaml:1 metrics.listen: an IPv6 address goes in brackets"),
        ("metrics: {listen: 'no such host:9481'}\n", "agent.yaml:1 metrics.listen: HOST must be an IP address or a"),
        (
            "metrics: {listen: 'no-such-host.invalid:9481'}\n",
            "agent.yaml:1 metrics.listen: cannot listen on no-such-host",
        ),
        ("metrics: {listen: '127.0.0.1:0'}\n", "agent.yaml:1 metrics.listen: must be HOST:PORT with a port in 1-65535"),
        (f"api: {{group: {UNKNOWN_GROUP}}}\n", f"agent.yaml:1 api.group: unknown group '{UNKNOWN_GROUP}'"),
        ("api: {socket: /tmp}\n", "agent.yaml:1 api.socket: /tmp is a directory; name the socket file"),
        ("api: {socket: run/agent.sock}\n", "agent.yaml:1 api.socket: must be an absolute path"),
        ("api: {socket: /" + "s" * 120 + "}\n", "agent.yaml:1 api.socket: is longer than the 107 bytes"),
        (
            "remediation: {alertmanager_url: 'file:///etc/shadow'}\n",
            "agent.yaml:1 remediation.alertmanager_url: must be an http:// or https:// URL, not 'file:///etc/shadow'",
        ),
        (
            'remediation: {alertmanager_url: "http://am:9093/\\r\\nX-Evil: 1"}\n',
            "agent.yaml:1 remediation.alertmanager_url: must be an http:// or https:// URL without spaces",
        ),
        (
            "remediation: {alertmanager_url: 'http://am:99999'}\n",
            "agent.yaml:1 remediation.alertmanager_url: must be an http:// or https:// URL: Port out of range",
        ),
        (
            "remediation:\n  alertmanager_url: [http://am-1:9093, 'file:///x']\n",
            "agent.yaml:2 remediation.alertmanager_url: must be an http:// or https:// URL, not 'file:///x'",
        ),
        (
            "alerts: {for_seconds: {GpuLots: 30}}\n",
            "agent.yaml:1 alerts.for_seconds: unknown alert 'GpuLots' (did you mean 'GpuLost'?); the alerts are"
            " listed in docs/alerts.md",
        ),
        (
            "alerts: {labels: {instance: x}}\n",
            "agent.yaml:1 alerts.labels: 'instance' is set by the agent (alerts.instance, alerts.job, the catalogue)",
        ),
        (
            "services:\n  - {name: a, slo: {e2e_p95_seconds: 1, window_seconds: 5}}\n",
            "agent.yaml:2 services[0].slo.window_seconds: must be >= 10",
        ),
        (
            "services:\n  - {name: a, health_url: 'ftp://127.0.0.1/health'}\n",
            "agent.yaml:2 services[0].health_url: must be an http:// or https:// URL",
        ),
        (
            "remediation: {reboot_command: [systemctl, reboot]}\n",
            "agent.yaml:1 remediation.reboot_command: the program must be an absolute path, not 'systemctl'",
        ),
        (
            'remediation: {reboot_command: [/usr/bin/systemctl, "reboot\\0"]}\n',
            "agent.yaml:1 remediation.reboot_command: must not contain NUL",
        ),
        (
            'services:\n  - {name: a, manager: command, start_command: [/bin/start, "a\\nb"], stop_command: [/bin/stop]}\n',
            "agent.yaml:2 services[0].start_command: must not contain LF",
        ),
        ("interval_seconds: 1e-300\n", "agent.yaml:1 interval_seconds: must be >= 0.1"),
        ("interval_seconds: 86401\n", "agent.yaml:1 interval_seconds: must be <= 3600"),
        ("interval_seconds: .nan\n", "agent.yaml:1 interval_seconds: must be a finite number"),
        ("policy_interval_seconds: 0.001\n", "agent.yaml:1 policy_interval_seconds: must be >= 1"),
        ("counters_interval_seconds: -1\n", "agent.yaml:1 counters_interval_seconds: must be >= 0"),
        ("counters_interval_seconds: .inf\n", "agent.yaml:1 counters_interval_seconds: must be a finite number"),
        (
            "services:\n  - {name: a, scrape_interval_seconds: 0}\n",
            "agent.yaml:2 services[0].scrape_interval_seconds: must be >= 0.01",
        ),
        (
            "services:\n  - {name: a, probe_interval_seconds: 1e-300}\n",
            "agent.yaml:2 services[0].probe_interval_seconds: must be >= 0.01",
        ),
        (
            "policy:\n  gpus:\n    - match: {index: 0}\n      power_limit_watts: .inf\n",
            "agent.yaml:4 policy.gpus[0].power_limit_watts: must be a finite number",
        ),
        (
            "policy:\n  gpus:\n    - match: {index: 0}\n      power_limit_watts: 1e308\n",
            "agent.yaml:4 policy.gpus[0].power_limit_watts: must be <= 10000",
        ),
    ],
)
def test_what_run_would_reject_is_rejected_here(text: str, expected: str) -> None:
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_what_run_accepts_is_accepted() -> None:
    config = config_from_text(
        "metrics: {listen: '127.0.0.1:9481'}\n"
        "api: {socket: /run/gpu-agent/agent.sock, group: root}\n"
        "interval_seconds: 0.1\n"
        "remediation: {alertmanager_url: 'https://user:pw@am.example:9093/prefix', "
        "reboot_command: [/usr/bin/systemctl, reboot, --when=+1min]}\n"
        "services:\n  - {name: a, health_url: 'http://[::1]:30000/health', probe_interval_seconds: 0.05}\n"
    )
    assert config.interval_seconds == 0.1 and config.api.group == "root"
    assert config_from_text("metrics: {listen: ':9481'}\n").metrics.listen == ":9481"  # every IPv4 address
    assert AgentConfig().remediation.reboot_command == ["/usr/bin/systemctl", "reboot"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("metrics: {listen: '10.255.255.254:9481'}", "metrics.listen: cannot listen on 10.255.255.254: "),
        (f"api: {{group: {UNKNOWN_GROUP}}}", f"api.group: unknown group '{UNKNOWN_GROUP}'"),
        ("api: {socket: /tmp}", "api.socket: /tmp is a directory"),
        ("remediation: {alertmanager_url: 'file:///x'}", "remediation.alertmanager_url: must be an http"),
        ("remediation: {reboot_command: [reboot]}", "remediation.reboot_command: the program must be an absolute"),
        ("interval_seconds: 1e-300", "interval_seconds: must be >= 0.1"),
    ],
)
def test_check_config_rejects_what_run_would_crash_on(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(f"mode: observe\n{line}\n")
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith(f"{path}:2 {expected}"), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
