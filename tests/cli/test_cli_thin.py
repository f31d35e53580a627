"""The CLI's fast start (agent/cli/fast_start.py): `--version`, `--help`, `status` against a running
daemon and `--complete-values` import only their set, run in a fresh interpreter as /usr/bin/gpu-agent
starts them; and the YAML-free reading of `api.socket` agrees with the YAML parser whenever it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import RunningAgent, running_agent

from agent import safe_yaml
from agent.api import RUNTIME_DIR_VARIABLE
from agent.cli import fast_start
from agent.cli.config_socket import api_socket_without_yaml
from agent.cli.parser import INJECT_HELP, build_parser
from agent.defaults import DEFAULT_RUNTIME_DIR, DEFAULT_SOCKET_PATH
from agent.tune.defaults import TUNE_HELP

pytestmark = pytest.mark.real_daemon

REPO_ROOT = Path(__file__).resolve().parents[2]

#: `gpu-agent ARGV` as /usr/bin/gpu-agent runs it (`-I -X faulthandler`, main() called directly) from a
#: venv holding only the agent's dependencies: no .pth file runs at start (the test venv's editable
#: install imports pathlib and more from one), and the version is baked in as the wheel bakes it.
#: What it imported beyond the interpreter's own start goes to stderr on a line of its own.
PROBE = """
import site, sys
sys.path.insert(0, sys.argv.pop(1))
baked = type(sys)("agent._build_info")
baked.VERSION, baked.REVISION = "0.2.0", "0" * 40
sys.modules["agent._build_info"] = baked
started = set(sys.modules)
sys.argv = ["gpu-agent", *sys.argv[1:]]
from agent.cli import main
try:
    main()
except SystemExit:
    pass
sys.stdout.flush()
sys.stderr.write("\\nIMPORTED " + " ".join(sorted(set(sys.modules) - started)) + "\\n")
"""


def modules_after(*argv: str, env: dict[str, str] | None = None) -> tuple[list[str], str]:
    """What `gpu-agent ARGV` imported, and what it printed."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-X", "faulthandler", "-c", PROBE, str(REPO_ROOT), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )
    line = next((line for line in done.stderr.splitlines() if line.startswith("IMPORTED ")), None)
    assert line is not None, done.stderr
    return line.removeprefix("IMPORTED ").split(), done.stdout


def runtime_env(agent: RunningAgent, **extra: str) -> dict[str, str]:
    """The environment of a command run beside `agent`: its published socket where its host_root put it."""
    return {**os.environ, RUNTIME_DIR_VARIABLE: f"{agent.host_root}{DEFAULT_RUNTIME_DIR}", **extra}


def test_status_against_a_daemon_imports_only_the_fast_start(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        env = runtime_env(agent)
        modules, shown = modules_after("status", "--config", str(agent.config_path), env=env)
        assert "(daemon)" in shown.splitlines()[0], shown
        assert fast_start.beyond(fast_start.STATUS, modules) == []
        assert "agent.cli.config_socket" not in modules  # the published socket: the config is not read
        modules, shown = modules_after("status", "--json", "--config", str(agent.config_path), env=env)
        assert json.loads(shown)["source"] == "daemon"
        assert fast_start.beyond(fast_start.STATUS, modules) == []
        # No socket published where status looks (a daemon that predates it): the config's, without YAML.
        modules, shown = modules_after(
            "status",
            "--config",
            str(agent.config_path),
            env=dict(env, **{RUNTIME_DIR_VARIABLE: str(tmp_path / "none")}),
        )
        assert "(daemon)" in shown.splitlines()[0], shown
        assert "agent.cli.config_socket" in modules
        assert fast_start.beyond(fast_start.STATUS, modules) == []
        # Shell completion's values at TAB: the store the daemon published, no config models.
        for kind, value in (("gpus", "0"), ("ack-targets", "all")):
            modules, shown = modules_after(
                "--complete-values", kind, env=runtime_env(agent, GPU_AGENT_CONFIG=str(agent.config_path))
            )
            assert value in shown.split(), shown
            assert fast_start.beyond(fast_start.COMPLETE_VALUES, modules) == []


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [(["--version"], fast_start.VERSION), (["--help"], fast_start.HELP), (["status", "--help"], fast_start.HELP)],
)
def test_version_and_help_import_only_the_fast_start(argv: list[str], allowed: frozenset[str]) -> None:
    modules, shown = modules_after(*argv)
    assert shown.startswith("gpu-agent 0.2.0\n") or "usage: gpu-agent" in shown
    assert fast_start.beyond(allowed, modules) == []


def test_what_the_fast_start_leaves_out_is_out_of_every_set() -> None:
    for heavy in (
        "pydantic",
        "yaml",
        "structlog",
        "pynvml",
        "typing",
        "pathlib",
        "dataclasses",
        "shutil",
        "subprocess",
        "socket",
        "selectors",
        "contextlib",
    ):
        assert fast_start.beyond(fast_start.FAST_START, [heavy, f"{heavy}.part"]) == [heavy, f"{heavy}.part"]
    assert fast_start.beyond(fast_start.FAST_START, ["agent.config", "agent.cli.commands", "agent.api"]) == [
        "agent.cli.commands",
        "agent.config",
    ]


def test_the_typing_flag_is_the_agent_packages_alone() -> None:
    """`TYPE_CHECKING = False` is written once (agent/__init__.py), and once more in agent/version.py,
    which setup.py loads without the package."""
    defined = sorted(
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "agent").rglob("*.py")
        if any(line.startswith("TYPE_CHECKING =") for line in path.read_text().splitlines())
    )
    assert defined == ["agent/__init__.py", "agent/version.py"]


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
