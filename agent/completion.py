"""bash and zsh completion, written from the CLI's own argparse parser, so a new command or option
completes without anyone editing a script. The packages install both (packaging/build.py):

    python -m agent.completion bash|zsh
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

PROG = "gpu-agent"
# Options whose value is a path: completed from the file system, not from a word list.
DIRECTORY_METAVARS = ("DIR",)
FILE_METAVARS = ("PATH", "FILE")


@dataclass
class Command:
    """One command path (`gpu-agent`, `gpu-agent xid explain`): what may follow it."""

    path: str
    subcommands: dict[str, str] = field(default_factory=dict)  # name -> help
    options: dict[str, str] = field(default_factory=dict)  # option string -> help
    choices: dict[str, list[str]] = field(default_factory=dict)  # option -> its values
    directories: list[str] = field(default_factory=list)  # options taking a directory
    files: list[str] = field(default_factory=list)  # options taking a file


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
        for option in action.option_strings:
            command.options[option] = action.help or ""
            if action.choices is not None:
                command.choices[option] = [str(c) for c in action.choices]
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
    word_cases = [f'        "{c.path}") words="{_words(c)}" ;;' for c in found]
    return "\n".join(
        [
            f"# bash completion for {PROG}, generated from its argparse parser (agent/completion.py)",
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
    word_cases = []
    for command in found:
        items = [_zsh_item(n, h) for n, h in {**command.subcommands, **command.options}.items()]
        word_cases.append(f"    ({_zsh_quote(command.path)}) items=({' '.join(items)}) ;;")
    return "\n".join(
        [
            f"#compdef {PROG}",
            f"# zsh completion for {PROG}, generated from its argparse parser (agent/completion.py)",
            "local p=gpu-agent i",
            "local -a items",
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


def main(argv: list[str] | None = None) -> int:
    from agent.cli import build_parser

    shell = (argv if argv is not None else sys.argv[1:]) or ["bash"]
    scripts = {"bash": bash_script, "zsh": zsh_script}
    if shell[0] not in scripts:
        print(f"usage: python -m agent.completion {'|'.join(scripts)}", file=sys.stderr)
        return 1
    sys.stdout.write(scripts[shell[0]](build_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
