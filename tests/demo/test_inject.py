"""`gpu-agent inject`: every fault reaches the simulated node (and so a daemon running on it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hosttree import make_host_tree

from agent.backend.base import ClockDomain, EccCounter, EccErrorType, RecoveryAction
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim import SimulatedBackend
from agent.watch.kernel_log import KernelLogParser, parse_kmsg_record


@pytest.fixture
def node(tmp_path: Path) -> Path:
    make_host_tree(tmp_path / "host", kernel_sysfs=False)
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"backend: simulated\nsimulated: {{profile: mixed}}\nhost_root: {tmp_path / 'host'}\nstate_dir: {tmp_path / 'state'}\n"
    )
    return config


def inject(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "inject", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def sim(config: Path) -> SimulatedBackend:
    backend = SimulatedBackend("mixed", config.parent / "state")
    backend.init()
    return backend


def ok(config: Path, *args: str) -> str:
    result = inject(config, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_xid_goes_to_nvml_events_and_the_kernel_log(node: Path) -> None:
    assert "Xid 13 on GPU 2 via both" in ok(node, "xid", "13", "--gpu", "2", "--pid", "4242", "--process", "python3")
    events = sim(node).wait_events(0.1)
    assert [(e.gpu, e.data) for e in events] == [(2, 13)]
    record = (node.parent / "host/dev/kmsg").read_bytes().splitlines()[-1]
    parsed = parse_kmsg_record(record)
    assert parsed is not None
    [xid] = KernelLogParser().feed(parsed[2])
    assert (xid.xid, xid.pci_bus_id, xid.pid, xid.process) == (13, sim(node).identity(2).pci_bus_id, 4242, "python3")


def test_state_faults(node: Path) -> None:
    ok(node, "throttle", "--gpu", "0", "--reason", "hw_thermal_slowdown", "--reason", "sw_thermal_slowdown")
    assert sim(node).clock_event_reasons(0) == 0x40 | 0x20
    ok(node, "throttle", "--gpu", "0", "--clear")
    assert sim(node).clock_event_reasons(0) == 0x1
    ok(node, "temperature", "--gpu", "1", "--celsius", "91")
    assert sim(node).temperature_celsius(1) == 91
    ok(node, "ecc", "--gpu", "1", "--uncorrected", "2", "--corrected", "5")
    assert sim(node).ecc_errors(1, EccErrorType.UNCORRECTED, EccCounter.VOLATILE) == 2
    ok(node, "remap", "--gpu", "1", "--pending")
    assert sim(node).remapped_rows(1).pending
    ok(node, "pcie", "--gpu", "3", "--width", "8")
    assert sim(node).pcie_link(3).current_width == 8
    ok(node, "pcie", "--gpu", "3", "--clear")
    assert sim(node).pcie_link(3).current_width == 16
    ok(node, "processes", "--gpu", "0", "111", "222")
    assert [p.pid for p in sim(node).compute_processes(0)] == [111, 222]
    ok(node, "recovery-action", "--gpu", "0", "node_reboot")
    assert sim(node).recovery_action(0) == RecoveryAction.NODE_REBOOT
    ok(node, "drift", "--gpu", "4", "--power-limit-watts", "400")
    assert sim(node).power_limit_watts(4) == 400.0
    ok(node, "fail", "--gpu", "5", "--call", "power_usage_watts", "--kind", "no_permission")
    with pytest.raises(GpuError) as info:
        sim(node).power_usage_watts(5)
    assert info.value.kind is GpuErrorKind.NO_PERMISSION
    ok(node, "lost", "--gpu", "2")
    with pytest.raises(GpuError) as info:
        sim(node).temperature_celsius(2)
    assert info.value.kind is GpuErrorKind.GPU_LOST
    ok(node, "reboot")
    backend = sim(node)
    assert backend.temperature_celsius(2) > 0 and backend.power_limit_watts(4) == 600.0
    assert backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None


def test_bad_requests_are_clear_errors(node: Path, tmp_path: Path) -> None:
    result = inject(node, "lost", "--gpu", "9")
    assert result.returncode == 1 and "no GPU 9: the node has GPUs 0-5" in result.stderr
    result = inject(node, "throttle", "--gpu", "0")
    assert result.returncode == 1 and "--reason" in result.stderr
    result = inject(node, "hang", "--gpu", "0", "--call", "no_such_call")
    assert result.returncode == 1 and "not a GpuBackend method" in result.stderr
    real = tmp_path / "real.yaml"
    real.write_text("backend: nvml\n")
    result = inject(real, "lost", "--gpu", "0")
    assert result.returncode == 1 and "only works on a simulated node" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("xid", "0", "--gpu", "0"), "Xid 0 is not a code the driver reports"),
        (("xid", "-5", "--gpu", "0", "--source", "kmsg"), "Xid -5 is not a code the driver reports"),
        (("xid", "1000", "--gpu", "0"), "Xid 1000 is not a code the driver reports (1-999)"),
        (("temperature", "--gpu", "0", "--celsius", "-500"), "not a temperature NVML reports"),
        (("temperature", "--gpu", "0"), "give the temperature with --celsius C, or --clear"),
        (("ecc", "--gpu", "0", "--corrected", "-3"), "ECC error counters only grow"),
        (("ecc", "--gpu", "0", "--corrected", "9" * 23), "an ECC error counter holds at most 18446744073709551615"),
        (("ecc", "--gpu", "0", "--uncorrected", "-3"), "--uncorrected takes 0-10000"),
        (("ecc", "--gpu", "0", "--uncorrected", "99999999"), "--uncorrected takes 0-10000"),
        (("pcie", "--gpu", "0", "--width", "0"), "x0 is not a link this GPU can train to"),
        (("drift", "--gpu", "0", "--power-limit-watts", "nan"), "power limit nan W is outside the allowed range"),
        (("hang", "--gpu", "0", "--call", "temperature_celsius", "--seconds", "inf"), "a finite number of seconds"),
    ],
)
def test_a_state_no_gpu_could_be_in_is_refused(node: Path, args: tuple[str, ...], message: str) -> None:
    """The simulator stays faithful to NVML: nothing injected leaves it answering what a GPU cannot."""
    before = sim(node)
    readings = (before.temperature_celsius(0), before.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE))
    result = inject(node, *args)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    after = sim(node)
    assert (after.temperature_celsius(0), after.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE)) == readings
    assert after.pcie_link(0).current_width == 16 and after.power_limit_watts(0) == before.power_limit_watts(0)
    assert after.wait_events(0.05) == []
    assert not (node.parent / "host/dev/kmsg").exists() or b"Xid" not in (node.parent / "host/dev/kmsg").read_bytes()


def test_a_pcie_option_not_given_keeps_the_current_value(node: Path) -> None:
    ok(node, "pcie", "--gpu", "3", "--width", "8")
    assert "gen3 x8" in ok(node, "pcie", "--gpu", "3", "--generation", "3")
