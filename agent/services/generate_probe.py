"""The deeper health probe (`services[].probe: generate`): the server's own cheapest real request.

A live HTTP front end can sit on a wedged engine (a hung NCCL collective, a dead scheduler
process): `/health` keeps answering while no token comes out. This probe makes the engine work:

- sglang: `GET /health_generate`, which runs a one-token generation inside the server;
- vLLM: the served model from `GET /v1/models`, then `POST /v1/completions` with `max_tokens: 1`.

With no kind configured, sglang's endpoint is tried first and a 404 falls through to vLLM's
requests. The whole probe shares one deadline, covering connect, headers and body of every request
(`agent.host.http_read`); answers are read up to 64 KB and parsed depth-bounded
(`agent.host.safe_json`). The answer has `http_probe`'s shape (healthy, what happened), so the
prober can use either.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

from agent.host import http_read, safe_json

#: A one-token answer or a model list is a few hundred bytes; more is not a healthy server.
_BODY_MAX_BYTES = 64 * 1024


class _ProbeFailed(Exception):
    def __init__(self, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


def _request(url: str, deadline: float, timeout_seconds: float, payload: dict[str, Any] | None = None) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _ProbeFailed(f"timed out after {timeout_seconds:g} s")
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"User-Agent": "gpu-agent"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        answer = http_read.exchange(
            url, left, _BODY_MAX_BYTES, data=data, headers=headers, shown_seconds=timeout_seconds
        )
    except http_read.HttpReadError as exc:
        raise _ProbeFailed(exc.detail) from None
    if not 200 <= answer.status < 300:
        raise _ProbeFailed(f"HTTP {answer.status} from {urllib.parse.urlsplit(url).path}", answer.status)
    return answer.body


def _served_model(origin: str, deadline: float, timeout_seconds: float) -> str:
    body = _request(origin + "/v1/models", deadline, timeout_seconds)
    try:
        models = safe_json.loads(body)["data"]
        model = models[0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise _ProbeFailed("/v1/models lists no model") from None
    if not isinstance(model, str):
        raise _ProbeFailed("/v1/models lists no model")
    return model


def _vllm_completion(origin: str, deadline: float, timeout_seconds: float) -> str:
    model = _served_model(origin, deadline, timeout_seconds)
    payload = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    body = _request(origin + "/v1/completions", deadline, timeout_seconds, payload)
    try:
        choices = safe_json.loads(body)["choices"]
    except (ValueError, KeyError, TypeError):
        raise _ProbeFailed("/v1/completions answered without choices") from None
    if not choices:
        raise _ProbeFailed("/v1/completions answered without choices")
    return f"1-token completion on {model}"


def generate_probe(origin: str, kind: str | None, timeout_seconds: float) -> tuple[bool, str]:
    """(healthy, what happened) for one generate probe of the server at `origin` (`http://host:port`)."""
    deadline = time.monotonic() + timeout_seconds
    started = time.monotonic()
    try:
        if kind == "vllm":
            detail = _vllm_completion(origin, deadline, timeout_seconds)
        else:
            try:
                _request(origin + "/health_generate", deadline, timeout_seconds)
                detail = "health_generate"
            except _ProbeFailed as exc:
                if kind == "sglang" or exc.status != 404:
                    raise
                detail = _vllm_completion(origin, deadline, timeout_seconds)
    except _ProbeFailed as exc:
        return False, exc.detail
    return True, f"{detail} in {time.monotonic() - started:.2f} s"
