"""Trust: the agent runs as root, so the files that steer it (agent.yaml, rules.d, hooks) must be
changeable by root alone, the status socket must be root's unless a group is configured, and the
secrets in webhook and Alertmanager URLs and headers must never reach a log or the event store."""

from __future__ import annotations

import base64
import contextlib
import grp
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from daemon_harness import running_agent, write_agent_config
from helpers import wait_until
from hosttree import NOBODY_ID, run_unprivileged
from race import attempts, swapping

from agent import api, api_server
from agent.backend.sim import SimulatedBackend
from agent.config import ConfigError, load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.trust import (
    UntrustedError,
    directory_problem,
    executable_problem,
    open_trusted,
    read_trusted,
    run_trusted,
)

pytestmark = pytest.mark.real_daemon

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks apply when the agent runs as root")


def gpu_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=60)


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert problem.file == str(path)
    assert problem.message.startswith("refused: ")
    return problem.message


# -- agent.yaml -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666, 0o660])
def test_a_config_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    config, _ = write_agent_config(tmp_path)
    assert load_config(config).backend == "simulated"
    config.chmod(mode)
    message = refusal(config)
    assert f"{config} is writable by group or others (mode {mode:04o})" in message
    assert f"chmod go-w {config}" in message
    # Always, whoever the agent runs as.
    with pytest.raises(UntrustedError):
        open_trusted(config, agent_uid=NOBODY_ID)


@as_root
def test_a_config_not_owned_by_root_is_refused_when_running_as_root(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path)
    os.chown(config, NOBODY_ID, NOBODY_ID)
    assert f"{config} is owned by uid {NOBODY_ID}, not root" in refusal(config)
    # An unprivileged agent (a developer's) may use its own files.
    fd, _real = open_trusted(config, agent_uid=NOBODY_ID)
    os.close(fd)


def test_a_config_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "etc"
    directory.mkdir()
    config, _ = write_agent_config(tmp_path)
    moved = directory / "agent.yaml"
    shutil.move(config, moved)
    directory.chmod(0o775)
    assert f"directory {directory} of {moved} is writable by group or others (mode 0775)" in refusal(moved)
    # sticky (as /tmp): others may add files but not replace this one
    directory.chmod(0o1777)
    assert load_config(moved).backend == "simulated"


def test_a_symlink_is_judged_by_the_file_it_points_to(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path)
    link = tmp_path / "link.yaml"
    link.symlink_to(config)
    assert load_config(link).backend == "simulated"
    config.chmod(0o666)
    assert f"{config} is writable by group or others" in refusal(link)


def test_check_config_names_the_untrusted_file(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path)
    config.chmod(0o666)
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.startswith(f"{config}: refused: {config} is writable by group or others (mode 0666)")
    assert "Traceback" not in result.stderr


def test_reload_of_an_untrusted_config_keeps_the_running_one(tmp_path: Path) -> None:
    config_path, _ = write_agent_config(tmp_path)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    config_path.write_text(config_path.read_text().replace("mode: enforce", "mode: observe"))
    config_path.chmod(0o664)
    assert daemon.reloader.reload() is False
    assert daemon.live.config.mode.value == "enforce"
    assert "refused" in daemon.live.publisher.reload_error and str(config_path) in daemon.live.publisher.reload_error
    config_path.chmod(0o644)
    assert daemon.reloader.reload() is True
    assert daemon.live.config.mode.value == "observe"


# -- rules.d and hooks ------------------------------------------------------------------------------


HOOK_RULE = """\
rules:
  - name: drain-on-xid
    match: {{xid: {{codes: [79]}}}}
    actions:
      - run_hook: {{argv: [{hook}, --reason, xid]}}
"""


def rules_setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    hooks = tmp_path / "hooks"
    hooks.mkdir(mode=0o755)
    hook = hooks / "drain.sh"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    rule_file = rules / "10-drain.yaml"
    rule_file.write_text(HOOK_RULE.format(hook=hook))
    rule_file.chmod(0o644)
    config, _ = write_agent_config(tmp_path, rules_dir=rules)
    return config, rule_file, hook


def test_check_config_refuses_untrusted_rules_and_hooks(tmp_path: Path) -> None:
    config, rule_file, hook = rules_setup(tmp_path)
    ok = gpu_agent("check-config", "--config", str(config))
    assert ok.returncode == 0, ok.stderr
    assert "1 rules" in ok.stdout

    rule_file.chmod(0o664)
    refused = gpu_agent("check-config", "--config", str(config))
    assert refused.returncode == 1
    assert f"{rule_file}: refused: {rule_file} is writable by group or others (mode 0664)" in refused.stderr
    rule_file.chmod(0o644)

    rule_file.parent.chmod(0o777)
    refused = gpu_agent("check-config", "--config", str(config))
    assert (
        f"{rule_file.parent}: refused: {rule_file.parent} is writable by group or others (mode 0777)" in refused.stderr
    )
    rule_file.parent.chmod(0o755)

    hook.chmod(0o775)
    refused = gpu_agent("check-config", "--config", str(config))
    assert refused.returncode == 1
    assert f"{rule_file}:2 rule drain-on-xid: actions[0].run_hook.argv[0]:" in refused.stderr
    assert f"{hook} is writable by group or others (mode 0775)" in refused.stderr
    hook.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(hook, NOBODY_ID, NOBODY_ID)
        refused = gpu_agent("check-config", "--config", str(config))
        assert f"{hook} is owned by uid {NOBODY_ID}, not root: run `chown root: {hook}`" in refused.stderr
        os.chown(rule_file, NOBODY_ID, NOBODY_ID)
        refused = gpu_agent("check-config", "--config", str(config))
        assert f"{rule_file}: refused: {rule_file} is owned by uid {NOBODY_ID}, not root" in refused.stderr


# -- checks that cannot be raced ----------------------------------------------------------------


def owned_by_nobody(path: Path, mode: int = 0o755) -> Path:
    os.chown(path, NOBODY_ID, NOBODY_ID)
    path.chmod(mode)
    return path


@as_root
def test_a_root_owned_rules_dir_under_a_user_owned_parent_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "home"
    rules = parent / "rules.d"
    rules.mkdir(parents=True)
    (rules / "10-x.yaml").write_text("rules: []\n")
    owned_by_nobody(parent)
    expected = f"directory {parent} of {rules} is owned by uid {NOBODY_ID}, not root"
    assert directory_problem(rules) == expected
    with pytest.raises(UntrustedError, match=f"directory {parent} of {rules}/10-x.yaml is owned by uid {NOBODY_ID}"):
        read_trusted(rules / "10-x.yaml")
    os.chown(parent, 0, 0)
    assert directory_problem(rules) is None
    assert read_trusted(rules / "10-x.yaml") == b"rules: []\n"


def test_the_directory_holding_a_symlink_is_checked(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path)
    links = tmp_path / "links"
    links.mkdir()
    (links / "agent.yaml").symlink_to(config)
    assert load_config(links / "agent.yaml").backend == "simulated"
    links.chmod(0o777)  # anyone could repoint the link
    assert f"directory {links} of {links / 'agent.yaml'} is writable by group or others" in refusal(
        links / "agent.yaml"
    )
    links.chmod(0o1777)  # sticky: only the link's owner (root) may replace it
    assert load_config(links / "agent.yaml").backend == "simulated"


@as_root
def test_in_a_sticky_directory_only_our_own_entries_are_passed(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    (shared / "agent.yaml").symlink_to(config)
    assert load_config(shared / "agent.yaml").backend == "simulated"
    os.chown(shared / "agent.yaml", NOBODY_ID, NOBODY_ID, follow_symlinks=False)  # nobody's link: nobody may swap it
    message = refusal(shared / "agent.yaml")
    assert f"{shared / 'agent.yaml'} on the way to {shared / 'agent.yaml'} is owned by uid {NOBODY_ID}" in message


def link_pair(directory: Path, trusted: Path, users: Path) -> tuple[Path, Path]:
    link, spare = directory / "agent.yaml", directory / "spare.yaml"
    link.symlink_to(trusted)
    spare.symlink_to(users)
    return link, spare


@as_root
def test_a_link_swapped_between_roots_file_and_a_users_file_never_loads_the_users(tmp_path: Path) -> None:
    """The race from the review: the user owns the directory the config link sits in and swaps the
    link between root's config and their own, while the agent loads it again and again."""
    config, _ = write_agent_config(tmp_path)
    users = tmp_path / "users.yaml"
    users.write_text(config.read_text().replace("mode: enforce", "mode: observe"))
    owned_by_nobody(users, 0o644)
    # In the user's own directory: never trusted, whatever the link points at when looked at.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    owned_by_nobody(theirs)
    link, spare = link_pair(theirs, config, users)
    with swapping(link, spare):
        outcomes = attempts(lambda: _load_outcome(link), {"enforce", "observe"}, 400, limit_seconds=2)
    assert outcomes.keys() == {"refused"}, outcomes
    # In a root-owned directory, swapped as fast as possible: a load either refuses the user's
    # file or reads root's; checking one file and reading the other would show up as "observe".
    ours = tmp_path / "ours"
    ours.mkdir()
    link, spare = link_pair(ours, config, users)
    with swapping(link, spare):
        outcomes = attempts(lambda: _load_outcome(link), {"refused", "enforce"}, 400)
    assert outcomes.keys() == {"refused", "enforce"}, outcomes


def _load_outcome(path: Path) -> str:
    try:
        return load_config(path).mode.value
    except ConfigError as exc:
        assert all(p.message.startswith("refused: ") for p in exc.problems), exc.problems
        return "refused"


@as_root
def test_a_hook_swapped_for_a_users_program_never_runs(tmp_path: Path) -> None:
    """run_trusted executes the descriptor it checked: a link repointed after the check cannot
    change what runs."""
    marks = tmp_path / "marks"
    marks.mkdir()
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for who in ("root", "user"):
        script = hooks / f"{who}.sh"
        script.write_text(f'#!/bin/sh\necho "{who} $1" >> {marks}/{who}\n')
        script.chmod(0o755)
    owned_by_nobody(hooks / "user.sh")
    link, spare = hooks / "hook", hooks / "spare"
    link.symlink_to(hooks / "root.sh")
    spare.symlink_to(hooks / "user.sh")

    def attempt() -> str:
        try:
            result = run_trusted([str(link), "--reason"], 10)
        except UntrustedError as exc:
            assert f"{hooks / 'user.sh'} is owned by uid {NOBODY_ID}" in str(exc)
            return "refused"
        assert result.returncode == 0 and result.argv == (str(link), "--reason"), result
        return "ran"

    with swapping(link, spare):
        outcomes = attempts(attempt, {"ran", "refused"}, 60)
    ran = outcomes.get("ran", 0)
    assert ran and outcomes.get("refused"), outcomes
    assert not (marks / "user").exists()
    assert (marks / "root").read_text().splitlines() == ["root --reason"] * ran
    assert executable_problem(str(hooks / "user.sh")) is not None
    assert executable_problem(str(hooks / "root.sh")) is None
    assert executable_problem("root.sh") == "hook program must be an absolute path, not 'root.sh'"


def test_a_fifo_or_a_directory_is_not_a_config(tmp_path: Path) -> None:
    fifo = tmp_path / "agent.yaml"
    os.mkfifo(fifo, 0o644)
    with pytest.raises(ConfigError, match="cannot read: not a regular file"):  # and no hang waiting for a writer
        load_config(fifo)
    with pytest.raises(ConfigError, match="cannot read: Is a directory"):
        load_config(tmp_path)


# -- the status socket ----------------------------------------------------------------------------


@contextlib.contextmanager
def public_directory() -> Iterator[Path]:
    """A directory everyone can reach (pytest's own are private), so the socket's own mode decides."""
    directory = Path(tempfile.mkdtemp(prefix="gpu-agent-trust-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def connect_as_nobody(path: Path) -> str:
    def attempt() -> str:
        try:
            return json.dumps(api.call(path, "ping"))
        except PermissionError:
            return "denied"

    return run_unprivileged(attempt)


def test_the_socket_is_root_only_without_a_group() -> None:
    with public_directory() as directory:
        server = api_server.ApiServer(directory / "agent.sock", {"ping": lambda _p: "pong"})
        server.start()
        try:
            info = (directory / "agent.sock").stat()
            assert oct(info.st_mode & 0o777) == oct(0o600)
            assert info.st_uid == os.geteuid()
            assert api.call(directory / "agent.sock", "ping") == "pong"
            if os.geteuid() == 0:
                assert connect_as_nobody(directory / "agent.sock") == "denied"
        finally:
            server.close()


@as_root
def test_a_configured_group_may_use_the_socket() -> None:
    group = grp.getgrgid(NOBODY_ID).gr_name if NOBODY_ID in {g.gr_gid for g in grp.getgrall()} else None
    if group is None:
        pytest.skip("no group with nobody's gid on this machine")
    with public_directory() as directory:
        server = api_server.ApiServer(directory / "agent.sock", {"ping": lambda _p: "pong"}, group=group)
        server.start()
        try:
            info = (directory / "agent.sock").stat()
            assert oct(info.st_mode & 0o777) == oct(0o660)
            assert (info.st_uid, info.st_gid) == (0, NOBODY_ID)
            assert connect_as_nobody(directory / "agent.sock") == '"pong"'
        finally:
            server.close()


# -- secrets stay out of logs and the store -----------------------------------------------------------


SECRET = "s3cr3t-T0KEN-42"


class Receiver:
    """A local HTTP endpoint standing in for a webhook receiver and Alertmanager; records requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append((self.path, dict(self.headers)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


SECRET_RULES = """\
rules:
  - name: tell-someone
    match: {{xid: {{codes: [13]}}}}
    cooldown_seconds: 0
    actions:
      - webhook:
          url: "http://127.0.0.1:{port}/hooks/{secret}?token={secret}"
          headers: {{Authorization: "Bearer {secret}", X-Token: {secret}}}
    on_exhausted: []
  - name: page-someone
    match: {{xid: {{codes: [13]}}}}
    cooldown_seconds: 0
    actions:
      - alertmanager
  - name: nobody-listens
    match: {{xid: {{codes: [13]}}}}
    cooldown_seconds: 0
    actions:
      - webhook: {{url: "http://127.0.0.1:{closed}/x/{secret}?key={secret}", headers: {{X-Token: {secret}}}}}
"""


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_webhook_and_alertmanager_secrets_never_reach_the_log_or_the_store(tmp_path: Path) -> None:
    receiver = Receiver()
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    (rules / "10-notify.yaml").write_text(SECRET_RULES.format(port=receiver.port, secret=SECRET, closed=closed_port()))
    (rules / "10-notify.yaml").chmod(0o644)
    try:
        with running_agent(tmp_path, rules_dir=rules) as agent:
            agent.notifications.wait_for("READY", "1")
            text = agent.config_path.read_text()
            alertmanager = f"http://alert:{SECRET}@127.0.0.1:{receiver.port}/am/{SECRET}"
            agent.config_path.write_text(
                text.replace("remediation: {", f'remediation: {{alertmanager_url: "{alertmanager}", ')
            )
            agent.signal(signal.SIGHUP)
            wait_until(
                lambda: "config reloaded" in agent.log(),
                15,
                lambda: f"the reload in the log:\n{agent.log()[-2000:]}",
                poll_seconds=0.1,
            )
            SimulatedBackend("h200x2", agent.state_dir).inject_xid(0, 13)
            wait_until(
                lambda: agent.log().count('"action finished"') >= 3,
                30,
                lambda: f"three finished actions in the log:\n{agent.log()[-3000:]}",
                poll_seconds=0.1,
            )
            events = gpu_agent("events", "--json", "--config", str(agent.config_path))
            log = agent.log()
    finally:
        receiver.server.shutdown()
    # the secrets were used ...
    paths = [path for path, _ in receiver.requests]
    assert f"/hooks/{SECRET}?token={SECRET}" in paths
    assert any(path.startswith(f"/am/{SECRET}/api/v2/alerts") for path in paths)
    assert any(headers.get("X-Token") == SECRET for _, headers in receiver.requests)
    basic = "Basic " + base64.b64encode(f"alert:{SECRET}".encode()).decode()
    assert any(headers.get("Authorization") == basic for _, headers in receiver.requests), (
        "user:password@ is basic auth"
    )
    # ... and appear nowhere the agent writes: the structured log, the event store
    assert events.returncode == 0, events.stderr
    assert '"tell-someone"' in events.stdout and "HTTP 200" in events.stdout
    assert "nobody-listens" in events.stdout and "failed" in events.stdout
    for where, text in (("log", log), ("event store", events.stdout)):
        assert SECRET not in text, f"a secret in the {where}: {text[text.find(SECRET) - 300 : text.find(SECRET) + 100]}"
