"""Property-based fuzzing of what the agent reads from people, clients and servers: agent.yaml, rules.d,
the status socket, inference servers' /metrics pages and JSON answers. Whatever comes in, the answer
is a valid result or a clear error (a ConfigError whose every problem names the file, and the line
when there is one; an error response on the socket; a service's `unreadable page`), never a
traceback, a crash or a hang. The kernel-log parser has its own properties in test_kernel_log_parser.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import write_agent_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import api, api_server, safe_yaml
from agent.config import AgentConfig, ConfigError, config_from_text, load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.host import safe_json
from agent.rules.config import Rule, load_rules
from agent.services.scrape import ScrapeError, parse_reading
from agent.services.window import LatencyWindow, histogram_quantile

FILE = "/etc/gpu-agent/agent.yaml"
# A deadline per example: a parser bomb shows up as time (the 391-byte alias bomb took minutes
# before running out of memory), so no example may take long. Generous for a loaded CI machine.
FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=3),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BOMBS = settings(FUZZ, max_examples=60)

VALID_CONFIG: dict[str, Any] = {
    "mode": "enforce",
    "backend": "simulated",
    "simulated": {"profile": "h200x2", "privileged": True},
    "interval_seconds": 5,
    "policy_interval_seconds": 60,
    "metrics": {"listen": "127.0.0.1:9481"},
    "api": {"socket": "/run/gpu-agent/agent.sock", "group": None},
    "policy": {
        "node": {"transparent_hugepages": "never", "nouveau": "blacklisted"},
        "gpus": [
            {
                "match": {"model": "NVIDIA H200*"},
                "power_limit_watts": 600,
                "locked_clocks": {"gpu_mhz": [1500, 1980]},
                "persistence": "enabled",
                "ecc": "enabled",
            },
            {"match": {"index": 1}, "fan_curve": [[30, 30], [50, 65], [75, 100]]},
        ],
        "modes": {"ecc": "observe"},
    },
    "services": [
        {"name": "sglang", "unit": "sglang.service", "health_url": "http://127.0.0.1:30000/health", "gpus": [0, 1]},
        {"name": "vllm", "manager": "command", "start_command": ["/bin/true"], "stop_command": ["/bin/true"]},
    ],
    "remediation": {"rules_dir": "/etc/gpu-agent/rules.d", "alertmanager_url": "http://127.0.0.1:9093"},
}

VALID_RULES: dict[str, Any] = {
    "rules": [
        {
            "name": "reset-on-xid",
            "match": {"xid": {"codes": [48, 79], "buckets": ["RESTART_APP"]}},
            "gpus": "all",
            "actions": [
                {"restart_service": {"service": "sglang"}},
                "reset_gpu",
                {"alertmanager": {"summary": "page the on-call"}},
            ],
            "cooldown_seconds": 300,
            "max_attempts": 3,
            "window_seconds": 3600,
            "on_exhausted": [{"webhook": {"url": "https://hooks.example/gpu", "headers": {"X-Token": "abc"}}}],
        },
        {
            "name": "thermal",
            "match": {"throttle": {"reasons": ["hw_thermal_slowdown"], "held_seconds": 60}},
            "gpus": [0],
            "actions": [{"recommend_reboot": {"reason": "hot"}}],
            "dry_run": True,
        },
        {"name": "svc", "match": {"service_unhealthy": {"probes": 3}}, "actions": ["restart_service"]},
    ]
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["all", "enforce", "observe", "never", "reset_gpu", "NVIDIA H200*", "/bin/true", "0755"])
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


def locations(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a nested document (the root included)."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from locations(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from locations(child, (*path, index))


@st.composite
def mutated(draw: st.DrawFn, document: dict[str, Any]) -> Any:
    """A valid document with a few random edits: a value replaced, a key dropped, renamed or added."""
    result: Any = copy.deepcopy(document)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(list(locations(result))))
        if not path:
            result = draw(values) if draw(st.integers(0, 9)) == 0 else result
            continue
        parent = result
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        operation = draw(st.sampled_from(["replace", "delete", "rename", "add"]))
        if operation == "replace":
            parent[key] = draw(values)
        elif operation == "delete":
            del parent[key]
        elif operation == "rename" and isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = parent.pop(key)
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(values)
        else:
            parent.insert(key, draw(values))
    return result


@st.composite
def edited_text(draw: st.DrawFn, document: dict[str, Any]) -> str:
    """A valid document's YAML text with characters inserted, deleted or swapped: broken syntax."""
    text = yaml.safe_dump(document, sort_keys=False)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        position = draw(st.integers(min_value=0, max_value=len(text)))
        junk = draw(st.sampled_from([":", "-", "[", "]", "{", "}", "'", '"', "\t", "\n", " ", "&a", "*a", "!!", "%"]))
        end = position + draw(st.integers(min_value=0, max_value=3))
        text = text[:position] + junk + text[end:]
    return text


def check_config_text(text: str) -> None:
    try:
        loaded = config_from_text(text, FILE)
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.file == FILE
            assert problem.line is None or problem.line >= 1
            assert problem.message
            assert str(problem).startswith(FILE)
        # A document that is a mapping and is valid YAML is blamed on a line.
        with contextlib.suppress(yaml.YAMLError):
            if isinstance(yaml.safe_load(text), dict):
                assert all(p.line is not None for p in exc.problems), exc.problems
    else:
        assert isinstance(loaded, AgentConfig)


# -- agent.yaml -----------------------------------------------------------------------------------


@FUZZ
@given(values)
def test_any_yaml_document_is_a_config_or_a_config_error(document: Any) -> None:
    check_config_text(yaml.safe_dump(document))


@FUZZ
@given(mutated(VALID_CONFIG))
def test_a_mutated_valid_config_is_a_config_or_a_config_error(document: Any) -> None:
    check_config_text(yaml.safe_dump(document, sort_keys=False))


@FUZZ
@given(edited_text(VALID_CONFIG))
def test_broken_yaml_syntax_is_a_config_error_with_a_line(text: str) -> None:
    check_config_text(text)


def check_arbitrary_bytes(data: bytes, name: str, load: Callable[[Path], object]) -> None:
    """`data` in a file called `name`, read by `load`: loaded, or a ConfigError whose every problem
    names that file and says what is wrong."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / name
        path.write_bytes(data)
        path.chmod(0o644)
        try:
            load(path)
        except ConfigError as exc:
            assert all(p.file == str(path) and p.message for p in exc.problems)


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_in_the_config_file(data: bytes) -> None:
    check_arbitrary_bytes(data, "agent.yaml", load_config)


def test_the_valid_documents_are_valid() -> None:
    assert config_from_text(yaml.safe_dump(VALID_CONFIG), FILE).mode.value == "enforce"
    with tempfile.TemporaryDirectory() as directory:
        assert len(load_rules([write_rules(Path(directory), yaml.safe_dump(VALID_RULES))])) == 3


@FUZZ
@given(st.text(max_size=80) | st.from_regex(r"\[?[0-9a-fA-F:.%a-z]{0,40}\]?:[0-9]{1,6}", fullmatch=True))
def test_any_listen_address_is_accepted_or_a_clear_error(listen: str) -> None:
    found = config_error(f"metrics: {{listen: {json.dumps(listen)}}}\n")
    assert all(p.startswith(f"{FILE}:1 metrics.listen: ") for p in found), found


# -- hostile documents: bombs that reach the loader's limits -------------------------------------


@st.composite
def alias_bombs(draw: st.DrawFn) -> tuple[str, int]:
    """(text, line of the first anchor): billion-laughs shapes of any depth and fan-out, block or flow."""
    levels = draw(st.integers(min_value=1, max_value=12))
    fanout = draw(st.integers(min_value=1, max_value=16))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True), min_size=levels, max_size=levels))
    prefix = draw(st.sampled_from(["", "mode: observe\n", "# a comment\n\n", "policy:\n  gpus: []\n"]))
    lines = [f"l0: &{names[0]} [lol, lol]"]
    for level in range(1, levels):
        refs = [f"*{names[level - 1]}"] * fanout
        if draw(st.booleans()):
            lines.append(f"l{level}: &{names[level]} [{', '.join(refs)}]")
        else:
            lines.append(f"l{level}: &{names[level]}\n" + "".join(f"  - {ref}\n" for ref in refs).rstrip("\n"))
    return prefix + "\n".join(lines) + "\n", prefix.count("\n") + 1


@st.composite
def nested_documents(draw: st.DrawFn) -> tuple[str, int]:
    """(text, nesting depth): brackets, braces and indented blocks, up to thousands of levels."""
    depth = draw(st.integers(min_value=1, max_value=3000) | st.integers(min_value=60, max_value=70))
    style = draw(st.sampled_from(["lists", "maps", "mixed", "block"]))
    if style == "block":  # indentation grows with depth: 400 levels is 160 KB, within the size limit
        depth = min(depth, 400)
        text = "".join("  " * n + f"k{n}:\n" for n in range(depth)) + "  " * depth + "leaf\n"
        return text, depth
    pattern = draw(st.integers(min_value=0, max_value=2**16 - 1)) if style == "mixed" else 0
    kinds = [
        "[" if style == "lists" or (style == "mixed" and pattern >> (level % 16) & 1) else "{a: "
        for level in range(depth)
    ]
    closers = "".join("]" if opener == "[" else "}" for opener in reversed(kinds))
    return "".join(kinds) + "1" + closers + "\n", depth


def large_documents(min_bytes: int, max_bytes: int) -> st.SearchStrategy[str]:
    chunks = st.sampled_from(["# padding\n", "services: []\n", "mode: observe\n", "x: " + "y" * 200 + "\n"])
    return st.tuples(chunks, st.integers(min_value=min_bytes, max_value=max_bytes)).map(
        lambda chunk_size: chunk_size[0] * (chunk_size[1] // len(chunk_size[0]) + 1)
    )


def config_error(text: str) -> list[str]:
    started = time.monotonic()
    try:
        config_from_text(text, FILE)
    except ConfigError as exc:
        assert time.monotonic() - started < 2.0
        assert all(p.file == FILE and p.message for p in exc.problems)
        return [str(p) for p in exc.problems]
    return []


@BOMBS
@given(alias_bombs())
def test_alias_bombs_are_refused_at_the_first_anchor(bomb: tuple[str, int]) -> None:
    text, line = bomb
    found = config_error(text)
    assert len(found) == 1 and found[0].startswith(f"{FILE}:{line}: invalid YAML: anchor &"), found


@BOMBS
@given(nested_documents())
def test_nesting_past_the_limit_is_refused_and_within_it_parses(document: tuple[str, int]) -> None:
    text, depth = document
    found = config_error(text)
    nested_error = [p for p in found if f"nested more than {safe_yaml.MAX_DEPTH} levels deep" in p]
    # The top-level mapping or list counts as a level, a scalar leaf does not.
    assert bool(nested_error) == (depth > safe_yaml.MAX_DEPTH), (depth, found)


@BOMBS
@given(large_documents(safe_yaml.MAX_YAML_BYTES + 1, 8 * safe_yaml.MAX_YAML_BYTES) | large_documents(1, 60_000))
def test_oversized_documents_are_refused_by_size_alone(text: str) -> None:
    found = config_error(text)
    size = len(text.encode())
    if size > safe_yaml.MAX_YAML_BYTES:
        assert found == [
            f"{FILE}: file is {size} bytes, more than the {safe_yaml.MAX_YAML_BYTES} bytes gpu-agent reads"
        ]
    else:
        assert not any("more than the" in p for p in found), found


@BOMBS
@given(st.one_of(alias_bombs().map(lambda b: b[0]), nested_documents().map(lambda d: d[0])))
def test_rules_files_meet_the_same_limits(text: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = write_rules(Path(directory), text)
        started = time.monotonic()
        try:
            load_rules([path])
        except ConfigError as exc:
            assert all(p.file == str(path) and p.message for p in exc.problems)
        assert time.monotonic() - started < 2.0


# -- rules.d --------------------------------------------------------------------------------------


def write_rules(directory: Path, text: str) -> Path:
    path = directory / "10-fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    path.chmod(0o644)
    return path


def check_rules_text(text: str, allow_reboot: bool = False) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = write_rules(Path(directory), text)
        try:
            rules = load_rules([path], allow_reboot=allow_reboot)
        except ConfigError as exc:
            assert exc.problems
            for problem in exc.problems:
                assert problem.file == str(path)
                assert problem.line is None or problem.line >= 1
                assert problem.message
        else:
            assert all(isinstance(rule, Rule) and rule.source.startswith(f"{path}:") for rule in rules)


@FUZZ
@given(mutated(VALID_RULES), st.booleans())
def test_a_mutated_valid_rules_file_is_rules_or_a_config_error(document: Any, allow_reboot: bool) -> None:
    check_rules_text(yaml.safe_dump(document, sort_keys=False), allow_reboot)


@FUZZ
@given(values)
def test_any_yaml_document_as_a_rules_file(document: Any) -> None:
    check_rules_text(yaml.safe_dump({"rules": document} if isinstance(document, list) else document))


@FUZZ
@given(edited_text(VALID_RULES))
def test_broken_rules_yaml_is_a_config_error(text: str) -> None:
    check_rules_text(text)


# -- the status socket ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon_handlers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The real daemon's API handlers, after one loop on a simulated node."""
    tmp = tmp_path_factory.mktemp("api")
    config_path, _ = write_agent_config(tmp)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    daemon.loop_once()
    daemon.shutdown()
    handlers = daemon.live.publisher.api_handlers()

    def broken(_params: Any) -> Any:
        raise KeyError("a handler with a bug")

    return {**handlers, "broken": broken}


requests = (
    st.binary(max_size=400)
    | st.text(max_size=200).map(str.encode)
    | values.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries(
        {"method": st.sampled_from(["status", "ping", "broken", "events", ""]) | values, "params": values}
    ).map(lambda v: json.dumps(v).encode())
)


@FUZZ
@given(requests)
def test_any_request_line_gets_a_response_and_never_raises(daemon_handlers: dict[str, Any], line: bytes) -> None:
    response = api_server.handle_request(line, daemon_handlers)
    assert isinstance(response["ok"], bool)
    assert response["ok"] or isinstance(response["error"], str)
    json.dumps(response, default=str)  # it can be sent


@contextlib.contextmanager
def server(directory: Path, handlers: dict[str, Any]) -> Iterator[Path]:
    path = directory / "agent.sock"
    running = api_server.ApiServer(path, handlers)
    running.start()
    try:
        yield path
    finally:
        running.close()


def exchange(path: Path, payload: bytes) -> bytes:
    """Send payload, close our side (so a line without a newline ends), read the whole answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


@pytest.fixture(scope="module")
def api_socket(daemon_handlers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with server(tmp_path_factory.mktemp("socket"), daemon_handlers) as path:
        yield path


@FUZZ
@given(requests, st.booleans())
def test_a_real_server_answers_every_request_with_one_json_line(api_socket: Path, line: bytes, newline: bool) -> None:
    answer = exchange(api_socket, line + (b"\n" if newline else b""))
    assert answer.endswith(b"\n") and answer.count(b"\n") == 1, answer
    assert isinstance(json.loads(answer)["ok"], bool)
    assert api.call(api_socket, "ping")["version"]  # still serving


def test_oversized_silent_and_concurrent_clients(
    daemon_handlers: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_server, "REQUEST_TIMEOUT_SECONDS", 0.5)
    with server(tmp_path, daemon_handlers) as path:
        big = json.loads(
            exchange(path, b'{"method": "ping", "x": "' + b"a" * (api_server.MAX_REQUEST_BYTES + 10) + b'"}\n')
        )
        assert big == {"ok": False, "error": "request too large"}
        # a client that connects and says nothing holds one thread until the timeout, no one else
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(path))
            results: list[Any] = []
            workers = [threading.Thread(target=lambda: results.append(api.call(path, "ping"))) for _ in range(20)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(10)
            assert len(results) == 20
            silent.settimeout(5)
            assert silent.recv(100) == b""  # the server gave up on it
        status = api.call(path, "status")
        assert status["source"] == "daemon" and len(status["gpus"]) == 2


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_in_a_rules_file(data: bytes) -> None:
    check_arbitrary_bytes(data, "10-bytes.yaml", lambda path: load_rules([path]))


# -- what inference servers answer ------------------------------------------------------------------

SGLANG_PAGE = (Path(__file__).parent / "fixtures" / "service-metrics" / "sglang-two-ranks.txt").read_text()
E2E = "sglang:e2e_request_latency_seconds"
NUMBERS = st.sampled_from(["0", "1", "7", "-1", "NaN", "+Inf", "-Inf", "1e308", "1.7e308", "abc", "", "0x10", "1_0"])


@st.composite
def hostile_pages(draw: st.DrawFn) -> str:
    """A real sglang page with some numbers, `le` values and lines swapped for hostile ones."""
    lines = SGLANG_PAGE.splitlines()
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        index = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        line = lines[index]
        operation = draw(st.sampled_from(["value", "le", "drop", "duplicate", "junk"]))
        if operation == "value" and " " in line and not line.startswith("#"):
            lines[index] = line.rsplit(" ", 1)[0] + " " + draw(NUMBERS)
        elif operation == "le" and 'le="' in line:
            head, _, rest = line.partition('le="')
            lines[index] = head + 'le="' + draw(NUMBERS) + '"' + rest.partition('"')[2]
        elif operation == "drop":
            lines[index] = ""
        elif operation == "duplicate":
            lines.insert(index, line)
        else:
            lines[index] = draw(st.text(max_size=40))
    return "\n".join(lines) + "\n"


def check_readings(pages: list[str]) -> None:
    """Every page parses or is a ScrapeError; the window over what parsed gives figures whose every
    number is finite, never an exception."""
    window = LatencyWindow("llm")
    for step, text in enumerate(pages):
        try:
            window.add(parse_reading(text, "sglang", timestamp_seconds=step * 5.0))
        except ScrapeError as exc:
            window.add_error(str(exc))
        figures = window.figures()
        assert figures is not None
        for latency in figures.latency.values():
            assert all(q is None or math.isfinite(q) for q in latency.quantiles.values()), latency
        for gauge in (figures.running, figures.waiting, figures.kv_cache_usage_ratio):
            assert gauge is None or math.isfinite(gauge)


@FUZZ
@given(st.lists(hostile_pages(), min_size=1, max_size=4))
def test_hostile_server_pages_are_figures_or_an_unreadable_page(pages: list[str]) -> None:
    check_readings([SGLANG_PAGE, *pages])


@FUZZ
@given(st.lists(st.text(max_size=300), min_size=1, max_size=3))
def test_arbitrary_text_as_a_metrics_page(pages: list[str]) -> None:
    check_readings(pages)


@st.composite
def histograms(draw: st.DrawFn) -> tuple[tuple[float, ...], list[float]]:
    """Bounds that go up to +Inf and as many counts, of any float at all."""
    finite = draw(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=7, unique=True))
    bounds = (*sorted(finite), math.inf)
    return bounds, draw(st.lists(st.floats(), min_size=len(bounds), max_size=len(bounds)))


@FUZZ
@given(histograms(), st.floats(min_value=0, max_value=1))
def test_histogram_quantile_is_a_bound_or_none_never_an_exception(
    histogram: tuple[tuple[float, ...], list[float]], q: float
) -> None:
    bounds, counts = histogram
    found = histogram_quantile(q, bounds, counts)
    assert found is None or (math.isfinite(found) and min(0.0, bounds[0]) <= found <= max(bounds[:-1]))


@FUZZ
@given(
    st.binary(max_size=400)
    | st.builds(lambda n, c: c * n, st.integers(0, 5000), st.sampled_from([b"[", b"{", b'{"a":']))
)
def test_any_bytes_as_json_are_a_value_or_a_json_error(data: bytes) -> None:
    """Never a RecursionError, a UnicodeDecodeError or a ValueError of another kind."""
    try:
        value = safe_json.loads(data)
    except safe_json.JsonError as exc:
        assert str(exc)
    else:
        json.dumps(value)  # a plain JSON value, nested no deeper than the bound
