"""The shape of the `agent` package, held by reading its source (nothing is imported).

Every import counts: at module level, inside a function and under `if TYPE_CHECKING:`, since a
cycle or a reach across layers closed by an in-function import is still one. `from P import N`
depends on the package P itself (its `__init__` runs and N may be one of its re-exports) and, where
N is a submodule, on P.N too.

Two graphs are held acyclic: the modules', and the packages' (each module folded into the package
it is in under agent/, a top-level module standing for itself), so the packages stack in layers
and a new contributor can read them bottom up.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "agent"

#: agent/ keeps a small top level: the rest lives in packages named for what they are.
MAX_TOP_LEVEL_MODULES = 20
#: About 700 lines: beyond that a module holds more than one job and is split by job.
MAX_MODULE_LINES = 700
#: Every process the agent starts goes through one runner: bounded output, a scrubbed environment,
#: a total deadline that kills the process group.
PROCESS_RUNNER = "agent.host.commands"
#: Apart from it: the demo (it starts the daemon, a stand-in server and Alertmanager as a user's
#: shell would, and stops them) and the build-time version code (git, before anything is installed).
STARTS_PROCESSES_APART = ("agent.demo", "agent.version")
#: Modules that import every module of a package by finding it (importlib), not by name: an edge to
#: each, which the source does not spell, so the graph adds it (a kind importing the registry that
#: finds it is a cycle like any other).
DISCOVERS = {"agent.rules.actions.registry": "agent.rules.actions.kinds"}
#: The data every layer reads (the snapshot, its samples, plans and events, the names agent.yaml
#: uses): made elsewhere, read everywhere, so they import only each other (and the `agent`
#: package's flag), never a part that reads a device, a file, a socket or the config.
DATA_MODULES = (
    "agent.names",
    "agent.events",
    "agent.state",
    "agent.policy.plan",
    "agent.readings",
    "agent.backend.base",
    "agent.backend.errors",
)
#: Modules that start programs, and the os functions that do.
PROCESS_MODULES = ("subprocess", "multiprocessing", "pty")
OS_PROCESS_CALL = re.compile(r"(system|popen|exec\w*|spawn\w*|posix_spawn\w*|fork\w*)")


@dataclass(frozen=True)
class Module:
    name: str  # dotted: agent.watch.xid; a package is its __init__: agent.watch
    path: Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path) -> dict[str, Module]:
    found = {}
    for path in sorted((root / "agent").rglob("*.py")):
        name = module_name(path, root)
        found[name] = Module(name, path)
    return found


def imported_names(module: Module) -> Iterator[tuple[str, str | None]]:
    """(module, name) for every import in `module`'s source, anywhere in it; name is None for `import M`."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield base, alias.name


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the agent modules it imports (see the module docstring for what counts)."""
    modules = modules_of(root)

    def owner(name: str) -> str | None:
        """The agent module `name` is, or is in (agent.x.y.Thing -> agent.x.y)."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        for base, name in imported_names(module):
            targets = {owner(base)}
            if name is not None and f"{base}.{name}" in modules:
                targets.add(f"{base}.{name}")
            graph[module.name] |= {t for t in targets if t is not None and t != module.name}
    for discoverer, package in DISCOVERS.items():
        if discoverer in graph:
            graph[discoverer] |= {name for name in graph if name.startswith(package + ".")}
    return graph


@cache
def agent_graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def package_of(name: str) -> str:
    """The package under agent/ a module is folded into (agent.watch.xid -> agent.watch); a top-level
    module (agent.state) and the agent package itself stand for themselves."""
    return ".".join(name.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (an import inside one package is no edge)."""
    packages: dict[str, set[str]] = {package_of(name): set() for name in graph}
    for name, targets in graph.items():
        packages[package_of(name)] |= {package_of(t) for t in targets} - {package_of(name)}
    return packages


def data_module_imports(graph: dict[str, set[str]], data: tuple[str, ...]) -> list[str]:
    """'A -> B' for every data module A that imports a module B that is not data (the agent
    package itself aside: its flag and version)."""
    return [
        f"{name} -> {target}"
        for name in sorted(graph)
        if any(in_package(name, d) for d in data)
        for target in sorted(graph[name])
        if target != "agent" and not any(in_package(target, d) for d in data)
    ]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for successor in graph[todo.pop()]:
            if successor not in seen:
                seen.add(successor)
                todo.append(successor)
    return seen


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def reaches_across(graph: dict[str, set[str]], sources: list[str], forbidden: list[str]) -> list[str]:
    """'A -> B' for every module A in `sources` (packages or modules) that imports a module B in
    `forbidden`, directly or through other agent modules."""
    return [
        f"{name} -> {target}"
        for name in sorted(graph)
        if any(in_package(name, s) for s in sources)
        for target in sorted(reachable(graph, name))
        if any(in_package(target, f) for f in forbidden)
    ]


def process_starters(root: Path) -> list[str]:
    """'module: what' for every agent module that imports a module starting programs (subprocess,
    multiprocessing, pty), anywhere in it, or names an os function that does (os.system, os.execv,
    os.posix_spawn, os.fork...)."""
    found = []
    for module in modules_of(root).values():
        imports = list(imported_names(module))
        uses = {base for base, _ in imports if any(in_package(base, m) for m in PROCESS_MODULES)}
        uses |= {f"os.{name}" for base, name in imports if base == "os" and name and OS_PROCESS_CALL.fullmatch(name)}
        uses |= {
            f"os.{node.attr}"
            for node in ast.walk(ast.parse(module.path.read_text(), str(module.path)))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and OS_PROCESS_CALL.fullmatch(node.attr)
        }
        found += [f"{module.name}: {use}" for use in sorted(uses)]
    return sorted(found)


# -- the rules ------------------------------------------------------------------------------------


def test_the_agent_has_no_import_cycle() -> None:
    assert cycles(agent_graph()) == []


def test_the_packages_import_each_other_in_no_circle() -> None:
    assert cycles(package_graph(agent_graph())) == []


def test_data_modules_import_only_each_other() -> None:
    assert data_module_imports(agent_graph(), DATA_MODULES) == []


def test_the_top_level_of_agent_stays_small() -> None:
    top_level = sorted(p.name for p in AGENT.glob("*.py") if p.name != "__init__.py")
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level


def test_no_module_is_over_the_size_of_one_job() -> None:
    sizes = {m.name: len(m.path.read_text().splitlines()) for m in modules_of(REPO).values()}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


def test_watchers_emit_events_and_never_reach_the_store() -> None:
    assert reaches_across(agent_graph(), ["agent.watch"], ["agent.store"]) == []


def test_the_config_never_reaches_a_backend() -> None:
    config = ["agent.config", "agent.config_errors", "agent.defaults", "agent.safe_yaml"]
    assert reaches_across(agent_graph(), config, ["agent.backend"]) == []


def test_the_daemon_never_reaches_the_cli_text() -> None:
    cli_text = ["agent.cli", "agent.render", "agent.textview"]
    assert reaches_across(agent_graph(), ["agent.daemon"], cli_text) == []


def test_only_the_nvml_backend_imports_pynvml() -> None:
    importers = sorted(
        module.name
        for module in modules_of(REPO).values()
        if any(in_package(base, "pynvml") for base, _ in imported_names(module))
    )
    assert importers != [] and all(in_package(name, "agent.backend.nvml") for name in importers), importers


def test_only_the_process_runner_starts_processes() -> None:
    starters = process_starters(REPO)
    assert f"{PROCESS_RUNNER}: subprocess" in starters, "the rule no longer sees the runner itself"
    outside = [
        found
        for found in starters
        if not any(in_package(found.split(":")[0], name) for name in (PROCESS_RUNNER, *STARTS_PROCESSES_APART))
    ]
    assert outside == [], f"start processes through {PROCESS_RUNNER} (run_process, ProcessStream)"


def test_every_source_path_the_docs_name_exists() -> None:
    documents = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {
        (document.relative_to(REPO).as_posix(), path)
        for document in documents
        for path in re.findall(r"(?<![\w/])(?:agent|tests|bench)/[\w/]*\.py\b", document.read_text())
    }
    assert {path.split("/")[0] for _, path in named} == {"agent", "tests", "bench"}, "the pattern no longer matches"
    assert sorted((doc, path) for doc, path in named if not (REPO / path).is_file()) == []


# -- deadlines run on a monotonic clock ------------------------------------------------------------
#
# The rule: a deadline is named for what it is (`deadline`, `*_deadline`, `*_until`: a moment by which
# something must have happened; `deadline_seconds` is a length, not a moment) and is computed from a
# monotonic or boot-time clock: `time.monotonic()`, `boottime_seconds()`, or a clock handed in under
# the name `monotonic` (`ctx.monotonic()`), directly or through a local name assigned from one. The
# wall clock never enters an expression with a deadline in it: `time.time`, and any callable named
# `clock` (the agent's name for the injected wall clock: timestamps for what is recorded and shown),
# nor a local name assigned from either. A wall-clock step (NTP, an operator) then can neither hold
# a restart for an hour nor cut a drain, a dwell or a probe short.

DEADLINE_NAME = re.compile(r"^(?:.*_)?deadline$|_until$")
MONOTONIC_CALLS = {"monotonic", "boottime_seconds", "monotonic_ns"}


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_time_time(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "time"
        and isinstance(node.value, ast.Name)
        and (node.value.id == "time")
    )


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _clock_kinds(node: ast.AST, wall: set[str], monotonic: set[str]) -> tuple[bool, bool]:
    """(reads the wall clock, reads a monotonic clock) anywhere in `node`."""
    reads_wall = reads_monotonic = False
    for inner in ast.walk(node):
        if _is_time_time(inner) or (isinstance(inner, ast.Call) and _callee(inner) == "clock"):
            reads_wall = True
        elif isinstance(inner, ast.Call) and _callee(inner) in MONOTONIC_CALLS:
            reads_monotonic = True
        elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load):
            reads_wall |= inner.id in wall
            reads_monotonic |= inner.id in monotonic or bool(DEADLINE_NAME.search(inner.id))
    return reads_wall, reads_monotonic


def _targets(node: ast.AST) -> list[tuple[str, ast.AST]]:
    if isinstance(node, ast.Assign):
        return [(name, node.value) for target in node.targets if (name := _name_of(target))]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
        name = _name_of(node.target)
        return [(name, node.value)] if name else []
    return []


def _in_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of one scope: a function's, or the module's outside every function."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def wall_clock_deadlines(source: str, filename: str) -> list[str]:
    """`file:line` for every deadline computed from, or compared with, the wall clock, and every
    deadline computed from no clock this rule knows as monotonic (see the rule above)."""
    tree = ast.parse(source, filename)
    scopes: list[ast.AST] = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
    ]
    found: set[str] = set()
    for scope in scopes:
        wall: set[str] = set()
        monotonic: set[str] = set()
        for _ in range(3):  # names assigned from names: settle the classification
            for node in _in_scope(scope):
                for name, value in _targets(node):
                    reads_wall, reads_monotonic = _clock_kinds(value, wall, monotonic)
                    if reads_wall:
                        wall.add(name)
                    elif reads_monotonic:
                        monotonic.add(name)
        for node in _in_scope(scope):
            for name, value in _targets(node):
                if DEADLINE_NAME.search(name) and not isinstance(value, ast.Constant):
                    reads_wall, reads_monotonic = _clock_kinds(value, wall, monotonic)
                    if reads_wall or not reads_monotonic:
                        found.add(f"{filename}:{node.lineno}")
            if isinstance(node, ast.Compare | ast.BinOp):
                names = {_name_of(n) for n in ast.walk(node)}
                if (
                    any(name and DEADLINE_NAME.search(name) for name in names)
                    and _clock_kinds(node, wall, monotonic)[0]
                ):
                    found.add(f"{filename}:{node.lineno}")
    return sorted(found, key=lambda where: int(where.rpartition(":")[2]))


def test_deadlines_run_on_a_monotonic_clock() -> None:
    found = [
        where
        for module in modules_of(REPO).values()
        for where in wall_clock_deadlines(module.path.read_text(), module.path.relative_to(REPO).as_posix())
    ]
    assert found == []


# -- the checks themselves, on small trees ----------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_closed_inside_a_function_is_a_cycle(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/a.py": "from agent.b import thing\n",
            "agent/b.py": "def thing():\n    from agent import a\n",
            "agent/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.a import x\n",
        },
    )
    graph = import_graph(root)
    assert graph["agent.c"] == {"agent.a"}
    assert cycles(graph) == [["agent.a", "agent.b"]]


def test_a_package_that_reexports_a_submodule_importing_it_is_a_cycle(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/p/__init__.py": "from agent.p.dispatch import execute\n",
            "agent/p/dispatch.py": "from agent.p import hooks\n",
            "agent/p/hooks.py": "from . import base\n",
            "agent/p/base.py": "",
        },
    )
    graph = import_graph(root)
    assert graph["agent.p.hooks"] == {"agent.p", "agent.p.base"}
    assert cycles(graph) == [["agent.p", "agent.p.dispatch", "agent.p.hooks"]]


def test_two_packages_that_import_each_other_are_a_cycle_without_a_module_cycle(tmp_path: Path) -> None:
    # backend.sim.faults took a constant from watch.kernel_log while the watchers read backend.base:
    # no module imports itself again, yet neither package can be read before the other.
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/backend/__init__.py": "",
            "agent/backend/base.py": "",
            "agent/backend/sim/__init__.py": "",
            "agent/backend/sim/faults.py": "from agent.watch.kernel_log import MAX_XID\n",
            "agent/watch/__init__.py": "",
            "agent/watch/kernel_log.py": "",
            "agent/watch/xid.py": "from agent.backend.base import GpuEvent\nimport agent.state\n",
            "agent/state.py": "",
        },
    )
    graph = import_graph(root)
    assert cycles(graph) == []
    packages = package_graph(graph)
    assert packages["agent.watch"] == {"agent.backend", "agent.state"}
    assert packages["agent.state"] == set()
    assert cycles(packages) == [["agent.backend", "agent.watch"]]


def test_a_data_module_that_imports_a_part_is_found(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/events.py": "from agent import TYPE_CHECKING\n",
            "agent/state.py": "from agent.events import Event\nfrom agent.policy.base import HostContext\n",
            "agent/policy/__init__.py": "",
            "agent/policy/base.py": "",
        },
    )
    found = data_module_imports(import_graph(root), ("agent.events", "agent.state"))
    assert found == ["agent.state -> agent.policy.base"]


def test_a_reach_across_counts_imports_through_other_modules(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/watch/__init__.py": "",
            "agent/watch/xid.py": "import agent.state\n",
            "agent/state.py": "def f():\n    from agent.store.database import Store\n",
            "agent/store/__init__.py": "",
            "agent/store/database.py": "",
        },
    )
    assert reaches_across(import_graph(root), ["agent.watch"], ["agent.store"]) == [
        "agent.watch.xid -> agent.store.database"
    ]


def test_every_way_of_starting_a_process_is_seen(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/runner.py": "import subprocess\n",
            "agent/late.py": "def f():\n    import subprocess as sp\n",
            "agent/named.py": "from subprocess import Popen\n",
            "agent/forked.py": "import multiprocessing.pool\n",
            "agent/replaced.py": "import os\ndef f():\n    os.execvpe('x', ['x'], {})\n",
            "agent/shell.py": "from os import system\n",
            "agent/quiet.py": "import os\nos.environ.get('PATH')\nos.killpg(1, 9)\n",
        },
    )
    assert process_starters(root) == [
        "agent.forked: multiprocessing.pool",
        "agent.late: subprocess",
        "agent.named: subprocess",
        "agent.replaced: os.execvpe",
        "agent.runner: subprocess",
        "agent.shell: os.system",
    ]


def test_a_deadline_on_the_wall_clock_is_found() -> None:
    wall = """\
import time
def drain(clock, timeout):
    began = clock()
    deadline = began + timeout
def probe(self, timeout):
    deadline = self.clock() + timeout
def held(self, seconds):
    self.expected_down_until = time.time() + seconds
def compared(ctx, deadline):
    return ctx.clock() >= deadline
def from_nowhere(now, timeout):
    deadline = now + timeout
"""
    assert wall_clock_deadlines(wall, "m.py") == ["m.py:4", "m.py:6", "m.py:8", "m.py:10", "m.py:12"]
    monotonic = """\
import time
from agent.host.boottime import boottime_seconds
def drain(ctx, timeout):
    began = ctx.monotonic()
    deadline = began + timeout
    while ctx.monotonic() < deadline:
        left = deadline - ctx.monotonic()
    stamp = ctx.clock()
def held(self, seconds):
    self.expected_down_until = 0.0
    self.window_until = boottime_seconds() + seconds
def passed(deadline):
    inner_deadline = deadline - 1.0
"""
    assert wall_clock_deadlines(monotonic, "m.py") == []
