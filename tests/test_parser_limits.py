"""The parser limits beyond agent.yaml and rules files: `gpu-agent status` reads the config for
its socket path through the same bounded loader, and a simulated GPU profile file (a path the
config names) is read with a size and a nesting limit. A small hostile file is a one-line error,
never a RecursionError, a MemoryError or a traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from daemon_harness import write_agent_config
from test_safe_yaml import NESTED, alias_bomb, assert_cli_fails_with_one_line

from agent import api_server
from agent.backend.sim.profiles import MAX_PROFILE_BYTES, MAX_PROFILE_DEPTH, ProfileError, load_profile
from agent.config import ConfigError
from agent.policy.dropins import load_checked_config


@pytest.mark.parametrize("bomb", ["alias", "nested"])
def test_status_with_a_bomb_for_a_config_exits_1_with_one_line(tmp_path: Path, bomb: str) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(alias_bomb() if bomb == "alias" else NESTED)
    config.chmod(0o644)
    expected = {
        "alias": f"{config}:1: invalid YAML: anchor &a not allowed",
        "nested": f"{config}:1: invalid YAML: nested more than 64 levels deep",
    }[bomb]
    assert_cli_fails_with_one_line(["status", "--config", str(config)], expected)


def profile_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("brackets", ["[]", "{}"])
def test_a_deeply_nested_profile_is_a_profile_error(tmp_path: Path, brackets: str) -> None:
    opening, closing = brackets
    inner = opening + '"k": ' if opening == "{" else opening
    path = profile_file(tmp_path, '{"gpus": ' + inner * 100_000 + "1" + closing * 100_000 + "}")
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert str(caught.value) == (
        f"cannot read simulated GPU profile {path}: nested more than {MAX_PROFILE_DEPTH} levels deep"
    )


def test_brackets_in_strings_do_not_count_and_the_limit_is_exact(tmp_path: Path) -> None:
    # Brackets in a string (escaped quotes and backslashes included) are text, not nesting.
    text = json.dumps({"name": '\\"' + "[" * 500 + '\\"', "gpus": [{"model": "h200", "count": 2}]})
    assert load_profile(profile_file(tmp_path, text)).name == '\\"' + "[" * 500 + '\\"'
    # At the limit the file is parsed (and judged by the schema); one level more is refused unparsed.
    at_limit = '{"gpus": ' + "[" * (MAX_PROFILE_DEPTH - 1) + "]" * (MAX_PROFILE_DEPTH - 1) + "}"
    with pytest.raises(ProfileError, match="gpus") as caught:
        load_profile(profile_file(tmp_path, at_limit))
    assert "nested more than" not in str(caught.value)
    over = '{"gpus": ' + "[" * MAX_PROFILE_DEPTH + "]" * MAX_PROFILE_DEPTH + "}"
    with pytest.raises(ProfileError, match=f"nested more than {MAX_PROFILE_DEPTH} levels deep"):
        load_profile(profile_file(tmp_path, over))


def test_a_huge_profile_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    with path.open("w") as out:
        out.write('{"name": "big", "description": "')
        out.write("x" * (50 * 1024 * 1024))
        out.write('", "gpus": [{"model": "h200"}]}')
    size = path.stat().st_size
    started = time.monotonic()
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert time.monotonic() - started < 1.0
    assert str(caught.value) == (
        f"cannot read simulated GPU profile {path}: file is {size} bytes, more than the {MAX_PROFILE_BYTES} bytes"
        " gpu-agent reads"
    )


def test_a_config_naming_a_nested_profile_is_one_config_error(tmp_path: Path) -> None:
    profile = profile_file(tmp_path, "[" * 100_000)
    config, _ = write_agent_config(tmp_path, profile=str(profile))
    with pytest.raises(ConfigError) as caught:
        load_checked_config(config)
    (problem,) = caught.value.problems
    assert "nested more than 64 levels deep" in problem.message, problem


def test_a_deeply_nested_api_request_gets_an_error_response() -> None:
    """Whoever may use the socket (root, or the api.group) sends at most a 64 KB line; nested
    brackets there are an answer, not a RecursionError in the request's thread."""
    line = b"[" * (api_server.MAX_REQUEST_BYTES - 1) + b"\n"
    assert api_server.handle_request(line, {"ping": lambda _p: "pong"}) == {
        "ok": False,
        "error": "invalid JSON: nested more than 64 levels deep",
    }
