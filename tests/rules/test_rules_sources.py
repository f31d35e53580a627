"""Vendor rules and admin overrides (agent/rules/sources.py): real directories, real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.config import AgentConfig
from agent.config_errors import ConfigError
from agent.defaults import DEFAULT_RULES_DIRS
from agent.rules.config import load_rules
from agent.rules.sources import describe, resolve_rules


def rule(name: str) -> str:
    return f"rules:\n  - name: {name}\n    match: {{gpu_lost: }}\n    actions: [recommend_reboot]\n"


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    path.chmod(0o644)
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    shipped, admin = tmp_path / "usr/share/gpu-agent/rules.d", tmp_path / "etc/gpu-agent/rules.d"
    write(shipped, "10-xid.yaml", rule("shipped-xid"))
    write(shipped, "20-thermal.yaml", rule("shipped-thermal"))
    write(shipped, "30-service.yaml", rule("shipped-service"))
    admin.mkdir(mode=0o755, parents=True)
    return shipped, admin


def test_shipped_rules_are_read_in_name_order(dirs: tuple[Path, Path]) -> None:
    shipped, admin = dirs
    resolved = resolve_rules([shipped, admin])
    assert resolved.paths == [shipped / "10-xid.yaml", shipped / "20-thermal.yaml", shipped / "30-service.yaml"]
    assert resolved.masked == [] and resolved.warnings() == []


def test_an_admin_file_of_the_same_name_replaces_the_shipped_one(dirs: tuple[Path, Path]) -> None:
    shipped, admin = dirs
    write(admin, "20-thermal.yaml", rule("site-thermal"))
    write(admin, "15-site.yaml", rule("site-extra"))
    resolved = resolve_rules([shipped, admin])
    assert resolved.paths == [
        shipped / "10-xid.yaml",
        admin / "15-site.yaml",
        admin / "20-thermal.yaml",
        shipped / "30-service.yaml",
    ]
    override = resolved.files[2]
    assert override.origin == admin and override.replaces == (shipped / "20-thermal.yaml",)
    names = [r.name for r in load_rules(resolved.paths)]
    assert names == ["shipped-xid", "site-extra", "site-thermal", "shipped-service"]
    assert f"  {admin / '20-thermal.yaml'} (overrides {shipped / '20-thermal.yaml'})" in describe(resolved)


def test_an_empty_file_or_a_dev_null_link_disables_a_shipped_rule(dirs: tuple[Path, Path]) -> None:
    shipped, admin = dirs
    write(admin, "10-xid.yaml", "")
    os.symlink(os.devnull, admin / "30-service.yaml")
    resolved = resolve_rules([shipped, admin])
    assert resolved.paths == [shipped / "20-thermal.yaml"]
    assert [(m.mask, m.hides) for m in resolved.masked] == [
        (admin / "10-xid.yaml", (shipped / "10-xid.yaml",)),
        (admin / "30-service.yaml", (shipped / "30-service.yaml",)),
    ]
    assert f"  {admin / '10-xid.yaml'}: masked (disables {shipped / '10-xid.yaml'})" in describe(resolved)
    assert [r.name for r in load_rules(resolved.paths)] == ["shipped-thermal"]


def test_yml_files_are_read_and_other_files_named_as_unread(dirs: tuple[Path, Path]) -> None:
    shipped, admin = dirs
    write(admin, "40-site.yml", rule("site-yml"))
    leftover = write(admin, "20-thermal.yaml.rpmsave", rule("old"))
    resolved = resolve_rules([shipped, admin])
    assert admin / "40-site.yml" in resolved.paths
    assert resolved.unread == [leftover]
    assert resolved.warnings() == [f"{leftover}: not read (rules files end in .yaml or .yml)"]


def test_missing_directories_and_no_rules_are_warnings(tmp_path: Path) -> None:
    resolved = resolve_rules([tmp_path / "nowhere"])
    assert resolved.files == []
    assert resolved.warnings() == [
        f"{tmp_path / 'nowhere'}: no such directory",
        "no rules files: remediation has nothing to do",
    ]


def test_a_directory_others_may_write_is_refused(dirs: tuple[Path, Path]) -> None:
    shipped, admin = dirs
    admin.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        resolve_rules([shipped, admin])
    # agent.trust names the directory at fault, which may also be a parent of the rules dir
    assert [str(p) for p in caught.value.problems] == [
        f"{admin}: refused: {admin} is writable by group or others (mode 0777)"
    ]


def test_rules_dirs_defaults_and_the_old_rules_dir_alias() -> None:
    assert AgentConfig().remediation.rules_dirs == list(DEFAULT_RULES_DIRS)
    custom = AgentConfig.model_validate({"remediation": {"rules_dir": "/srv/rules"}})
    assert custom.remediation.rules_dirs == ["/srv/rules"]
    # agent.yaml files from earlier packages spell out the old default: it keeps the shipped rules
    legacy = AgentConfig.model_validate({"remediation": {"rules_dir": "/etc/gpu-agent/rules.d"}})
    assert legacy.remediation.rules_dirs == list(DEFAULT_RULES_DIRS)
    with pytest.raises(ValueError, match="not both"):
        AgentConfig.model_validate({"remediation": {"rules_dir": "/a", "rules_dirs": ["/b"]}})


def test_status_shows_which_rules_came_from_where(dirs: tuple[Path, Path]) -> None:
    """The daemon's status names the admin's overrides and masks (the remediator loads them once)."""
    from snapshots import node_snapshot

    from agent.daemon.remediator import load_rules_dir
    from agent.documents import snapshot_document
    from agent.textview import status_text

    shipped, admin = dirs
    write(admin, "20-thermal.yaml", rule("site-thermal"))
    (admin / "30-service.yaml").symlink_to(os.devnull)
    loaded = load_rules_dir(AgentConfig.model_validate({"remediation": {"rules_dirs": [str(shipped), str(admin)]}}))
    document = snapshot_document(node_snapshot(rules_sources=loaded.sources), source="daemon")
    assert document["rules"] == [
        f"{shipped}/10-xid.yaml",
        f"{admin}/20-thermal.yaml (overrides {shipped}/20-thermal.yaml)",
        f"{admin}/30-service.yaml: masked (disables {shipped}/30-service.yaml)",
    ]
    text = status_text(document, width=400)  # a terminal wide enough for the temporary paths
    assert "rules: 2 file(s) read" in text
    assert f"  {admin}/20-thermal.yaml (overrides {shipped}/20-thermal.yaml)" in text
    assert f"  {admin}/30-service.yaml: masked (disables {shipped}/30-service.yaml)" in text
    assert f"  {shipped}/10-xid.yaml" not in text  # shipped files as they are: counted, not listed
