"""Rules files steer what the agent runs as root: they are read through the same race-free trust
check as agent.yaml (on the descriptor that is read, every directory from `/`), their directories
are judged from `/` down, and they go through the bounded YAML loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from daemon_harness import write_agent_config
from hosttree import NOBODY_ID
from race import attempts, swapping
from test_safe_yaml import NESTED, alias_bomb, assert_cli_fails_with_one_line

from agent.config import ConfigError, load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.rules.config import load_rules

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks apply when the agent runs as root")

RULE = """\
rules:
  - name: {name}
    match: {{gpu_lost: {{}}}}
    actions: [recommend_reboot]
"""


def rules_file(path: Path, name: str) -> Path:
    path.write_text(RULE.format(name=name))
    path.chmod(0o644)
    return path


def problems(paths: list[Path]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_rules(paths)
    return [str(p) for p in caught.value.problems]


@as_root
def test_a_root_owned_rules_dir_under_a_users_parent_is_refused(tmp_path: Path) -> None:
    """Whoever owns a parent can rename the rules dir away and put their own in its place."""
    parent = tmp_path / "home"
    rules = parent / "rules.d"
    rules.mkdir(parents=True, mode=0o755)
    os.chown(parent, NOBODY_ID, NOBODY_ID)
    refused = f"{rules}: refused: directory {parent} of {rules} is owned by uid {NOBODY_ID}, not root"
    assert problems([rules]) == [refused]  # even while it holds no rule yet
    rules_file(rules / "10-a.yaml", "one")
    assert problems([rules]) == [refused]  # the directory is named, not each file in it
    os.chown(parent, 0, 0)
    assert [rule.name for rule in load_rules([rules])] == ["one"]


def test_a_sticky_rules_dir_is_refused(tmp_path: Path) -> None:
    """Sticky (like /tmp) protects our entries, but anyone may still add a rules file of their own."""
    rules = tmp_path / "rules.d"
    rules.mkdir()
    rules_file(rules / "10-a.yaml", "one")
    rules.chmod(0o1777)
    assert problems([rules]) == [f"{rules}: refused: {rules} is writable by group or others (mode 1777)"]


@as_root
def test_a_rules_file_link_swapped_to_a_users_file_never_loads_it(tmp_path: Path) -> None:
    """The race from the review, on a rules file: its link is swapped between root's file and a
    user's as fast as possible while the rules load again and again. A load either refuses the
    user's file or reads root's; checking one and reading the other would load the user's rule."""
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    files = tmp_path / "files"
    files.mkdir(mode=0o755)
    roots = rules_file(files / "roots.yaml", "roots-rule")
    users = rules_file(files / "users.yaml", "users-rule")
    os.chown(users, NOBODY_ID, NOBODY_ID)
    link, spare = rules / "10-x.yaml", rules / "spare"  # not *.yaml: only the link is loaded
    link.symlink_to(roots)
    spare.symlink_to(users)

    def attempt() -> str:
        try:
            (rule,) = load_rules([rules])
        except ConfigError as exc:
            (problem,) = exc.problems
            assert problem.message.startswith("refused: ") and f"uid {NOBODY_ID}" in problem.message, problem
            return "refused"
        return rule.name

    with swapping(link, spare):
        outcomes = attempts(attempt, {"refused", "roots-rule"}, 3000)
    assert outcomes.keys() == {"refused", "roots-rule"}, outcomes


@pytest.mark.parametrize("bomb", ["alias", "nested"])
def test_check_config_with_a_bomb_for_a_rules_file_exits_1_with_one_line(tmp_path: Path, bomb: str) -> None:
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    bad = rules / "10-bomb.yaml"
    bad.write_text(alias_bomb() if bomb == "alias" else "rules:\n  - " + NESTED + "\n")
    bad.chmod(0o644)
    config, _ = write_agent_config(tmp_path, rules_dir=rules)
    expected = {
        "alias": f"{bad}:1: invalid YAML: anchor &a not allowed",
        "nested": f"{bad}:2: invalid YAML: nested more than 64 levels deep",
    }[bomb]
    assert_cli_fails_with_one_line(["check-config", "--config", str(config)], expected)


def test_a_reload_with_a_bomb_for_a_rules_file_keeps_the_running_rules(tmp_path: Path) -> None:
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    config_path, _ = write_agent_config(tmp_path, rules_dir=rules)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    good = rules_file(rules / "10-a.yaml", "one")
    assert daemon.reloader.reload() is True
    assert [rule.name for rule in daemon.remediator.rules] == ["one"]
    for bomb in (alias_bomb(), "rules:\n  - " + NESTED + "\n"):
        good.write_text(bomb)
        assert daemon.reloader.reload() is False
        assert [rule.name for rule in daemon.remediator.rules] == ["one"]
        assert f"{good}:" in daemon.live.publisher.reload_error
    rules_file(good, "two")
    assert daemon.reloader.reload() is True
    assert [rule.name for rule in daemon.remediator.rules] == ["two"]
