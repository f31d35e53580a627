"""The CLI's fast paths: `status` against a daemon, `--version` and `--help` import only what they
use (no pydantic models, no GPU backend, no structlog, no YAML parser for the configs people write),
and the YAML-free reading of `api.socket` agrees with the YAML parser whenever it answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import running_agent

from agent import safe_yaml
from agent.cli.config_socket import api_socket_without_yaml
from agent.cli.parser import INJECT_HELP, build_parser
from agent.defaults import DEFAULT_SOCKET_PATH
from agent.tune.defaults import TUNE_HELP

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Imported by none of the thin paths: the config models, the backends, logging, the YAML parser,
#: the policy engine and the store, and what they pull in.
HEAVY = (
    "pydantic",
    "agent.config",
    "agent.backend.base",
    "agent.backend.sim",
    "agent.backend.nvml",
    "pynvml",
    "structlog",
    "rich",
    "yaml",
    "agent.policy.engine",
    "agent.store.database",
    "agent.demo.inject",
    "sqlite3",
    "asyncio",
    "shutil",
    "dataclasses",
    # what status, --version and --help used to load for nothing: a tenth of a start each (pathlib
    # too, but the editable install's own finder loads it at every start of the test venv)
    "typing",
    "socketserver",
    "agent.api_server",
    "agent.cli.commands",
    "agent.cli.check_config",
    "agent.tune.cli",
)

PROBE = """
import runpy, sys, json
sys.argv = ["gpu-agent", *json.loads(sys.argv[1])]
try:
    runpy.run_module("agent.cli", run_name="__main__")
except SystemExit:
    pass
sys.stdout.flush()
sys.stderr.write("MODULES " + json.dumps(sorted(sys.modules)) + "\\n")
"""


def modules_after(*argv: str) -> tuple[set[str], str]:
    """What `gpu-agent ARGV` imported, and what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    line = next(line for line in done.stderr.splitlines() if line.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES "))), done.stdout


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_status_against_a_daemon_imports_none_of_the_heavy_modules(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        modules, shown = modules_after("status", "--config", str(agent.config_path))
        assert "(daemon)" in shown.splitlines()[0], shown
        assert heavy(modules) == []
        modules, shown = modules_after("status", "--json", "--config", str(agent.config_path))
        assert json.loads(shown)["source"] == "daemon"
        assert heavy(modules) == []


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"]])
def test_version_and_help_import_none_of_the_heavy_modules(argv: list[str]) -> None:
    modules, shown = modules_after(*argv)
    assert shown.startswith("gpu-agent 0") or "usage: gpu-agent" in shown
    assert heavy(modules) == []


@pytest.mark.parametrize(("name", "line"), [("inject", INJECT_HELP), ("tune", TUNE_HELP)])
def test_the_help_line_of_a_command_built_on_demand_is_its_parsers_own(name: str, line: str) -> None:
    def help_line(command: str | None) -> str | None:
        sub = next(a for a in build_parser(command)._actions if a.dest == "command")
        return next(c.help for c in sub._choices_actions if c.dest == name)  # type: ignore[attr-defined]

    assert help_line(None) == help_line(name) == help_line("status") == line


SHIPPED_CONFIG = (REPO_ROOT / "packaging" / "agent.yaml").read_bytes()

#: Configs as people write them, and shapes only the YAML parser reads right.
CONFIGS: list[bytes] = [
    SHIPPED_CONFIG,
    SHIPPED_CONFIG.replace(b"  socket: /run/gpu-agent/agent.sock", b"  socket: /run/x/other.sock  # moved"),
    SHIPPED_CONFIG.replace(b"  # group: gpu-ops", b"  group: gpu-ops"),
    b"mode: observe\n",
    b"api: {socket: /tmp/a.sock}\n",
    b"api: {socket: /tmp/a.sock, group: adm}  # comment\n",
    b"api: {group: adm}\n",
    b"api:\n  group: adm\n",
    b"api:\n\n  # the socket\n  socket: /tmp/a.sock\nmetrics: {listen: '127.0.0.1:1'}\n",
    b'api: {socket: "/tmp/quoted.sock"}\n',
    b"api: {socket: '/tmp/single.sock'}\n",
    b'"api": {socket: /tmp/quoted-key.sock}\n',
    b"api:\n  socket: /tmp/a.sock\n   group: adm\n",
    b"api:\n    socket: /tmp/a.sock\n",
    b"api:\n  socket: >-\n    /tmp/folded.sock\n",
    b"api: &a {socket: /tmp/anchored.sock}\n",
    b"base: &b {socket: /tmp/merged.sock}\napi:\n  <<: *b\n",
    b"x: &k api\n*k : {socket: /tmp/alias-key.sock}\n",
    b'"\\x61pi": {socket: /tmp/escaped-key.sock}\n',
    b"{api: {socket: /tmp/flow.sock}}\n",
    b"? api\n: {socket: /tmp/complex-key.sock}\n",
    b"---\napi: {socket: /tmp/document.sock}\n",
    b"api: !!map {socket: /tmp/tagged.sock}\n",
    b"api: {socket: /tmp/a.sock}\napi: {socket: /tmp/b.sock}\n",
    b"metrics:\n  api: {socket: /tmp/nested.sock}\n",
    b"api: {socket: relative.sock}\n",
    b"api:\n  socket: /tmp/a.sock\n  socket: /tmp/b.sock\n",
    b"mode: observe # api: {socket: /tmp/commented.sock}\n",
    b"\xef\xbb\xbfapi: {socket: /tmp/byte-order-mark.sock}\n",
    "api: {socket: /tmp/sock\u00e9t.sock}\n".encode(),
    b"api: {socket: /tmp/a.sock}\r\n",
    b"api:\n\tsocket: /tmp/tab.sock\n",
    b"api:\n  socket: /tmp/a.sock\n# a comment at the margin\n  group: adm\nmode: observe\n",
]


def parsed_socket(raw: bytes) -> str:
    """The socket `status` asks through the YAML parser: `api.socket`, or the default one when
    there is none or the parser refuses the file (the direct read then reports why)."""
    try:
        data = safe_yaml.load_bytes(raw, "agent.yaml").data
    except safe_yaml.ConfigError:
        return DEFAULT_SOCKET_PATH
    api = data.get("api") if isinstance(data, dict) else None
    socket = api.get("socket") if isinstance(api, dict) else None
    return str(socket) if isinstance(socket, str) else DEFAULT_SOCKET_PATH


@pytest.mark.parametrize("raw", CONFIGS, ids=range(len(CONFIGS)))
def test_the_socket_read_without_yaml_is_the_parsers_or_none(raw: bytes) -> None:
    fast = api_socket_without_yaml(raw)
    assert fast is None or fast == parsed_socket(raw)


def test_the_shapes_people_write_need_no_parser() -> None:
    assert api_socket_without_yaml(SHIPPED_CONFIG) == "/run/gpu-agent/agent.sock"
    assert api_socket_without_yaml(CONFIGS[1]) == "/run/x/other.sock"
    assert api_socket_without_yaml(b"api: {socket: /tmp/a.sock, group: adm}  # comment\n") == "/tmp/a.sock"
    assert api_socket_without_yaml(b"mode: observe\n") == DEFAULT_SOCKET_PATH
    for needs_parser in (CONFIGS[9], CONFIGS[11], CONFIGS[15], CONFIGS[16], CONFIGS[17], CONFIGS[18], CONFIGS[23]):
        assert api_socket_without_yaml(needs_parser) is None, needs_parser
