"""Shell completion generated from the CLI parser (agent/cli/completion.py), run in a real bash."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent.cli.completion import bash_script, commands, zsh_script
from agent.cli.parser import build_parser

TOP_LEVEL = sorted(next(commands(build_parser())).subcommands)


def complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the command line `words` (the last one being completed)."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = f"source {script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _gpu_agent\nprintf '%s\\n' \"${{COMPREPLY[@]}}\""
    proc = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.fixture(scope="module")
def bash_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "gpu-agent"
    path.write_text(bash_script(build_parser()))
    return path


def test_bash_lists_every_subcommand(bash_file: Path) -> None:
    assert {"run", "check-config", "xid", "inject", "demo"} <= set(TOP_LEVEL)
    offered = complete(bash_file, "gpu-agent", "")
    assert sorted(w for w in offered if not w.startswith("-")) == TOP_LEVEL
    assert "--version" in offered


def test_bash_completes_nested_commands_options_and_values(bash_file: Path) -> None:
    assert complete(bash_file, "gpu-agent", "xid", "") == ["explain", "parse", "-h", "--help"]
    assert complete(bash_file, "gpu-agent", "check-config", "--s") == ["--strict"]
    assert complete(bash_file, "gpu-agent", "run", "--log-format", "j") == ["journal", "json"]
    assert "--reason" in complete(bash_file, "gpu-agent", "inject", "throttle", "--")


def test_zsh_names_every_command_path() -> None:
    script = zsh_script(build_parser())
    assert script.startswith("#compdef gpu-agent\n")
    for command in commands(build_parser()):
        assert f"({command.path!r})" in script.replace('"', "'"), command.path
    for name in TOP_LEVEL:
        assert f"'{name}:" in script
    if shutil.which("zsh"):
        proc = subprocess.run(["zsh", "-n"], input=script, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
