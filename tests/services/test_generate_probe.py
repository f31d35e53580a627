"""The generate probe against real stand-in servers of each flavour."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import StandinServer, free_port
from agent.demo.standin_traffic import MODEL_NAME
from agent.services.generate_probe import generate_probe
from agent.services.prober import HealthProber


def origin(server: StandinServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def test_sglang_is_probed_with_health_generate(tmp_path: Path) -> None:
    with StandinServer(tmp_path, extra_args=("--flavor", "sglang")) as server:
        ok, detail = generate_probe(origin(server), "sglang", 2.0)
    assert ok
    assert detail.startswith("health_generate in ")


@pytest.mark.parametrize("kind", ["vllm", None])
def test_vllm_is_probed_with_a_one_token_completion_on_its_served_model(tmp_path: Path, kind: str | None) -> None:
    # with no kind, sglang's endpoint answers 404 on vLLM and the completion is tried next
    with StandinServer(tmp_path, extra_args=("--flavor", "vllm")) as server:
        ok, detail = generate_probe(origin(server), kind, 2.0)
    assert ok
    assert detail.startswith(f"1-token completion on {MODEL_NAME} in ")


def test_a_server_up_but_not_serving_fails_the_probe(tmp_path: Path) -> None:
    with StandinServer(tmp_path, extra_args=("--flavor", "vllm")) as server:
        server.set_mode("503")
        assert generate_probe(origin(server), "vllm", 2.0) == (False, "HTTP 503 from /v1/models")
    with StandinServer(tmp_path, extra_args=("--flavor", "sglang")) as server:
        server.set_mode("503")
        assert generate_probe(origin(server), None, 2.0) == (False, "HTTP 503 from /health_generate")


def test_a_wedged_server_fails_within_the_timeout(tmp_path: Path) -> None:
    with StandinServer(tmp_path, extra_args=("--flavor", "vllm")) as server:
        server.set_mode("hang")
        started = time.monotonic()
        ok, detail = generate_probe(origin(server), "vllm", 0.5)
        assert time.monotonic() - started < 1.5
    assert not ok
    assert detail == "timed out after 0.5 s"


def test_nothing_listening_fails_the_probe() -> None:
    ok, detail = generate_probe(f"http://127.0.0.1:{free_port()}", "sglang", 1.0)
    assert not ok
    assert "refused" in detail


def test_the_prober_uses_the_generate_probe_when_configured(tmp_path: Path) -> None:
    with StandinServer(tmp_path, extra_args=("--flavor", "vllm")) as server:
        service = ServiceConfig.model_validate(
            {"name": "vllm", "health_url": server.health_url, "probe": "generate", "probe_timeout_seconds": 2}
        )
        result = HealthProber([service]).probe_once("vllm")
    assert result.ok
    assert result.detail.startswith(f"1-token completion on {MODEL_NAME}")
