"""gpu-agent command line. Read commands take --json; every command takes --config.

The parts: parser.py (the argparse tree), common.py (what every command shares), status.py and
config_socket.py (a config's socket, when its daemon published none), check_config.py, commands.py
(the other commands), completion.py (bash and zsh scripts written from the parser),
completion_values.py (the values only the node knows, read at TAB time) and output.py (stdout that
cannot be written). fast_start.py: what `--version`, `--help`, `status` and completion may import."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["run"]:  # the daemon: stdout is its log, written as structlog does
        return _run_command(arguments)
    from agent.cli.output import GuardedOutput, OutputError, ended

    real = sys.stdout
    output = GuardedOutput(real)
    sys.stdout = output  # a TextIO in all a command uses
    code = 0  # a reader gone before the command ended: no failure of the command
    try:
        try:
            code = _run_command(arguments)
        except SystemExit as exc:  # argparse: --help, --version, a usage error
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        output.flush()
    except OutputError as exc:
        code = ended(exc, code)
    finally:
        sys.stdout = real
    return code


def _run_command(arguments: list[str]) -> int:
    if arguments == ["--version"]:  # the answer needs no parser, nor the commands it names
        from agent.version import version_text

        sys.stdout.write(version_text())
        return 0
    from agent.cli.common import EXIT_ERROR, CliError
    from agent.cli.parser import build_parser

    # Options before the command are only --help and --version: the first word is the command.
    command = next((word for word in arguments if not word.startswith("-")), None)
    args = build_parser(command or "").parse_args(arguments)  # "": no command given, no whole tree
    if args.command not in ("run", "status"):  # run configures its own; status stays lean (no store)
        from agent.logs import log_to_stderr_when_used

        log_to_stderr_when_used()
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"gpu-agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        return _failure(exc)
    return code


def _failure(exc: Exception) -> int:
    """A config or GPU error as its lines on stderr and exit 1; anything else is a bug, raised again.
    (The error types are imported here: `status` and `--version` start without them.)"""
    from agent.backend.errors import NO_DRIVER_KINDS, GpuError
    from agent.cli.common import EXIT_ERROR
    from agent.config_errors import ConfigError

    if isinstance(exc, ConfigError):
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_ERROR
    if isinstance(exc, GpuError):
        print(f"gpu-agent: {exc.args[0] if exc.kind in NO_DRIVER_KINDS else exc}", file=sys.stderr)
        return EXIT_ERROR
    raise exc
