"""Parser bombs: every YAML file gpu-agent reads goes through agent.safe_yaml, so a small hostile
file is a one-line error, quickly and in bounded memory — in check-config, in a reload (which
keeps the running config) and in the rules loader."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from daemon_harness import write_agent_config

from agent import safe_yaml
from agent.config import ConfigError, config_from_text, load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.rules.config import load_rules


def alias_bomb() -> str:
    """Billion laughs: nine levels of nine aliases, 9**9 strings once expanded."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


NESTED = "[" * 600 + "]" * 600  # 1.2 KB
BOMBS = {
    "alias": (alias_bomb(), 1, "invalid YAML: anchor &a not allowed: gpu-agent files use no anchors or aliases"),
    "nested": (NESTED, 1, "invalid YAML: nested more than 64 levels deep"),
    "nested-mapping": (
        "policy:\n" + "".join("  " * n + f"k{n}:\n" for n in range(1, 80)),
        65,
        "invalid YAML: nested more than 64 levels deep",
    ),
}
FIFTY_MB = 50 * 1024 * 1024


def test_the_bombs_are_the_size_of_the_review() -> None:
    assert 300 < len(alias_bomb()) < 400
    assert len(NESTED) == 1200


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "agent.yaml"
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    path.chmod(0o644)
    return path


def fifty_megabytes(tmp_path: Path) -> Path:
    path = tmp_path / "agent.yaml"
    with path.open("wb") as out:
        out.write(b"mode: observe\n")
        chunk = b"# " + b"x" * 1021 + b"\n"
        for _ in range(FIFTY_MB // len(chunk)):
            out.write(chunk)
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_bomb_is_one_error_with_its_line_fast_and_small(tmp_path: Path, bomb: str) -> None:
    text, line, message = BOMBS[bomb]
    path = write(tmp_path, text)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        elapsed = time.monotonic() - started
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [str(p) for p in caught.value.problems] == [f"{path}:{line}: {message}"]
    assert elapsed < 1.0
    assert peak_bytes < 5 * 1024 * 1024, peak_bytes


def test_a_fifty_megabyte_config_is_refused_unread(tmp_path: Path) -> None:
    path = fifty_megabytes(tmp_path)
    size = path.stat().st_size
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert time.monotonic() - started < 1.0
    assert [str(p) for p in caught.value.problems] == [
        f"{path}: file is {size} bytes, more than the {safe_yaml.MAX_YAML_BYTES} bytes gpu-agent reads"
    ]


def limited_memory() -> None:
    # 1 GiB of address space: far more than a gpu-agent command needs, far less than an expanded bomb.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def assert_cli_fails_with_one_line(args: list[str], expected: str) -> None:
    """`gpu-agent ARGS`, in 1 GiB of address space, exits 1 within 20 s with one line on stderr that
    starts with `expected`, and no traceback."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited_memory,  # nothing threaded runs between fork and exec here
    )
    assert time.monotonic() - started < 20
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(expected), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("bomb", ["alias", "nested", "fifty-megabytes"])
def test_check_config_exits_1_with_one_line(tmp_path: Path, bomb: str) -> None:
    if bomb == "fifty-megabytes":
        path = fifty_megabytes(tmp_path)
        expected = f"{path}: file is {path.stat().st_size} bytes"
    else:
        text, line, message = BOMBS[bomb]
        path = write(tmp_path, text)
        expected = f"{path}:{line}: {message}"
    assert_cli_fails_with_one_line(["check-config", "--config", str(path)], expected)


def test_a_reload_of_a_bomb_keeps_the_running_config(tmp_path: Path) -> None:
    config_path, _ = write_agent_config(tmp_path)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    good = config_path.read_text()
    for text in (alias_bomb(), NESTED, good.replace("mode: enforce", "mode: observe") + "# " + "x" * (1 << 20)):
        config_path.write_text(text)
        assert daemon.reloader.reload() is False
        assert daemon.live.config.mode.value == "enforce"
    config_path.write_text(good.replace("mode: enforce", "mode: observe"))
    assert daemon.reloader.reload() is True
    assert daemon.live.config.mode.value == "observe"


def test_the_rules_loader_refuses_bombs_too(tmp_path: Path) -> None:
    rules = tmp_path / "10-bomb.yaml"
    rules.write_text("rules:\n  - " + NESTED + "\n")
    rules.chmod(0o644)
    with pytest.raises(ConfigError) as caught:
        load_rules([rules])
    assert [str(p) for p in caught.value.problems] == [f"{rules}:2: invalid YAML: nested more than 64 levels deep"]
    rules.write_text("x: &x 1\nrules: *x\n")
    with pytest.raises(ConfigError, match="anchor &x not allowed"):
        load_rules([rules])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mode: observe\nmode: enforce\n", "agent.yaml:2 mode: duplicate key"),
        ("x: *undefined\n", "agent.yaml:1: invalid YAML: alias *undefined not allowed"),
        ("interval_seconds: " + "1" * 5000 + "\n", "agent.yaml: invalid YAML: Exceeds the limit (4300 digits)"),
        ("mode: [\n", "agent.yaml:2: invalid YAML: expected the node content"),
        ("mode: observe\n\x00\n", "agent.yaml:2: invalid YAML: character #x0000 not allowed"),
        ("a:\n" + "  - " * 63 + "x\n", None),
        ("a:\n" + "  - " * 64 + "x\n", "agent.yaml:2: invalid YAML: nested more than 64 levels deep"),
    ],
)
def test_limits_and_their_messages(text: str, expected: str | None) -> None:
    if expected is None:
        loaded = safe_yaml.load_text(text, "agent.yaml")
        depth, node = 0, loaded.data
        while isinstance(node, dict | list):
            node = next(iter(node.values())) if isinstance(node, dict) else node[0]
            depth += 1
        assert depth == safe_yaml.MAX_DEPTH  # the mapping and 63 lists: at the limit, accepted
        return
    with pytest.raises(ConfigError) as caught:
        config_from_text(text, "agent.yaml")
    assert str(caught.value.problems[0]).startswith(expected), caught.value.problems
