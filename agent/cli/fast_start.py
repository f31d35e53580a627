"""The fast start: every module `gpu-agent --version`, `--help`, `status` against a running daemon and
shell completion's `--complete-values` may import, beyond what the interpreter loaded to start.
tests/cli/test_cli_thin.py runs each in a fresh interpreter, as /usr/bin/gpu-agent starts it, and holds
what it imported to its set here; bench/cli_speed.py times them against a bare `python3 -c pass`
(docs/performance.md: `status` within 4 times that).

A module stays in the fast start so:
- it imports at module level only the standard library modules of its set and the agent modules of
  its set; anything else inside the function that needs it (the command modules are imported when
  their command runs: parser.py `_command`);
- an import made only for annotations goes under `if TYPE_CHECKING:`, the flag imported from the
  agent package (`from agent import TYPE_CHECKING`), never from `typing`: typing alone is a tenth of
  a bare start. agent/version.py keeps a flag of its own: setup.py loads it without the package;
- `status` reads the socket the daemon published (agent/api.py `read_published`), not the config;
  agent/cli/config_socket.py reads the config's `api.socket` only when no daemon published one.

Outside it, on purpose: the config models (pydantic, PyYAML), the backends, structlog, the store, the
policy engine and `typing`, `pathlib`, `dataclasses`, `shutil`, `socket` (its enums and selectors: the
client talks through `_socket`), `contextlib`, `subprocess` (the version of a git checkout comes from
git; an installed agent's is baked into `agent._build_info`); `status --direct`,
every other command, `--help` of `inject` and `tune` (their parsers are built from the backend's and
the advisor's types) and the completion scripts, written once at build time from the whole parser.

An agent module counts by its full name, any other by its top-level package (`re._parser` is `re`).
"""

from __future__ import annotations

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

# What `from __future__ import annotations` and functools, collections and importlib bring along.
_BASICS = (
    "__future__",
    "collections",
    "_collections",
    "errno",
    "functools",
    "_functools",
    "importlib",
    "itertools",
    "keyword",
    "operator",
    "_operator",
    "reprlib",
    "types",
    "warnings",
)

#: `gpu-agent --version`: answered before the parser is built, from the version baked into the wheel.
VERSION = frozenset(
    (
        *_BASICS,
        "agent",
        "agent._build_info",
        "agent.cli",
        "agent.cli.output",  # stdout guarded: a closed or full one ends the command in one line
        "agent.version",
    )
)

#: `gpu-agent --help` and `gpu-agent status --help`: argparse's tree without the command modules.
HELP = frozenset(
    (
        *_BASICS,
        "agent",
        "agent.cli",
        "agent.cli.output",
        "agent.cli.common",  # the config path, shared by every command
        "agent.cli.parser",
        "agent.cli.completion_values",  # the KINDs --complete-values takes (its values load when asked)
        "agent.defaults",  # the default config path in the help text
        "agent.tune",
        "agent.tune.defaults",  # `tune`'s help line, without its parsers
        "argparse",
        "copyreg",
        "enum",
        "gettext",
        "locale",
        "_locale",
        "re",
        "_sre",
        "sre_compile",  # re's parts before Python 3.11
        "sre_constants",
        "sre_parse",
        "textwrap",
    )
)

#: The published record of the daemon's socket, read and trusted (agent/api.py, agent/trust.py).
_PUBLISHED = (
    "agent.api",
    "agent.host",
    "agent.host.safe_json",
    "agent.trust",
    "json",
    "_json",
    "_socket",  # a request's: the C module alone (agent/api.py `call`)
)

#: `gpu-agent status` and `status --json` answered by a running daemon: the socket it published, one
#: request, the screen.
STATUS = HELP | frozenset(
    (
        *_PUBLISHED,
        "agent.cli.status",
        "agent.cli.config_socket",  # only when no daemon published its socket: the config's, without YAML
        "agent.printable",
        "agent.services",
        "agent.services.text",
        "agent.textview",
        "agent.version",  # the notice when the code that runs is not the installed package's
        "agent._build_info",
    )
)

#: `gpu-agent --complete-values KIND` (TAB) with a daemon running the config: the store it published,
#: opened read-only.
COMPLETE_VALUES = HELP | frozenset((*_PUBLISHED, "datetime", "_datetime", "math", "sqlite3", "_sqlite3"))

#: The fast-start set: every module one of them may import.
FAST_START = VERSION | HELP | STATUS | COMPLETE_VALUES


def beyond(allowed: frozenset[str], imported: Iterable[str]) -> list[str]:
    """The modules of `imported` that `allowed` does not hold: an agent module by its full name, any
    other by its top-level package."""
    return sorted(
        name
        for name in imported
        if (name if name == "agent" or name.startswith("agent.") else name.partition(".")[0]) not in allowed
    )
