"""The services model's inference keys (metrics_url, kind, slo, probe) and TRITON_CACHE_DIR in the
environment of command services the agent starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.config import AgentConfig, ConfigError, config_from_text
from agent.config.service_entry import ServiceConfig
from agent.host.paths import HostPaths
from agent.host.processes import MINIMAL_ENV
from agent.policy.base import HostContext
from agent.policy.triton_cache import triton_environments
from agent.services.managers import CommandManager, build_managers


def service(**fields: object) -> ServiceConfig:
    return ServiceConfig.model_validate({"name": "sglang", **fields})


def test_metrics_url_defaults_to_the_health_urls_origin() -> None:
    assert service(health_url="http://127.0.0.1:30000/health").effective_metrics_url == "http://127.0.0.1:30000/metrics"
    assert service(health_url="https://gpu7:8443/v1/health?deep=1").effective_metrics_url == "https://gpu7:8443/metrics"
    assert service().effective_metrics_url is None
    explicit = service(health_url="http://127.0.0.1:30000/health", metrics_url="http://127.0.0.1:30001/metrics")
    assert explicit.effective_metrics_url == "http://127.0.0.1:30001/metrics"
    off = service(health_url="http://127.0.0.1:30000/health", metrics_url=False)
    assert off.effective_metrics_url is None


def test_inference_keys_default_to_off() -> None:
    plain = service(health_url="http://127.0.0.1:30000/health")
    assert (plain.kind, plain.slo, plain.probe) == (None, None, "health")


def test_a_full_inference_service_loads_from_yaml() -> None:
    config = config_from_text(
        """
services:
  - name: sglang
    health_url: "http://127.0.0.1:30000/health"
    kind: sglang
    probe: generate
    slo: {e2e_p95_seconds: 1.5, ttft_p95_seconds: 0.4}
"""
    )
    (loaded,) = config.services
    assert loaded.kind == "sglang"
    assert loaded.probe == "generate"
    assert loaded.slo is not None
    assert (loaded.slo.e2e_p95_seconds, loaded.slo.ttft_p95_seconds, loaded.slo.min_requests) == (1.5, 0.4, 20)


@pytest.mark.parametrize(
    ("yaml_service", "line", "message"),
    [
        ("    kind: triton\n", 4, "services[0].kind: must be 'sglang', 'vllm' or 'generic'"),
        (
            "    metrics_url: ftp://x/metrics\n",
            4,
            "services[0].metrics_url: must be an http:// or https:// URL, or false",
        ),
        ("    slo: {}\n", 4, "services[0].slo: needs e2e_p95_seconds and/or ttft_p95_seconds"),
        ("    slo: {e2e_p95_seconds: 0}\n", 4, "services[0].slo.e2e_p95_seconds: must be > 0"),
        ("    slo: {e2e_p95: 1.5}\n", 4, "services[0].slo.e2e_p95: unknown key (did you mean 'e2e_p95_seconds'?)"),
        ("    probe: deep\n", 4, "services[0].probe: must be 'health' or 'generate'"),
        ("    probe: generate\n    kind: generic\n", 2, "services[0]: probe 'generate' needs kind sglang or vllm"),
    ],
)
def test_invalid_inference_keys_name_file_line_and_field(yaml_service: str, line: int, message: str) -> None:
    text = f'services:\n  - name: sglang\n    health_url: "http://127.0.0.1:30000/health"\n{yaml_service}'
    with pytest.raises(ConfigError) as caught:
        config_from_text(text, "agent.yaml")
    assert f"agent.yaml:{line} {message}" in str(caught.value)


def test_generate_probe_and_slo_need_an_address() -> None:
    with pytest.raises(ValidationError, match="probe 'generate' needs health_url"):
        service(probe="generate")
    with pytest.raises(ValidationError, match="slo needs the server's metrics"):
        service(slo={"e2e_p95_seconds": 1.5})
    assert service(slo={"e2e_p95_seconds": 1.5}, metrics_url="http://127.0.0.1:1/metrics").slo is not None


# -- TRITON_CACHE_DIR --------------------------------------------------------------------------------


def env_dumping_service(name: str, out: Path) -> dict[str, object]:
    dump = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"
    return {
        "name": name,
        "manager": "command",
        "start_command": [sys.executable, "-c", dump, str(out)],
        "stop_command": ["/bin/true"],
    }


def test_command_services_listed_by_triton_cache_start_with_triton_cache_dir(tmp_path: Path) -> None:
    listed, other = tmp_path / "listed.json", tmp_path / "other.json"
    config = AgentConfig.model_validate(
        {
            "host_root": str(tmp_path / "root"),
            "policy": {"node": {"triton_cache": {"path": "/var/cache/triton", "services": ["sglang"]}}},
            "services": [env_dumping_service("sglang", listed), env_dumping_service("vllm", other)],
        }
    )
    host = HostContext(HostPaths.at(tmp_path / "root"))
    managers = build_managers(config, host)
    for started in config.services:
        managers[started.name].start(started)
    # the directory as the started process sees it: under host_root (the demo's tree; / on a real host)
    cache_dir = str(tmp_path / "root" / "var" / "cache" / "triton")
    assert json.loads(listed.read_text()) == {**MINIMAL_ENV, "TRITON_CACHE_DIR": cache_dir}
    assert "TRITON_CACHE_DIR" not in json.loads(other.read_text())


def test_triton_cache_matches_services_by_unit_name_too(tmp_path: Path) -> None:
    config = AgentConfig.model_validate(
        {
            "policy": {"node": {"triton_cache": {"path": "/var/cache/triton", "services": ["vllm-main.service"]}}},
            "services": [{**env_dumping_service("vllm", tmp_path / "x"), "unit": "vllm-main.service"}],
        }
    )
    environments = triton_environments(config, HostContext(HostPaths.at("/")))
    assert environments == {"vllm": {"TRITON_CACHE_DIR": "/var/cache/triton"}}
    assert triton_environments(AgentConfig(), HostContext(HostPaths.at("/"))) == {}


def test_a_command_manager_without_environments_starts_with_the_minimal_one(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    CommandManager().start(ServiceConfig.model_validate(env_dumping_service("sglang", out)))
    assert json.loads(out.read_text()) == MINIMAL_ENV
