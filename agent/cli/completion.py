"""bash and zsh completion, written from the CLI's own argparse parser, so a new command or option
completes without anyone editing a script. The packages install both (packaging/build.py):

    python -m agent.cli.completion bash|zsh

Values complete where values go: choices from the parser, paths for PATH/FILE/DIR, durations for
DURATION (`events --since`), and what only the node knows, read when TAB is pressed through
`gpu-agent --complete-values KIND` (hidden; the config of a `--config` on the line, else
$GPU_AGENT_CONFIG, else the default): the `ack` selectors the store has something to re-arm for,
and the GPU indices the store knows (`--gpu`), both read by agent/cli/completion_values.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from agent.cli.parser import build_parser

PROG = "gpu-agent"
# Options whose value is a path: completed from the file system, not from a word list.
DIRECTORY_METAVARS = ("DIR",)
FILE_METAVARS = ("PATH", "FILE")
# Options whose value is a duration: offered examples (any `90s`, `30m`, `1h`, `7d` is taken).
DURATION_METAVARS = ("DURATION",)
DURATIONS = ("30m", "1h", "6h", "1d", "7d")
# Values only the node knows, read at TAB time (`gpu-agent --complete-values KIND`).
DYNAMIC_OPTIONS = {"--gpu": "gpus"}
DYNAMIC_POSITIONALS = {"selector": "ack-targets"}  # `gpu-agent ack SELECTOR`


@dataclass
class Command:
    """One command path (`gpu-agent`, `gpu-agent xid explain`): what may follow it."""

    path: str
    subcommands: dict[str, str] = field(default_factory=dict)  # name -> help
    options: dict[str, str] = field(default_factory=dict)  # option string -> help
    choices: dict[str, list[str]] = field(default_factory=dict)  # option -> its values
    directories: list[str] = field(default_factory=list)  # options taking a directory
    files: list[str] = field(default_factory=list)  # options taking a file
    dynamic: dict[str, str] = field(default_factory=dict)  # option -> the KIND of its values
    positional: str | None = None  # the KIND of the values of its positional argument


def commands(parser: argparse.ArgumentParser, path: str = PROG) -> Iterator[Command]:
    """Every command path of the parser, the top level first."""
    command = Command(path)
    nested: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                command.subcommands[name] = helps.get(name, "")
                nested.append((name, sub))
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not action.option_strings and action.dest in DYNAMIC_POSITIONALS:
            command.positional = DYNAMIC_POSITIONALS[action.dest]
        for option in action.option_strings:
            command.options[option] = action.help or ""
            if action.choices is not None:
                command.choices[option] = [str(c) for c in action.choices]
            elif option in DYNAMIC_OPTIONS:
                command.dynamic[option] = DYNAMIC_OPTIONS[option]
            elif action.metavar in DURATION_METAVARS:
                command.choices[option] = list(DURATIONS)
            elif action.metavar in DIRECTORY_METAVARS:
                command.directories.append(option)
            elif action.metavar in FILE_METAVARS:
                command.files.append(option)
    yield command
    for name, sub in nested:
        yield from commands(sub, f"{path} {name}")


def _words(command: Command) -> str:
    return " ".join([*command.subcommands, *command.options])


def bash_script(parser: argparse.ArgumentParser) -> str:
    found = list(commands(parser))
    paths = " | ".join(f'"{c.path}"' for c in found[1:])
    value_cases = []
    for command in found:
        for option, values in command.choices.items():
            reply = f'COMPREPLY=($(compgen -W "{" ".join(values)}" -- "$cur"))'
            value_cases.append(f'        "{command.path}|{option}") {reply}; return ;;')
        for option in command.directories:
            value_cases.append(f'        "{command.path}|{option}") COMPREPLY=($(compgen -d -- "$cur")); return ;;')
        for option in command.files:
            value_cases.append(f'        "{command.path}|{option}") COMPREPLY=($(compgen -f -- "$cur")); return ;;')
        for option, kind in command.dynamic.items():
            reply = f'COMPREPLY=($(compgen -W "$(_gpu_agent_values {kind})" -- "$cur"))'
            value_cases.append(f'        "{command.path}|{option}") {reply}; return ;;')
    word_cases = []
    for c in found:
        dynamic = f"; [[ $cur != -* ]] && _gpu_agent_positional {c.positional} && return" if c.positional else ""
        word_cases.append(f'        "{c.path}") words="{_words(c)}"{dynamic} ;;')
    return "\n".join(
        [
            f"# bash completion for {PROG}, generated from its argparse parser (agent/cli/completion.py)",
            "# What only the node knows (KIND: ack-targets, gpus), from the gpu-agent being completed,",
            "# with the config of a --config on the line.",
            "_gpu_agent_values() {",
            "    local i config=",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            "        if [[ ${COMP_WORDS[i]} == --config ]]; then",
            "            config=${COMP_WORDS[i+1]}",
            "            [[ $config == = ]] && config=${COMP_WORDS[i+2]}",
            "        fi",
            "    done",
            '    GPU_AGENT_CONFIG=${config:-$GPU_AGENT_CONFIG} "${COMP_WORDS[0]}" --complete-values "$1" 2>/dev/null',
            "}",
            "# A positional value that may hold ':' (gpu:0, service:sglang), which bash splits words at.",
            "_gpu_agent_positional() {",
            "    local word=$cur",
            "    if [[ $cur == : ]]; then word=$prev:",
            "    elif [[ $prev == : ]]; then word=${COMP_WORDS[COMP_CWORD-2]}:$cur",
            "    fi",
            '    COMPREPLY=($(compgen -W "$(_gpu_agent_values "$1")" -- "$word"))',
            '    [[ $word == *:* ]] && COMPREPLY=("${COMPREPLY[@]#"${word%"${word##*:}"}"}")',
            "    return 0",
            "}",
            "_gpu_agent() {",
            "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}",
            "    # '=' breaks words in bash: --opt=VALUE arrives as --opt, =, VALUE",
            "    local valued=",
            "    if [[ $cur == = ]]; then cur= valued=1; elif [[ $prev == = ]]; then",
            "        prev=${COMP_WORDS[COMP_CWORD-2]} valued=1",
            "    fi",
            "    COMPREPLY=()",
            f"    local path={PROG} words= i",
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            '        case "$path ${COMP_WORDS[i]}" in',
            f'            {paths}) path="$path ${{COMP_WORDS[i]}}" ;;',
            "        esac",
            "    done",
            '    case "$path|$prev" in',
            *value_cases,
            "    esac",
            "    [[ -n $valued ]] && return  # an option without values, given one",
            '    case "$path" in',
            *word_cases,
            "    esac",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            "}",
            f"complete -F _gpu_agent {PROG}",
            "",
        ]
    )


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _zsh_item(name: str, help_text: str) -> str:
    summary = " ".join(help_text.split()).replace("%%", "%")
    return _zsh_quote(f"{name.replace(':', chr(92) + ':')}:{summary}")


def zsh_script(parser: argparse.ArgumentParser) -> str:
    found = list(commands(parser))
    paths = "|".join(_zsh_quote(c.path) for c in found[1:])
    value_cases = []
    for command in found:
        for option, values in command.choices.items():
            value_cases.append(
                f"    ({_zsh_quote(command.path + '|' + option)}) compadd -- {' '.join(values)}; return ;;"
            )
        for option in command.directories:
            value_cases.append(f"    ({_zsh_quote(command.path + '|' + option)}) _files -/; return ;;")
        for option in command.files:
            value_cases.append(f"    ({_zsh_quote(command.path + '|' + option)}) _files; return ;;")
        for option, kind in command.dynamic.items():
            case = _zsh_quote(command.path + "|" + option)
            value_cases.append(f"    ({case}) values=({_zsh_values(kind)}); compadd -a values; return ;;")
    word_cases = []
    for command in found:
        items = [_zsh_item(n, h) for n, h in {**command.subcommands, **command.options}.items()]
        dynamic = ""
        if command.positional:
            read_values = _zsh_values(command.positional)
            dynamic = f"[[ $PREFIX != -* ]] && {{ values=({read_values}); compadd -a values; return; }}; "
        word_cases.append(f"    ({_zsh_quote(command.path)}) {dynamic}items=({' '.join(items)}) ;;")
    return "\n".join(
        [
            f"#compdef {PROG}",
            f"# zsh completion for {PROG}, generated from its argparse parser (agent/cli/completion.py)",
            "local p=gpu-agent i config=",
            "local -a items values",
            "for ((i = 2; i < CURRENT; i++)); do",
            "  case ${words[i]} in",
            "    (--config) config=${words[i+1]} ;;",
            "    (--config=*) config=${words[i]#--config=} ;;",
            "  esac",
            "done",
            "for ((i = 2; i < CURRENT; i++)); do",
            f'  case "$p ${{words[i]}}" in ({paths}) p="$p ${{words[i]}}" ;; esac',
            "done",
            "local option=${words[CURRENT-1]} valued=",
            "# --opt=VALUE is one word in zsh: complete VALUE as the value of --opt",
            "if [[ $PREFIX == --*=* ]]; then option=${PREFIX%%=*} valued=1; compset -P '*='; fi",
            'case "$p|$option" in',
            *value_cases,
            "esac",
            "[[ -n $valued ]] && return 1  # an option without values, given one",
            'case "$p" in',
            *word_cases,
            "esac",
            "_describe -t commands 'gpu-agent' items",
            "",
        ]
    )


def _zsh_values(kind: str) -> str:
    command = f"GPU_AGENT_CONFIG=${{config:-$GPU_AGENT_CONFIG}} ${{words[1]}} --complete-values {kind} 2>/dev/null"
    return f'${{(f)"$({command})"}}'


def main(argv: list[str] | None = None) -> int:
    shell = (argv if argv is not None else sys.argv[1:]) or ["bash"]
    scripts = {"bash": bash_script, "zsh": zsh_script}
    if shell[0] not in scripts:
        print(f"usage: python -m agent.cli.completion {'|'.join(scripts)}", file=sys.stderr)
        return 1
    sys.stdout.write(scripts[shell[0]](build_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
