"""The generated completion, installed where the packages put it, in the real shells: zsh finds
`_gpu-agent` on its fpath through compinit and completes in an interactive `zsh -f` driven over
a pseudo-terminal (zsh's zpty module); bash-completion's on-demand loader finds
`completions/gpu-agent` and registers the function bash calls. What each offers is checked
against the argparse parser itself."""

from __future__ import annotations

import argparse
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli.completion import DURATIONS, bash_script, commands, zsh_script
from agent.cli.parser import build_parser
from agent.store.database import Store

REPO = Path(__file__).resolve().parents[2]

BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")
SHELL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TERM": "dumb"}
HELP = {"-h", "--help"}

# Runs in the interactive zsh: compinit over an fpath with the file under test in front, TAB
# bound to plain completion, and compadd wrapped so that every candidate a completion function
# adds is also printed (the zsh-capture-completion technique; the candidates are still added, so
# the completion system goes on as it would: _files tries all files only when no directory
# matched). comppostfuncs ends the shell once the completion has run: the driver reads to the end.
ZSH_SETUP = r"""
PS1='' RPS1=''
fpath=({fpath} $fpath)
autoload -Uz compinit && compinit -u -D
bindkey '^I' complete-word
compadd() {{
  # -O, -A and -D only compute matches for the caller (_describe, _files): let them through
  if [[ ${{@[1,(i)(-|--)]}} == *-(O|A|D)\ * ]]; then
    builtin compadd "$@"
    return
  fi
  local -a hits
  builtin compadd -A hits "$@"
  print -rl -- ${{hits/#/<candidate>}}
  builtin compadd "$@"
}}
comppostfuncs=(exit)
print '<setup-done>'
"""
ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty shell zsh -f -i
zpty -w shell "source ${(q)1}"
zpty -r shell line '*<setup-done>*'
zpty -w -n shell "$2"$'\t'
while zpty -r shell line; do print -rn -- "$line"; done
"""


def parser_commands() -> dict[str, argparse.ArgumentParser]:
    """Every command path ("gpu-agent", "gpu-agent xid", ...) and its parser."""
    found = {}
    pending = [("gpu-agent", build_parser())]
    while pending:
        path, parser = pending.pop()
        found[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{path} {name}", sub) for name, sub in action.choices.items()]
    return found


PARSERS = parser_commands()


def options(path: str) -> set[str]:
    """The options completion offers: every one but the hidden (--complete-values)."""
    return {
        option
        for action in PARSERS[path]._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


def subcommands(path: str) -> set[str]:
    return {
        name
        for action in PARSERS[path]._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }


def choices(path: str, option: str) -> set[str]:
    action = next(a for a in PARSERS[path]._actions if option in a.option_strings)
    assert action.choices is not None
    return {str(c) for c in action.choices}


# -- the node's own values: a store with something to re-arm, and a gpu-agent on PATH ------------------

NODE_BIN = Path("/nonexistent")  # set by the `node` fixture: where the shells find `gpu-agent`
ACK_TARGETS = {
    "all",
    "reboot",
    "xid-79-reset",
    "gpu:1",
    "gpu:GPU-1111",
    "service-unhealthy-restart",
    "service:sglang",
    "gpu:3",
    "gpu:GPU-3333",
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config whose store has an open circuit (Xid 79 on GPU 1), a service rule whose attempts ran
    out, a missing GPU 3 and a reboot recommended; `gpu-agent` on the shells' PATH runs this checkout.
    Returns the config."""
    global NODE_BIN
    directory = tmp_path_factory.mktemp("node")
    state = directory / "state"
    Store.open(state).close()
    with sqlite3.connect(state / "gpu-agent.db") as db:
        db.execute(
            "INSERT INTO circuits VALUES ('xid-79-reset', 'gpu:GPU-1111', 1, 'GPU-1111', NULL, 1.0, 'attempts ran out')"
        )
        db.execute(
            "INSERT INTO remediations (ts, finished, rule, action, params, target_key, gpu, uuid, service, event_key,"
            " attempt, step, outcome, reason, detail, dry_run, counted, acked) VALUES (1, 2,"
            " 'service-unhealthy-restart', 'restart_service', '{}', 'service:sglang', NULL, NULL, 'sglang', 'k', 1, 0,"
            " 'failed', '', '', 0, 1, 0)"
        )
        for gpu, uuid, present in ((0, "GPU-0000", 1), (1, "GPU-1111", 1), (3, "GPU-3333", 0)):
            db.execute(
                "INSERT INTO gpu_inventory VALUES ('boot', ?, '0000:00:00.0', 'NVIDIA H200', ?, 1, 1, ?, 0)",
                (uuid, gpu, present),
            )
    (state / "reboot-recommended").write_text('{"reason": "Xid 79"}')
    config = directory / "agent.yaml"
    config.write_text(f"mode: observe\nbackend: simulated\nstate_dir: {state}\n")
    NODE_BIN = directory / "bin"
    NODE_BIN.mkdir()
    wrapper = NODE_BIN / "gpu-agent"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m agent.cli "$@"\n')
    wrapper.chmod(0o755)
    return config


def test_the_hidden_option_reads_the_store(node: Path) -> None:
    argv = [str(NODE_BIN / "gpu-agent"), "--complete-values", "ack-targets"]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**SHELL_ENV, "GPU_AGENT_CONFIG": str(node)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "all" and set(proc.stdout.split()) == ACK_TARGETS
    gpus = subprocess.run(
        [*argv[:2], "gpus"], capture_output=True, text=True, env={**SHELL_ENV, "GPU_AGENT_CONFIG": str(node)}
    )
    assert gpus.stdout.split() == ["0", "1", "3"]
    # No config, no store: nothing, quietly.
    missing = subprocess.run(
        argv, capture_output=True, text=True, env={**SHELL_ENV, "GPU_AGENT_CONFIG": "/nonexistent"}
    )
    assert (missing.returncode, missing.stdout, missing.stderr) == (0, "", "")


# -- zsh ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zsh_setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("zsh") is None:
        pytest.skip("needs zsh (scripts/install-test-deps)")
    directory = tmp_path_factory.mktemp("zsh")
    (directory / "vendor-completions").mkdir()  # the .deb's directory name; the file name is the packages'
    (directory / "vendor-completions" / "_gpu-agent").write_text(zsh_script(build_parser()))
    (directory / "home").mkdir()
    setup = directory / "setup.zsh"
    setup.write_text(ZSH_SETUP.format(fpath=directory / "vendor-completions"))
    (directory / "driver.zsh").write_text(ZSH_DRIVER)
    return setup


def zsh_complete(setup: Path, line: str, *, may_be_empty: bool = False) -> set[str]:
    """What a real interactive zsh offers when TAB is pressed at the end of `line`."""
    env = {**SHELL_ENV, "HOME": str(setup.parent / "home"), "PATH": f"{NODE_BIN}:{SHELL_ENV['PATH']}"}
    driver = setup.parent / "driver.zsh"
    proc = subprocess.run(
        ["zsh", "-f", str(driver), str(setup), line], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    offered = set(re.findall(r"<candidate>([^\r\n]*)", proc.stdout))
    assert offered or may_be_empty, f"zsh offered nothing for {line!r}:\n{proc.stdout!r}"
    return offered


def test_zsh_completes_every_subcommand(zsh_setup: Path) -> None:
    assert {"run", "status", "check-config", "xid", "inject", "demo"} <= subcommands("gpu-agent")
    assert zsh_complete(zsh_setup, "gpu-agent ") == subcommands("gpu-agent") | options("gpu-agent")
    assert zsh_complete(zsh_setup, "gpu-agent ch") == {"check-config"}
    assert zsh_complete(zsh_setup, "gpu-agent inject ") == subcommands("gpu-agent inject") | HELP


def test_zsh_completes_options_of_the_command_typed(zsh_setup: Path) -> None:
    assert {"--config", "--json", "--direct"} <= options("gpu-agent status")
    offered = zsh_complete(zsh_setup, "gpu-agent status --")
    assert offered == {o for o in options("gpu-agent status") if o.startswith("--")}
    # After an option's value the command's options come again.
    assert zsh_complete(zsh_setup, "gpu-agent status --config /etc/x --j") == {"--json"}
    assert zsh_complete(zsh_setup, "gpu-agent xid parse --") == {
        o for o in options("gpu-agent xid parse") if o.startswith("--")
    }


def test_zsh_completes_option_values_and_paths(zsh_setup: Path, tmp_path: Path) -> None:
    assert zsh_complete(zsh_setup, "gpu-agent run --log-format ") == choices("gpu-agent run", "--log-format")
    assert zsh_complete(zsh_setup, "gpu-agent inject throttle --reason hw_") == {
        c for c in choices("gpu-agent inject throttle", "--reason") if c.startswith("hw_")
    }
    (tmp_path / "rules.d").mkdir()
    (tmp_path / "agent.yaml").write_text("mode: observe\n")
    assert zsh_complete(zsh_setup, f"gpu-agent check-config --rules {tmp_path}/") == {"rules.d"}
    assert zsh_complete(zsh_setup, f"gpu-agent status --config {tmp_path}/") == {"rules.d", "agent.yaml"}


def test_zsh_completes_the_value_after_option_equals(zsh_setup: Path, tmp_path: Path) -> None:
    assert zsh_complete(zsh_setup, "gpu-agent run --log-format=") == choices("gpu-agent run", "--log-format")
    assert zsh_complete(zsh_setup, "gpu-agent inject throttle --reason=hw_") == {
        c for c in choices("gpu-agent inject throttle", "--reason") if c.startswith("hw_")
    }
    (tmp_path / "agent.yaml").write_text("mode: observe\n")
    assert zsh_complete(zsh_setup, f"gpu-agent status --config={tmp_path}/") == {"agent.yaml"}
    # a flag takes no value: nothing, rather than the command's options glued after the '='
    assert zsh_complete(zsh_setup, "gpu-agent status --json=", may_be_empty=True) == set()


def test_zsh_completes_values_where_values_go(zsh_setup: Path, node: Path) -> None:
    assert zsh_complete(zsh_setup, "gpu-agent events --since ") == set(DURATIONS)
    assert zsh_complete(zsh_setup, f"gpu-agent ack --config {node} ") == ACK_TARGETS
    assert zsh_complete(zsh_setup, f"gpu-agent ack --config={node} service") == {
        "service-unhealthy-restart",
        "service:sglang",
    }
    assert zsh_complete(zsh_setup, f"gpu-agent inject xid --config {node} --gpu ") == {"0", "1", "3"}
    # Options still complete where an option is being typed.
    assert zsh_complete(zsh_setup, f"gpu-agent ack --config {node} --h") == {"--help"}


# -- bash ------------------------------------------------------------------------------------------

# bash-completion's loader, as an interactive bash runs it on the first TAB after `gpu-agent`:
# it looks the command up in BASH_COMPLETION_USER_DIR/completions (before the system directory,
# /usr/share/bash-completion/completions, where the packages install the file), sources the file
# and asks for a retry (124); the retry calls whatever `complete -p` now names.
BASH_PROGRAM = r"""
source {bash_completion}
_completion_loader gpu-agent || [ $? = 124 ]
spec=$(complete -p gpu-agent)
echo "$spec" >&2
function=${{spec#*-F }}; function=${{function%% *}}
COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_LINE={line}; COMP_POINT=${{#COMP_LINE}}
"$function" gpu-agent "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\n' "${{COMPREPLY[@]}}"
"""


@pytest.fixture(scope="module")
def bash_user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not BASH_COMPLETION.is_file():
        pytest.skip("needs bash-completion (scripts/install-test-deps)")
    directory = tmp_path_factory.mktemp("bash-completion")
    (directory / "completions").mkdir()
    (directory / "completions" / "gpu-agent").write_text(bash_script(build_parser()))
    return directory


def bash_words(line: str) -> list[str]:
    """COMP_WORDS as bash splits `line`: at spaces, and '=' and ':' (in COMP_WORDBREAKS) words of
    their own; an interactive bash gives `--opt=` as (--opt, =), `--opt=v` as (--opt, =, v) and
    `gpu:` as (gpu, :)."""
    return [
        piece
        for part in line.split(" ")
        for piece in (re.split("([=:])", part) if re.search("[=:]", part) else [part])
        if piece != "" or not re.search("[=:]", part)
    ]


def bash_complete(user_dir: Path, line: str) -> tuple[str, set[str]]:
    """The completion spec bash-completion loaded for gpu-agent, and what it offers for `line`."""
    words = bash_words(line)
    program = BASH_PROGRAM.format(
        bash_completion=BASH_COMPLETION,
        words=" ".join(f"'{w}'" for w in words),
        cword=len(words) - 1,
        line=f"'{line}'",
    )
    env = {**SHELL_ENV, "HOME": str(user_dir), "BASH_COMPLETION_USER_DIR": str(user_dir)}
    env["PATH"] = f"{NODE_BIN}:{SHELL_ENV['PATH']}"
    proc = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip(), set(proc.stdout.split())


def test_bash_completion_loads_the_installed_file_on_demand(bash_user_dir: Path) -> None:
    spec, offered = bash_complete(bash_user_dir, "gpu-agent ")
    assert spec == "complete -F _gpu_agent gpu-agent"
    assert offered == subcommands("gpu-agent") | options("gpu-agent")
    _, offered = bash_complete(bash_user_dir, "gpu-agent status --")
    assert offered == {o for o in options("gpu-agent status") if o.startswith("--")}
    _, offered = bash_complete(bash_user_dir, "gpu-agent run --log-format ")
    assert offered == choices("gpu-agent run", "--log-format")


def test_bash_completes_the_value_after_option_equals(bash_user_dir: Path, tmp_path: Path) -> None:
    assert bash_words("gpu-agent run --log-format=") == ["gpu-agent", "run", "--log-format", "="]
    assert bash_words("gpu-agent run --log-format=j") == ["gpu-agent", "run", "--log-format", "=", "j"]
    _, offered = bash_complete(bash_user_dir, "gpu-agent run --log-format=")
    assert offered == choices("gpu-agent run", "--log-format")
    _, offered = bash_complete(bash_user_dir, "gpu-agent inject throttle --reason=hw_")
    assert offered == {c for c in choices("gpu-agent inject throttle", "--reason") if c.startswith("hw_")}
    (tmp_path / "agent.yaml").write_text("mode: observe\n")
    _, offered = bash_complete(bash_user_dir, f"gpu-agent status --config={tmp_path}/")
    assert offered == {f"{tmp_path}/agent.yaml"}
    _, offered = bash_complete(bash_user_dir, "gpu-agent status --json=")
    assert offered == set()


def test_bash_completes_values_where_values_go(bash_user_dir: Path, node: Path) -> None:
    _, offered = bash_complete(bash_user_dir, "gpu-agent events --since ")
    assert offered == set(DURATIONS)
    _, offered = bash_complete(bash_user_dir, f"gpu-agent ack --config {node} ")
    assert offered == ACK_TARGETS
    # ':' splits words in bash: what follows `gpu:` is offered without it, as bash inserts it.
    assert bash_words("gpu-agent ack gpu:") == ["gpu-agent", "ack", "gpu", ":"]
    _, offered = bash_complete(bash_user_dir, f"gpu-agent ack --config {node} gpu:")
    assert offered == {"1", "GPU-1111", "3", "GPU-3333"}
    _, offered = bash_complete(bash_user_dir, f"gpu-agent ack --config {node} gpu:GPU-3")
    assert offered == {"GPU-3333"}
    _, offered = bash_complete(bash_user_dir, f"gpu-agent inject xid --config {node} --gpu ")
    assert offered == {"0", "1", "3"}


def test_the_command_walk_matches_the_completion_model() -> None:
    """The paths checked above are the ones agent/cli/completion.py generates cases for."""
    assert set(PARSERS) == {command.path for command in commands(build_parser())}
