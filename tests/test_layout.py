"""The shape of the `agent` package, and of its tests, held by reading their source (nothing is imported).

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
import itertools
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
PROCESS_RUNNER = "agent.host.processes"
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


# -- the tests' own shape --------------------------------------------------------------------------
#
# tests/ mirrors agent/: a test of one package lives in tests/<package>/ (agent/cli/ in tests/cli/),
# so a module at the top of tests/ says why it is there: it tests the whole system (a real daemon
# with its neighbours, the packages, the benchmarks, this layout), or one module at the top of
# agent/ (named by its path).

TESTS = REPO / "tests"
TOP_LEVEL_TESTS = {
    "test_alert_story.py": "the whole system: two agents, Prometheus and Alertmanager",
    "test_bench_service_scrape.py": "a benchmark (bench/)",
    "test_bench_smoke.py": "the benchmarks (bench/)",
    "test_collect.py": "agent/collect.py",
    "test_dashboard_prometheus.py": "the shipped dashboard and rules (packaging/) on real Prometheus parts",
    "test_escaping.py": "every surface a human reads",
    "test_event_json.py": "agent/events.py",
    "test_fault_agreement.py": "the whole system: every fault, every surface",
    "test_fault_matrix.py": "the whole system: every backend call, every error",
    "test_fleet_metrics_prometheus.py": "the whole system: a fleet on real Prometheus",
    "test_fleet_prometheus.py": "the whole system: a fleet on real Prometheus",
    "test_fuzz.py": "every input from outside",
    "test_h200_telemetry_compare.py": "a benchmark (bench/)",
    "test_helpers.py": "the tests' own helpers",
    "test_history_text.py": "agent/render.py",
    "test_host_faults.py": "the whole system: the host misbehaving",
    "test_layout.py": "the shape of agent/ and tests/",
    "test_monotonic_deadlines.py": "every deadline, across the packages",
    "test_package_dist_upgrade.py": "the packages",
    "test_package_e2e.py": "the packages",
    "test_package_nosystemd.py": "the packages",
    "test_package_rpm_scriptlets.py": "the packages",
    "test_packaging.py": "the packages",
    "test_packaging_container.py": "the packages",
    "test_parser_limits.py": "every parser's limits, across the packages",
    "test_published_socket.py": "agent/api.py",
    "test_reader_answers.py": "every reader of outside data, across the packages",
    "test_remediation_e2e.py": "the whole system: remediation on real processes",
    "test_safe_yaml.py": "agent/safe_yaml.py",
    "test_sandbox_lock.py": "the tests' own systemd sandbox",
    "test_sandbox_on_systemd.py": "the tests' own systemd sandbox",
    "test_soak_short.py": "the whole system: the soak (bench/soak.py)",
    "test_source_containment.py": "the whole system: every source contained",
    "test_state_trust.py": "agent/trust.py",
    "test_status_direct.py": "agent/snapshot.py",
    "test_status_screen.py": "agent/textview.py",
    "test_trust.py": "agent/trust.py",
    "test_unit_file.py": "the systemd unit (systemd/)",
    "test_verdict.py": "agent/verdict.py",
    "test_version.py": "agent/version.py",
}

#: The real_daemon marker (pyproject.toml) is on every test module that starts the agent for real,
#: so `-m "not real_daemon"` runs the fast part. What starts it: an argv naming the CLI with `run` or
#: `demo` and its `--config` or `--dir` (`[sys.executable, "-m", "agent.cli", "run", ..., "--config",
#: path]`), a call whose first argument is `run` or `demo` with options after (`gpu_agent("run",
#: "--config", ...)`, bench's `node.cli("run", ...)`), a real systemd (tests/systemd_sandbox.py) and
#: the packages built and installed into a root; and whatever uses one of them through the helpers
#: of tests/ and bench/ (tests/daemon_harness.py `running_agent`, bench/common.py `RunningDaemon`,
#: a fixture of another test module).
REAL_DAEMON_MARK = "real_daemon"
DAEMON_COMMANDS = ("run", "demo")
CLI_NAMES = ("agent.cli", "gpu-agent")
DAEMON_OPTIONS = ("--config", "--dir")
STARTS_FOR_REAL = ("SystemdSandbox", "Chroot", "build_packages")
_MODULE_LEVEL = "<module>"


def _strings(nodes: list[ast.expr]) -> list[str | None]:
    return [node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None for node in nodes]


def starts_a_daemon_itself(node: ast.AST) -> bool:
    """Whether `node`'s source starts the agent without a helper: the argv, the call, the names above."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.List | ast.Tuple):
            words = _strings(inner.elts)
            named = any(a in CLI_NAMES and b in DAEMON_COMMANDS for a, b in itertools.pairwise(words))
            if named and any(option in words for option in DAEMON_OPTIONS):
                return True
        elif isinstance(inner, ast.Call) and inner.args:
            words = _strings(inner.args)
            if words[0] in DAEMON_COMMANDS and any(word and word.startswith("--") for word in words[1:]):
                return True
        elif (isinstance(inner, ast.Name) and inner.id in STARTS_FOR_REAL) or (
            isinstance(inner, ast.Attribute) and inner.attr in STARTS_FOR_REAL
        ):
            return True
    return False


def _imported_file(root: Path, importer: Path, module: str, name: str) -> tuple[Path, str | None] | None:
    """Where `from MODULE import NAME` in `importer` comes from, as pytest's path has it (the test's own
    directory, tests/, the repository): (the file, the name in it), or (the file, None) for a module."""
    for base in (importer.parent, root / "tests", root):
        path = base.joinpath(*module.split("."))
        if (path / f"{name}.py").is_file():
            return path / f"{name}.py", None
        for file in (path.with_suffix(".py"), path / "__init__.py"):
            if file.is_file():
                return file, name
    return None


def daemon_starting_tests(root: Path) -> list[str]:
    """The test modules under root/tests that start the agent for real, themselves or through what
    they import from tests/ and bench/."""
    units: dict[Path, dict[str, ast.AST]] = {}
    imports: dict[Path, dict[str, tuple[Path, str | None]]] = {}
    for path in sorted([*(root / "tests").rglob("*.py"), *(root / "bench").glob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        units[path] = {node.name: node for node in tree.body if isinstance(node, definitions)}
        body = [node for node in tree.body if not isinstance(node, definitions)]
        units[path][_MODULE_LEVEL] = ast.Module(body=body, type_ignores=[])
        imports[path] = {
            alias.asname or alias.name: found
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            for alias in node.names
            if (found := _imported_file(root, path, node.module, alias.name)) is not None
        }
    starting = {
        path: {name for name, node in found.items() if starts_a_daemon_itself(node)} for path, found in units.items()
    }

    def starts(path: Path, name: str) -> bool:
        if name in units[path]:
            return name in starting[path]
        file, imported = imports[path].get(name, (None, None))
        return file in starting and (bool(starting[file]) if imported is None else imported in starting[file])

    changed = True
    while changed:
        changed = False
        for path, found in units.items():
            for unit, node in found.items():
                used = {inner.id for inner in ast.walk(node) if isinstance(inner, ast.Name)}
                if unit == _MODULE_LEVEL:
                    used |= set(imports[path])  # a fixture imported is used by its name as a parameter
                if unit not in starting[path] and any(starts(path, name) for name in used - {unit}):
                    starting[path].add(unit)
                    changed = True
    return sorted(
        path.relative_to(root).as_posix()
        for path, found in starting.items()
        if found and path.name.startswith("test_") and path.is_relative_to(root / "tests")
    )


def marked_real_daemon(path: Path) -> bool:
    """Whether the module sets `pytestmark` with pytest.mark.real_daemon in it."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return any(
                isinstance(inner, ast.Attribute) and inner.attr == REAL_DAEMON_MARK for inner in ast.walk(node.value)
            )
    return False


def test_a_test_of_one_package_lives_in_its_directory() -> None:
    top_level = {path.name for path in TESTS.glob("test_*.py")}
    assert sorted(top_level - set(TOP_LEVEL_TESTS)) == [], (
        "a test of one package goes in tests/<package>/; at the top of tests/ only the whole system or a top-level "
        "module of agent/ (TOP_LEVEL_TESTS says which, and why)"
    )
    assert sorted(set(TOP_LEVEL_TESTS) - top_level) == [], "stale entries in TOP_LEVEL_TESTS"
    modules = [why for why in TOP_LEVEL_TESTS.values() if why.startswith("agent/")]
    assert [path for path in modules if not (REPO / path).is_file() or path.count("/") != 1] == [], (
        "a top-level test names a module at the top of agent/"
    )
    directories = {path.parent.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")} - {"."}
    assert sorted(d for d in directories if not (AGENT / d / "__init__.py").is_file()) == [], (
        "tests/<directory>/ is named for the package of agent/ its modules test"
    )


def test_the_modules_that_start_real_daemons_are_marked() -> None:
    starting = daemon_starting_tests(REPO)
    assert "tests/cli/test_cli_thin.py" in starting, "the rule no longer sees running_agent"
    assert "tests/test_package_e2e.py" in starting, "the rule no longer sees the systemd sandbox"
    marked = sorted(path.relative_to(REPO).as_posix() for path in TESTS.rglob("test_*.py") if marked_real_daemon(path))
    assert sorted(set(starting) - set(marked)) == [], "set `pytestmark = pytest.mark.real_daemon` in these modules"
    assert sorted(set(marked) - set(starting)) == [], "marked real_daemon, but they start no daemon this test sees"


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


def test_a_daemon_started_through_a_helper_or_a_fixture_is_seen(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        {
            "tests/harness.py": (
                "import subprocess, sys\n"
                "def start(config):\n"
                "    return subprocess.Popen([sys.executable, '-m', 'agent.cli', 'run', '--config', config])\n"
                "def started(config):\n"
                "    return start(config)\n"
                "def words():\n"
                "    return ['gpu-agent', 'run', '--log-format', 'json']\n"
            ),
            "tests/test_direct.py": "def test_it(gpu_agent):\n    gpu_agent('demo', '--dir', 'x')\n",
            "tests/cli/test_helper.py": "from harness import started\ndef test_it():\n    started('a.yaml')\n",
            "tests/cli/test_fixture.py": (
                "import pytest\nfrom harness import start\n@pytest.fixture\ndef agent():\n    yield start('a.yaml')\n"
            ),
            "tests/cli/test_imported_fixture.py": "from test_fixture import agent\ndef test_it(agent):\n    pass\n",
            "tests/test_sandbox.py": "from sandbox import SystemdSandbox\ndef test_it():\n    SystemdSandbox()\n",
            "tests/test_quiet.py": (
                "from harness import words\ndef test_it(complete):\n"
                "    assert words() == ['gpu-agent', 'run', '--log-format', 'json']\n"
                "    complete('gpu-agent', 'run', '--config')\n"
            ),
            "bench/common.py": "def daemon(node):\n    return node.cli('run', '--log-format', 'json')\n",
            "bench/startup.py": "from bench.common import daemon\ndef main(node):\n    daemon(node)\n",
            "tests/test_bench.py": "from bench import startup\ndef test_it():\n    startup.main(None)\n",
        },
    )
    assert daemon_starting_tests(root) == [
        "tests/cli/test_fixture.py",
        "tests/cli/test_helper.py",
        "tests/cli/test_imported_fixture.py",
        "tests/test_bench.py",
        "tests/test_direct.py",
        "tests/test_sandbox.py",
    ]
