"""Node policy items against a fake host tree: transparent hugepages, Triton cache, nouveau."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosttree import (
    Identity,
    KernelSysfsPaths,
    ScriptedHostContext,
    make_host_tree,
    run_unprivileged,
    unprivileged_identity,
)

from agent.config import AgentConfig
from agent.config.desired import NodePolicy, TransparentHugepages, TritonCache
from agent.config.service_entry import ServiceConfig
from agent.host.paths import HostPaths
from agent.policy import nouveau, thp, triton_cache
from agent.policy.base import HostContext
from agent.policy.item import enforce
from agent.policy.plan import ApplyOutcome, ItemPlan, ItemResult, PlanStatus
from agent.policy.triton_cache import TritonCacheWant

ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"
CONFIG = AgentConfig()


def host(tmp_path: Path, **tree: object) -> HostContext:
    return HostContext(make_host_tree(tmp_path, **tree))  # type: ignore[arg-type]


# -- transparent hugepages ------------------------------------------------------------------------


def thp_want(enabled: str | None = "never", defrag: str | None = None) -> TransparentHugepages:
    return TransparentHugepages.model_validate({"enabled": enabled, "defrag": defrag})


def test_thp_desired_reads_the_shorthand_and_skips_an_empty_item() -> None:
    assert thp.ITEM.name == "transparent_hugepages"
    assert thp.ITEM.desired(NodePolicy(), CONFIG) is None
    assert thp.ITEM.desired(NodePolicy.model_validate({"transparent_hugepages": {}}), CONFIG) is None
    want = thp.ITEM.desired(NodePolicy.model_validate({"transparent_hugepages": "never"}), CONFIG)
    assert want == TransparentHugepages(enabled="never")


@pytest.mark.parametrize(
    ("text", "active", "offered"),
    [
        ("always [madvise] never\n", "madvise", ("always", "madvise", "never")),
        (
            "always defer defer+madvise [madvise] never",
            "madvise",
            ("always", "defer", "defer+madvise", "madvise", "never"),
        ),
        ("[always] madvise never", "always", ("always", "madvise", "never")),
        ("never\n", "never", None),  # a plain file after a write: bare word = active, choices unknown
    ],
)
def test_thp_parses_the_kernel_choice_format(text: str, active: str, offered: tuple[str, ...] | None) -> None:
    assert thp.parse_choice(text) == thp.KernelChoice(active, offered)


@pytest.mark.parametrize("text", ["always madvise never", "[always] [never]", "", "[]"])
def test_thp_finds_no_active_value_without_exactly_one_bracket(text: str) -> None:
    assert thp.parse_choice(text) is None


def test_thp_in_sync(tmp_path: Path) -> None:
    done = thp.ITEM.plan(host(tmp_path), thp_want("madvise", "madvise"))
    assert done.plan == ItemPlan(
        "transparent_hugepages",
        None,
        PlanStatus.IN_SYNC,
        "enabled=madvise defrag=madvise",
        "enabled=madvise defrag=madvise",
    )


def test_thp_drift_lists_one_write_per_file(tmp_path: Path) -> None:
    done = thp.ITEM.plan(host(tmp_path), thp_want("never", "defer+madvise"))
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.gpu is None
    assert done.plan.desired == "enabled=never defrag=defer+madvise"
    assert done.plan.actual == "enabled=madvise defrag=madvise"
    assert done.plan.changes == (
        "write never to /sys/kernel/mm/transparent_hugepage/enabled",
        "write defer+madvise to /sys/kernel/mm/transparent_hugepage/defrag",
    )


def test_thp_apply_writes_like_the_kernel_and_converges(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = thp_want("never", "defer+madvise")
    result = enforce(thp.ITEM, ctx, want, thp.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.APPLIED
    assert "lost at reboot" in result.detail
    assert ctx.paths.read_text(ENABLED) == "always madvise [never]\n"
    assert ctx.paths.read_text(DEFRAG) == "always defer [defer+madvise] madvise never\n"
    again = thp.ITEM.plan(ctx, want)
    assert again.plan.status is PlanStatus.IN_SYNC
    assert again.plan.actual == "enabled=never defrag=defer+madvise"
    assert enforce(thp.ITEM, ctx, want, again).outcome is ApplyOutcome.UNCHANGED
    assert ctx.paths.read_text(ENABLED) == "always madvise [never]\n"


def test_thp_apply_on_plain_files_reads_back_the_bare_word(tmp_path: Path) -> None:
    ctx = host(tmp_path, kernel_sysfs=False)
    want = thp_want("never")
    assert enforce(thp.ITEM, ctx, want, thp.ITEM.plan(ctx, want)).outcome is ApplyOutcome.APPLIED
    assert ctx.paths.read_text(ENABLED) == "never"
    assert thp.ITEM.plan(ctx, want).plan.status is PlanStatus.IN_SYNC


def test_thp_only_touches_the_configured_file(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = thp_want(enabled=None, defrag="never")
    done = thp.ITEM.plan(ctx, want)
    assert done.plan.changes == ("write never to /sys/kernel/mm/transparent_hugepage/defrag",)
    enforce(thp.ITEM, ctx, want, done)
    assert ctx.paths.read_text(ENABLED) == "always [madvise] never\n"


def test_thp_kernel_without_thp_is_not_applicable(tmp_path: Path) -> None:
    ctx = host(tmp_path, thp_enabled=None, thp_defrag=None)
    done = thp.ITEM.plan(ctx, thp_want("never"))
    assert done.plan.status is PlanStatus.NOT_APPLICABLE
    assert done.plan.in_sync
    assert "kernel built without transparent hugepages" in done.plan.detail
    assert enforce(thp.ITEM, ctx, thp_want("never"), done).outcome is ApplyOutcome.UNCHANGED  # as `apply` reports it


def test_thp_choice_the_kernel_does_not_offer_is_an_error_naming_the_choices(tmp_path: Path) -> None:
    # Kernels before 4.6 had no `defer` defrag modes.
    done = thp.ITEM.plan(host(tmp_path, thp_defrag="always [madvise] never"), thp_want(None, "defer"))
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail == "defrag=defer is not offered by this kernel (choices: always, madvise, never)"
    assert done.plan.actual == "defrag=madvise"


def test_thp_unparseable_file_is_an_error(tmp_path: Path) -> None:
    done = thp.ITEM.plan(host(tmp_path, thp_enabled="always madvise never"), thp_want())
    assert done.plan.status is PlanStatus.ERROR
    assert "cannot parse /sys/kernel/mm/transparent_hugepage/enabled" in done.plan.detail


def test_thp_write_failure_is_reported_not_raised(tmp_path: Path) -> None:
    ctx = host(tmp_path, kernel_sysfs=False)
    want = thp_want("never")
    done = thp.ITEM.plan(ctx, want)
    assert done.plan.status is PlanStatus.DRIFT

    class RefusingSysfs(HostPaths):
        def write_sysfs(self, absolute: str, value: str) -> None:
            raise PermissionError(13, "Permission denied", str(self.path(absolute)))

    result = enforce(thp.ITEM, HostContext(RefusingSysfs(tmp_path)), want, done)
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail == "cannot write never to /sys/kernel/mm/transparent_hugepage/enabled: Permission denied"


def test_thp_file_replaced_by_a_directory_after_planning_fails_cleanly(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = thp_want("never")
    done = thp.ITEM.plan(ctx, want)
    enabled = ctx.paths.path(ENABLED)
    enabled.unlink()
    enabled.mkdir()
    result = enforce(thp.ITEM, ctx, want, done)
    assert result.outcome is ApplyOutcome.FAILED
    assert "Is a directory" in result.detail
    assert thp.ITEM.plan(ctx, want).plan.status is PlanStatus.ERROR


def test_thp_write_the_kernel_ignores_fails_the_apply(tmp_path: Path) -> None:
    class IgnoringSysfs(HostPaths):
        def write_sysfs(self, absolute: str, value: str) -> None:
            pass

    make_host_tree(tmp_path)
    ctx = HostContext(IgnoringSysfs(tmp_path))
    want = thp_want("never")
    result = enforce(thp.ITEM, ctx, want, thp.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.FAILED
    # The engine's one verification read the file again and found the old value.
    assert result.detail == "applied but still drift: actual enabled=madvise"


def test_thp_apply_writes_what_the_plan_shows_and_verifies_with_one_read(tmp_path: Path) -> None:
    """Each line the plan shows is one sysfs write with the word shown; apply reads nothing itself,
    and enforce reads each file once more to verify."""
    make_host_tree(tmp_path)

    class CountingSysfs(KernelSysfsPaths):
        def read_text(self, absolute: str) -> str:
            reads.append(absolute)
            return super().read_text(absolute)

        def write_sysfs(self, absolute: str, value: str) -> None:
            writes.append((absolute, value))
            super().write_sysfs(absolute, value)

    reads: list[str] = []
    writes: list[tuple[str, str]] = []
    ctx = HostContext(CountingSysfs(tmp_path))
    want = thp_want("never", "defer+madvise")
    done = thp.ITEM.plan(ctx, want)
    assert writes == [] and reads == [ENABLED, DEFRAG]
    reads.clear()
    assert enforce(thp.ITEM, ctx, want, done).outcome is ApplyOutcome.APPLIED
    assert done.plan.changes == tuple(f"write {value} to {path}" for path, value in writes)
    assert reads == [ENABLED, DEFRAG]  # the one verifying plan


# -- Triton cache -------------------------------------------------------------------------------


def me() -> tuple[str, str]:
    return pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name


def cache_want(
    path: str = "/var/cache/triton",
    *,
    owner: str | None = None,
    group: str | None = None,
    mode: int = 0o755,
    units: tuple[str, ...] = ("sglang.service",),
) -> TritonCacheWant:
    user, grp_name = me()
    return TritonCacheWant(path, owner or user, group or grp_name, mode, units)


DROPIN = "/etc/systemd/system/sglang.service.d/gpu-agent-triton.conf"


def test_triton_desired_resolves_service_names_to_units() -> None:
    config = AgentConfig(services=[ServiceConfig(name="sglang", unit="sglang-main.service")])
    node = NodePolicy(
        triton_cache=TritonCache(
            path="/srv/triton", owner="svc", group="gpu", mode="0775", services=["sglang", "vllm", "tgi.service"]
        )
    )
    assert triton_cache.ITEM.name == "triton_cache"
    assert triton_cache.ITEM.desired(NodePolicy(), config) is None
    assert triton_cache.ITEM.desired(node, config) == TritonCacheWant(
        "/srv/triton", "svc", "gpu", 0o775, ("sglang-main.service", "vllm.service", "tgi.service")
    )


def test_triton_command_services_get_no_dropin_for_a_unit_that_does_not_exist(tmp_path: Path) -> None:
    """A `manager: command` service is started by the agent, which passes TRITON_CACHE_DIR itself:
    no drop-in for the unit name it would have, and the plan says how it gets it."""
    command = ServiceConfig(name="sglang", manager="command", start_command=["/bin/true"], stop_command=["/bin/true"])
    user, group = me()
    config = AgentConfig(services=[command, ServiceConfig(name="vllm")])
    node = NodePolicy(
        triton_cache=TritonCache(path="/var/cache/triton", owner=user, group=group, services=["sglang", "vllm"])
    )
    want = triton_cache.ITEM.desired(node, config)
    assert want == TritonCacheWant("/var/cache/triton", user, group, 0o755, ("vllm.service",), ("sglang",))
    ctx = ScriptedHostContext(make_host_tree(tmp_path))
    # An earlier agent wrote one for the unit the command service does not have: it goes.
    ctx.paths.write_file_atomic(DROPIN, triton_cache.dropin_content("/var/cache/triton"))
    done = triton_cache.ITEM.plan(ctx, want)
    assert f"remove {DROPIN}" in done.plan.changes
    assert done.plan.desired == (
        f"/var/cache/triton {user}:{group} 0755; TRITON_CACHE_DIR for vllm.service"
        "; TRITON_CACHE_DIR in the start command's environment of sglang"
    )
    assert enforce(triton_cache.ITEM, ctx, want, done).outcome is ApplyOutcome.APPLIED
    assert not ctx.paths.path(DROPIN).exists()
    assert ctx.paths.path("/etc/systemd/system/vllm.service.d/gpu-agent-triton.conf").exists()
    assert triton_cache.ITEM.plan(ctx, want).plan.status is PlanStatus.IN_SYNC


def test_triton_dropin_content_quotes_for_systemd() -> None:
    assert triton_cache.dropin_content("/var/cache/triton").endswith(
        "[Service]\nEnvironment=TRITON_CACHE_DIR=/var/cache/triton\n"
    )
    assert triton_cache.dropin_content("/srv/my cache/%i").endswith(
        'Environment="TRITON_CACHE_DIR=/srv/my cache/%%i"\n'
    )
    assert triton_cache.dropin_content("/srv/a").startswith("# Managed by gpu-agent")


def test_triton_missing_directory_and_dropin_is_drift(tmp_path: Path) -> None:
    user, group = me()
    done = triton_cache.ITEM.plan(host(tmp_path), cache_want())
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.desired == f"/var/cache/triton {user}:{group} 0755; TRITON_CACHE_DIR for sglang.service"
    assert done.plan.actual == "/var/cache/triton missing; drop-in missing for sglang.service"
    assert done.plan.changes == (
        f"create /var/cache/triton ({user}:{group} 0755)",
        f"write {DROPIN}",
        "run: systemctl daemon-reload",
    )
    assert "restart sglang.service" in done.plan.detail


def test_triton_apply_creates_everything_reports_the_reload_and_converges(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = cache_want("/var/cache/gpu/triton")
    result = enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.APPLIED, result.detail
    st = ctx.paths.path("/var/cache/gpu/triton").stat()
    assert stat.S_ISDIR(st.st_mode)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), os.getegid(), 0o755)
    assert ctx.paths.read_text(DROPIN).endswith("[Service]\nEnvironment=TRITON_CACHE_DIR=/var/cache/gpu/triton\n")
    assert f"systemd not reloaded (not run: host_root is {tmp_path}); run `systemctl daemon-reload`" in result.detail
    assert "restart sglang.service to pick up the new environment" in result.detail
    again = triton_cache.ITEM.plan(ctx, want)
    assert again.plan.status is PlanStatus.IN_SYNC, again
    assert again.plan.actual.endswith("0755; TRITON_CACHE_DIR set for sglang.service")
    assert enforce(triton_cache.ITEM, ctx, want, again).outcome is ApplyOutcome.UNCHANGED


def test_triton_setgid_mode_survives_create_and_reads_in_sync(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = cache_want(mode=0o2775, units=())
    assert enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want)).outcome is ApplyOutcome.APPLIED
    assert stat.S_IMODE(ctx.paths.path("/var/cache/triton").stat().st_mode) == 0o2775
    assert triton_cache.ITEM.plan(ctx, want).plan.status is PlanStatus.IN_SYNC


def test_triton_apply_reloads_systemd_through_the_host_context(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path))
    want = cache_want()
    result = enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.APPLIED
    assert ctx.calls == [("systemctl", "daemon-reload")]
    assert "systemd reloaded" in result.detail
    # Restarting is the operator's call, never the item's.
    assert not any("restart" in " ".join(call) for call in ctx.calls)


def test_triton_failing_reload_fails_with_its_output(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path), results={"systemctl": (1, "Failed to connect to bus")})
    want = cache_want()
    result = enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail == "drop-ins written, but `systemctl daemon-reload` failed (exit 1): Failed to connect to bus"


def test_triton_in_sync_without_services_needs_no_reload(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path))
    ctx.paths.path("/var/cache/triton").mkdir(mode=0o700)
    want = cache_want(units=())
    done = triton_cache.ITEM.plan(ctx, want)
    assert done.plan.changes == ("chmod 0755 /var/cache/triton",)
    assert enforce(triton_cache.ITEM, ctx, want, done).outcome is ApplyOutcome.APPLIED
    assert stat.S_IMODE(ctx.paths.path("/var/cache/triton").stat().st_mode) == 0o755
    assert ctx.calls == []
    assert triton_cache.ITEM.plan(ctx, want).plan == ItemPlan(
        "triton_cache", None, PlanStatus.IN_SYNC, done.plan.desired, f"/var/cache/triton {':'.join(me())} 0755"
    )


def test_triton_outdated_dropin_is_rewritten(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.path("/var/cache/triton").mkdir(mode=0o755)
    ctx.paths.write_file_atomic(DROPIN, "[Service]\nEnvironment=TRITON_CACHE_DIR=/old\n")
    want = cache_want()
    done = triton_cache.ITEM.plan(ctx, want)
    assert done.plan.changes == (f"write {DROPIN}", "run: systemctl daemon-reload")
    assert "drop-in outdated for sglang.service" in done.plan.actual
    enforce(triton_cache.ITEM, ctx, want, done)
    assert "TRITON_CACHE_DIR=/var/cache/triton" in ctx.paths.read_text(DROPIN)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_triton_wrong_owner_is_fixed_as_root(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    cache = ctx.paths.path("/var/cache/triton")
    cache.mkdir(mode=0o755)
    os.chown(cache, 12345, 12345)
    user, group = me()
    want = cache_want(units=())
    done = triton_cache.ITEM.plan(ctx, want)
    assert done.plan.actual == "/var/cache/triton 12345:12345 0755"
    assert done.plan.changes == (f"chown {user}:{group} /var/cache/triton",)
    assert enforce(triton_cache.ITEM, ctx, want, done).outcome is ApplyOutcome.APPLIED
    assert (cache.stat().st_uid, cache.stat().st_gid) == (os.geteuid(), os.getegid())
    assert triton_cache.ITEM.plan(ctx, want).plan.status is PlanStatus.IN_SYNC


@pytest.fixture
def reachable_root(tmp_path: Path) -> Iterator[Path]:
    """A tree root the unprivileged user can reach: pytest's tmp dirs are private to the one running it."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    root = Path(tempfile.mkdtemp(prefix="gpu-agent-test-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


@pytest.fixture
def users_cache(reachable_root: Path) -> tuple[HostPaths, Path, Identity]:
    """A host tree whose /var/cache/triton is 0700 and the unprivileged user's: (the tree, the
    cache directory, that user)."""
    paths = make_host_tree(reachable_root)
    cache = paths.path("/var/cache/triton")
    cache.mkdir(mode=0o700)
    who = unprivileged_identity()
    os.chown(cache, who.uid, who.gid)
    return paths, cache, who


def test_triton_unprivileged_skips_a_correct_chown_and_fixes_the_mode(
    users_cache: tuple[HostPaths, Path, Identity],
) -> None:
    paths, cache, who = users_cache
    want = TritonCacheWant("/var/cache/triton", who.user, who.group, 0o755, ())

    def enforce_as_user() -> tuple[ItemResult, ItemPlan]:
        ctx = HostContext(paths)
        result = enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))
        return result, triton_cache.ITEM.plan(ctx, want).plan

    result, after = run_unprivileged(enforce_as_user)
    assert result.outcome is ApplyOutcome.APPLIED, result.detail
    assert result.detail == "chmod 0755 /var/cache/triton"
    assert after.status is PlanStatus.IN_SYNC
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755


def test_triton_unprivileged_wrong_owner_fails_clearly_and_changes_nothing(
    users_cache: tuple[HostPaths, Path, Identity],
) -> None:
    paths, cache, who = users_cache
    want = TritonCacheWant("/var/cache/triton", "root", grp.getgrgid(0).gr_name, 0o755, ())

    def enforce_as_user() -> ItemResult:
        ctx = HostContext(paths)
        return enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))

    result = run_unprivileged(enforce_as_user)
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail == (
        f"cannot give /var/cache/triton to root:{grp.getgrgid(0).gr_name}: gpu-agent is not running as root "
        f"(now: /var/cache/triton {who.user}:{who.group} 0700)"
    )
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.parametrize(("field", "name"), [("owner", "no-such-user-gpu-agent"), ("group", "no-such-group-gpu-agent")])
def test_triton_unknown_owner_or_group_is_an_error_naming_it(tmp_path: Path, field: str, name: str) -> None:
    done = triton_cache.ITEM.plan(host(tmp_path), cache_want(**{field: name}))  # type: ignore[arg-type]
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail == f"unknown {'user' if field == 'owner' else 'group'} {name!r}"


def test_triton_file_in_the_way_is_an_error(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.path("/var/cache/triton").write_text("not a directory")
    done = triton_cache.ITEM.plan(ctx, cache_want())
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail == "/var/cache/triton exists and is not a directory"
    assert (
        enforce(triton_cache.ITEM, ctx, cache_want(), done).outcome is ApplyOutcome.SKIPPED
    )  # an ERROR plan writes nothing
    assert ctx.paths.path("/var/cache/triton").read_text() == "not a directory"


def test_triton_file_in_the_parent_path_is_an_error(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.path("/srv").write_text("")
    done = triton_cache.ITEM.plan(ctx, cache_want("/srv/triton"))
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail == "cannot inspect /srv/triton: Not a directory"


def test_triton_symlink_is_an_error_naming_its_target(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    (tmp_path / "nvme").mkdir()
    ctx.paths.path("/var/cache/triton").symlink_to(tmp_path / "nvme")
    done = triton_cache.ITEM.plan(ctx, cache_want())
    assert done.plan.status is PlanStatus.ERROR
    assert (
        done.plan.detail
        == f"/var/cache/triton is a symlink to {tmp_path / 'nvme'}; set triton_cache.path to the real directory"
    )


def test_triton_invalid_unit_name_is_an_error(tmp_path: Path) -> None:
    done = triton_cache.ITEM.plan(host(tmp_path), cache_want(units=("../../evil",)))
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail == "'../../evil' is not a systemd unit name"


def test_triton_dropped_service_loses_its_stale_dropin(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = cache_want(units=("sglang.service", "vllm.service"))
    enforce(triton_cache.ITEM, ctx, want, triton_cache.ITEM.plan(ctx, want))
    own = "/etc/systemd/system/vllm.service.d/override.conf"
    ctx.paths.write_file_atomic(own, "[Service]\nNice=5\n")
    ctx.paths.write_file_atomic("/etc/systemd/system/old.service.d/gpu-agent-triton.conf", "[Service]\n")

    narrower = cache_want(units=("sglang.service",))
    done = triton_cache.ITEM.plan(ctx, narrower)
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.changes == (
        "remove /etc/systemd/system/old.service.d/gpu-agent-triton.conf",
        "remove /etc/systemd/system/vllm.service.d/gpu-agent-triton.conf",
        "run: systemctl daemon-reload",
    )
    assert "stale drop-in for old.service; stale drop-in for vllm.service" in done.plan.actual
    result = enforce(triton_cache.ITEM, ctx, narrower, done)
    assert result.outcome is ApplyOutcome.APPLIED
    assert "restart old.service, vllm.service" in result.detail
    assert not ctx.paths.exists("/etc/systemd/system/old.service.d")  # emptied, so removed
    assert not ctx.paths.exists("/etc/systemd/system/vllm.service.d/gpu-agent-triton.conf")
    assert ctx.paths.read_text(own) == "[Service]\nNice=5\n"  # the operator's drop-in stays
    assert ctx.paths.exists(DROPIN)
    assert triton_cache.ITEM.plan(ctx, narrower).plan.status is PlanStatus.IN_SYNC


def test_triton_write_failure_is_reported_not_raised(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = cache_want()
    done = triton_cache.ITEM.plan(ctx, want)
    assert done.plan.status is PlanStatus.DRIFT
    # Something takes the drop-in's place between plan and apply.
    ctx.paths.path(DROPIN).mkdir(parents=True)
    result = enforce(triton_cache.ITEM, ctx, want, done)
    assert result.outcome is ApplyOutcome.FAILED
    # apply writes what the plan said, without looking again: the write itself fails, and says why.
    assert result.detail.startswith("cannot apply: [Errno 21] Is a directory")


def test_triton_unwritable_dropin_fails_with_the_reason(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    want = cache_want()
    done = triton_cache.ITEM.plan(ctx, want)
    # A directory at the atomic write's rename target: the write itself raises.
    ctx.paths.path("/etc/systemd/system/sglang.service.d").mkdir()
    ctx.paths.path("/etc/systemd/system/sglang.service.d/.gpu-agent-triton.conf.gpu-agent.tmp").mkdir()
    result = enforce(triton_cache.ITEM, ctx, want, done)
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail.startswith("cannot apply: [Errno 21] Is a directory")


# -- nouveau ------------------------------------------------------------------------------------

CONF = "/etc/modprobe.d/gpu-agent-nouveau.conf"


def test_nouveau_desired() -> None:
    assert nouveau.ITEM.name == "nouveau"
    assert nouveau.ITEM.desired(NodePolicy(), CONFIG) is None
    assert nouveau.ITEM.desired(NodePolicy(nouveau="blacklisted"), CONFIG) == "blacklisted"


@pytest.mark.parametrize(
    ("os_release", "command"),
    [
        ("ubuntu", "update-initramfs -u"),
        ("rocky", "dracut -f"),
        ("ID=debian\n", "update-initramfs -u"),
        ('ID=almalinux\nID_LIKE="rhel centos fedora"\n', "dracut -f"),
    ],
)
def test_nouveau_missing_blacklist_is_drift_with_the_distro_initramfs_command(
    tmp_path: Path, os_release: str, command: str
) -> None:
    done = nouveau.ITEM.plan(host(tmp_path, os_release=os_release), "blacklisted")
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.gpu is None
    assert done.plan.desired == "blacklisted, not loaded"
    assert done.plan.actual == "not blacklisted, not loaded"
    assert done.plan.changes == (f"write {CONF}", f"run: {command}")


@pytest.mark.parametrize(("os_release", "command"), [("ubuntu", "update-initramfs -u"), ("rocky", "dracut -f")])
def test_nouveau_apply_writes_the_file_and_plans_but_never_runs_the_rebuild(
    tmp_path: Path, os_release: str, command: str
) -> None:
    ctx = host(tmp_path, os_release=os_release)
    result = enforce(nouveau.ITEM, ctx, "blacklisted", nouveau.ITEM.plan(ctx, "blacklisted"))
    assert result.outcome is ApplyOutcome.APPLIED
    assert result.detail == f"wrote {CONF}; initramfs not rebuilt (not run: host_root is {tmp_path}); run `{command}`"
    content = ctx.paths.read_text(CONF)
    assert content.startswith("# Managed by gpu-agent")
    assert content.endswith("blacklist nouveau\noptions nouveau modeset=0\n")
    again = nouveau.ITEM.plan(ctx, "blacklisted")
    assert again.plan.status is PlanStatus.IN_SYNC
    assert again.plan.actual == f"blacklisted ({CONF}), not loaded"
    assert enforce(nouveau.ITEM, ctx, "blacklisted", again).outcome is ApplyOutcome.UNCHANGED


def test_nouveau_unknown_distribution_asks_for_a_manual_rebuild(tmp_path: Path) -> None:
    ctx = host(tmp_path, os_release="ID=arch\n")
    done = nouveau.ITEM.plan(ctx, "blacklisted")
    assert done.plan.changes == (f"write {CONF}",)
    assert done.plan.detail == "unknown distribution (arch): rebuild the initramfs by hand after apply"
    result = enforce(nouveau.ITEM, ctx, "blacklisted", done)
    assert result.outcome is ApplyOutcome.APPLIED
    assert result.detail == f"wrote {CONF}; unknown distribution (arch): rebuild the initramfs by hand"
    assert (
        "unknown distribution (unknown)"
        in nouveau.ITEM.plan(host(tmp_path / "bare", os_release=None), "blacklisted").plan.detail
    )


def test_nouveau_loaded_needs_a_reboot_after_apply(tmp_path: Path) -> None:
    ctx = host(tmp_path, nouveau_loaded=True)
    done = nouveau.ITEM.plan(ctx, "blacklisted")
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.actual == "not blacklisted, loaded"
    assert "nouveau is loaded; reboot to unload it" in done.plan.detail
    result = enforce(nouveau.ITEM, ctx, "blacklisted", done)
    assert result.outcome is ApplyOutcome.REBOOT_REQUIRED
    assert result.detail.endswith("nouveau is loaded; reboot to unload it")
    after = nouveau.ITEM.plan(ctx, "blacklisted")
    assert after.plan.status is PlanStatus.REBOOT_REQUIRED
    assert after.plan.detail == "nouveau is loaded; reboot to unload it"
    assert after.plan.changes == ()
    assert enforce(nouveau.ITEM, ctx, "blacklisted", after).outcome is ApplyOutcome.REBOOT_REQUIRED


def test_nouveau_loaded_seen_through_sys_module_alone(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.write_file_atomic(CONF, nouveau.CONF_CONTENT)
    ctx.paths.path("/sys/module/nouveau").mkdir()
    assert nouveau.ITEM.plan(ctx, "blacklisted").plan.status is PlanStatus.REBOOT_REQUIRED


def nouveau_verdict(tmp_path: Path, modprobe_files: dict[str, str]) -> tuple[PlanStatus, str]:
    """The nouveau item's plan status and what it found, on a host whose modprobe configuration is
    `modprobe_files` (path: text)."""
    ctx = host(tmp_path)
    for path, text in modprobe_files.items():
        ctx.paths.write_file_atomic(path, text)
    plan = nouveau.ITEM.plan(ctx, "blacklisted").plan
    return plan.status, plan.actual


FULL_BLACKLIST = "blacklist nouveau\noptions nouveau modeset=0\n"


def test_nouveau_blacklist_from_another_file_or_directory_counts(tmp_path: Path) -> None:
    vendor = "/usr/lib/modprobe.d/nvidia-installer-disable-nouveau.conf"
    verdict = nouveau_verdict(tmp_path, {vendor: "# generated by nvidia-installer\n" + FULL_BLACKLIST})
    assert verdict == (PlanStatus.IN_SYNC, f"blacklisted ({vendor}), not loaded")


def test_nouveau_etc_file_hides_the_vendor_file_of_the_same_name(tmp_path: Path) -> None:
    operator = "# emptied by the operator\n"
    modprobe_files = {"/usr/lib/modprobe.d/nouveau.conf": FULL_BLACKLIST, "/etc/modprobe.d/nouveau.conf": operator}
    status, _ = nouveau_verdict(tmp_path, modprobe_files)
    assert status is PlanStatus.DRIFT


@pytest.mark.parametrize(
    ("content", "actual"),
    [
        ("blacklist nouveau\n", "blacklisted without modeset=0"),
        ("options nouveau modeset=0\n", "modeset=0 but not blacklisted"),
        ("# blacklist nouveau\n#options nouveau modeset=0\n", "not blacklisted"),
        ("blacklist nouveau\noptions nouveau modeset=1\n", "blacklisted without modeset=0"),
    ],
)
def test_nouveau_half_a_blacklist_is_drift(tmp_path: Path, content: str, actual: str) -> None:
    verdict = nouveau_verdict(tmp_path, {"/etc/modprobe.d/local.conf": content})
    assert verdict == (PlanStatus.DRIFT, f"{actual}, not loaded")


def test_nouveau_split_across_files_is_in_sync(tmp_path: Path) -> None:
    split = {
        "/etc/modprobe.d/a.conf": "blacklist nouveau\n",
        "/etc/modprobe.d/b.conf": "options nouveau modeset=0 NVreg_x=1\n",
    }
    verdict = nouveau_verdict(tmp_path, split)
    assert verdict == (PlanStatus.IN_SYNC, "blacklisted (/etc/modprobe.d/a.conf, /etc/modprobe.d/b.conf), not loaded")


def test_nouveau_rebuild_runs_through_the_host_context(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path, os_release="rocky"))
    result = enforce(nouveau.ITEM, ctx, "blacklisted", nouveau.ITEM.plan(ctx, "blacklisted"))
    assert ctx.calls == [("dracut", "-f")]
    assert result.outcome is ApplyOutcome.APPLIED
    assert result.detail == f"wrote {CONF}; initramfs rebuilt (`dracut -f`)"


def test_nouveau_failing_rebuild_fails_with_its_output(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(
        make_host_tree(tmp_path), results={"update-initramfs": (1, "E: /boot: No space left on device")}
    )
    result = enforce(nouveau.ITEM, ctx, "blacklisted", nouveau.ITEM.plan(ctx, "blacklisted"))
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail == f"wrote {CONF}; `update-initramfs -u` failed (exit 1): E: /boot: No space left on device"


def test_nouveau_missing_rebuild_tool_fails(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path, os_release="rocky"), missing=frozenset({"dracut"}))
    result = enforce(nouveau.ITEM, ctx, "blacklisted", nouveau.ITEM.plan(ctx, "blacklisted"))
    assert result.outcome is ApplyOutcome.FAILED
    assert "`dracut -f` could not run: [Errno 2] No such file or directory" in result.detail


def test_nouveau_write_failure_is_reported_not_raised(tmp_path: Path) -> None:
    ctx = ScriptedHostContext(make_host_tree(tmp_path))
    ctx.paths.path(CONF).mkdir()  # modprobe ignores a directory, and the write cannot replace it
    done = nouveau.ITEM.plan(ctx, "blacklisted")
    assert done.plan.status is PlanStatus.DRIFT
    result = enforce(nouveau.ITEM, ctx, "blacklisted", done)
    assert result.outcome is ApplyOutcome.FAILED
    assert result.detail.startswith(f"cannot write {CONF}: [Errno 21] Is a directory")
    assert ctx.calls == []  # no rebuild without the file


def test_nouveau_dangling_links_are_skipped_like_modprobe_does(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.path("/etc/modprobe.d/broken.conf").symlink_to(tmp_path / "nowhere")
    ctx.paths.write_file_atomic("/etc/modprobe.d/latin1.conf", "")
    ctx.paths.path("/etc/modprobe.d/latin1.conf").write_bytes(b"# Jos\xe9's box\nblacklist nouveau\n")
    done = nouveau.ITEM.plan(ctx, "blacklisted")
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.actual == "blacklisted without modeset=0, not loaded"


def test_nouveau_unreadable_module_list_is_an_error(tmp_path: Path) -> None:
    ctx = host(tmp_path)
    ctx.paths.path("/proc/modules").unlink()
    ctx.paths.path("/proc/modules").mkdir()
    done = nouveau.ITEM.plan(ctx, "blacklisted")
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.detail.startswith("cannot read: [Errno 21] Is a directory")
    assert (
        enforce(nouveau.ITEM, ctx, "blacklisted", done).outcome is ApplyOutcome.SKIPPED
    )  # an ERROR plan writes nothing
    assert not ctx.paths.exists(CONF)


def test_a_host_command_runs_scrubbed_bounded_and_within_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against `/` with a harmless stand-in (the test's own Python): the daemon's environment does
    not reach the command, its output is a tail, and a command past the timeout is a result."""
    import sys

    monkeypatch.setenv("GPU_AGENT_TEST_SECRET", "hunter2")
    ctx = HostContext(HostPaths.at("/"), command_timeout_seconds=0.5)
    script = (
        "import os, sys\nsys.stdout.write('x' * 10000)\nprint(os.environ.get('GPU_AGENT_TEST_SECRET', 'scrubbed'))\n"
    )
    done = ctx.run_command([sys.executable, "-c", script])
    assert (done.ran, done.returncode, done.ended) == (True, 0, "exit 0")
    assert done.output.endswith("xxscrubbed") and "bytes cut]" in done.output
    hung = ctx.run_command([sys.executable, "-c", "import time\nprint('rebuilding', flush=True)\ntime.sleep(60)"])
    assert (hung.ran, hung.returncode, hung.ended, hung.output) == (True, None, "timed out", "rebuilding")


def test_initramfs_rebuild_leaves_the_service_sandbox_under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the hardened unit /boot is read-only: the rebuild runs as a transient unit of its own."""
    from agent.host.processes import ProcessResult
    from agent.policy.base import HostContext

    ran: list[list[str]] = []

    def fake_run(argv: list[str], _timeout_seconds: float) -> ProcessResult:
        ran.append(list(argv))
        return ProcessResult(tuple(argv), 0, "", 0.0)

    monkeypatch.setattr("agent.policy.base.run_process", fake_run)
    monkeypatch.setattr("agent.policy.base.shutil.which", lambda name: f"/usr/bin/{name}")
    ctx = HostContext(HostPaths.at("/"))
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    ctx.run_command(["update-initramfs", "-u"], outside_sandbox=True)
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    ctx.run_command(["update-initramfs", "-u"], outside_sandbox=True)
    ctx.run_command(["systemctl", "daemon-reload"])
    assert ran == [
        ["update-initramfs", "-u"],
        ["systemd-run", "--wait", "--pipe", "--collect", "--quiet", "--", "update-initramfs", "-u"],
        ["systemctl", "daemon-reload"],
    ]
