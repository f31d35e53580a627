"""/usr/bin/gpu-agent, the packaged launcher, run for real by /bin/sh with its venv python swapped
for a stand-in that reports what it was given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.common import PACKAGED_LAUNCHER_ENV, PACKAGED_PYTHON_OPTIONS

LAUNCHER = Path(__file__).resolve().parent.parent / "packaging" / "gpu-agent"
VENV_PYTHON = "/opt/gpu-agent/venv/bin/python"


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "MALLOC_ARENA_MAX=${MALLOC_ARENA_MAX-unset}"\necho "argv=$*"\n')
    python.chmod(0o755)
    text = LAUNCHER.read_text()
    assert text.count(VENV_PYTHON) == 1
    script = tmp_path / "gpu-agent"
    script.write_text(text.replace(VENV_PYTHON, str(python)))
    script.chmod(0o755)
    return script


def run_launcher(script: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [str(script), "run", "--log-format", "journal"], env=base | env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def test_launcher_bounds_malloc_arenas_and_runs_the_cli(launcher: Path) -> None:
    seen = run_launcher(launcher)
    assert seen["MALLOC_ARENA_MAX"] == "1"
    assert seen["argv"] == "-I -OO -X faulthandler -m agent.cli run --log-format journal"


def test_an_administrators_malloc_arena_max_stands(launcher: Path) -> None:
    assert run_launcher(launcher, MALLOC_ARENA_MAX="8")["MALLOC_ARENA_MAX"] == "8"


def test_benchmarks_run_the_daemon_with_the_launchers_environment(launcher: Path) -> None:
    seen = run_launcher(launcher)
    assert {name: seen[name] for name in PACKAGED_LAUNCHER_ENV} == PACKAGED_LAUNCHER_ENV
    python_options = seen["argv"].split(" -m agent.cli")[0].split()
    assert set(PACKAGED_PYTHON_OPTIONS) <= set(python_options)
