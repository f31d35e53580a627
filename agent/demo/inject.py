"""`gpu-agent inject`: faults for a simulated node, visible to a daemon running on it.

The simulated backend keeps its state in `state_dir`, and the fake kernel log lives under
`host_root/dev/kmsg`, so a fault injected here reaches a running `gpu-agent run` (or the demo)
on its next loop. Refused for any other backend: this never touches real hardware.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.backend.base import CLOCK_EVENT_REASONS, RecoveryAction
from agent.backend.errors import GpuErrorKind
from agent.host.paths import HostPaths

if TYPE_CHECKING:  # imported when a fault is injected, not to build `gpu-agent --help`
    from agent.backend.sim import SimulatedBackend
    from agent.config import AgentConfig

REASON_BITS = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
MAX_UNCORRECTED_EVENTS = 10_000  # each is queued as its own NVML event
MAX_PID = 4_194_304  # Linux's PID_MAX_LIMIT on 64-bit: no process has a larger pid


class InjectError(Exception):
    pass


def _pid(text: str) -> int:
    """An argparse type: a pid a process can have (else exit 2, argparse's usage error)."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_PID:
        raise argparse.ArgumentTypeError(f"{text!r}: a pid is a whole number from 1 to {MAX_PID}")
    return int(text)


@dataclass(frozen=True)
class Node:
    sim: SimulatedBackend
    paths: HostPaths
    profile: str


def _xid(node: Node, args: argparse.Namespace) -> str:
    from agent.backend.sim.faults import check_xid
    from agent.watch.fake_kernel_log import append_kmsg, xid_line

    check_xid(args.code)
    if args.source in ("nvml", "both"):
        node.sim.inject_xid(args.gpu, args.code)
    if args.source in ("kmsg", "both"):
        bus_id = node.sim.identity(args.gpu).pci_bus_id
        append_kmsg(node.paths, xid_line(bus_id, args.code, pid=args.pid, process=args.process))
    return f"Xid {args.code} on GPU {args.gpu} via {args.source}"


def _throttle(node: Node, args: argparse.Namespace) -> str:
    if args.clear:
        node.sim.set_clock_event_reasons(args.gpu, None)
        return f"clock-event reasons of GPU {args.gpu} back to what the load gives"
    mask = 0
    for reason in args.reason:
        mask |= REASON_BITS[reason]
    node.sim.set_clock_event_reasons(args.gpu, mask)
    return f"GPU {args.gpu} clocks held by {', '.join(args.reason)}"


def _temperature(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_temperature(args.gpu, None if args.clear else args.celsius)
    return f"GPU {args.gpu} temperature " + ("derived again" if args.clear else f"{args.celsius} C")


def _lost(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_lost(args.gpu, not args.clear)
    return f"GPU {args.gpu} " + ("back on the bus" if args.clear else "fell off the bus")


def _reset_required(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_reset_required(args.gpu, not args.clear)
    return f"GPU {args.gpu} " + ("no longer needs a reset" if args.clear else "needs a reset")


def _ecc(node: Node, args: argparse.Namespace) -> str:
    if not 0 <= args.uncorrected <= MAX_UNCORRECTED_EVENTS:
        raise InjectError(f"--uncorrected takes 0-{MAX_UNCORRECTED_EVENTS}: each one is an NVML event")
    node.sim.add_ecc_errors(args.gpu, corrected=args.corrected)
    for _ in range(args.uncorrected):  # each uncorrected error also raises an NVML double-bit event
        node.sim.inject_ecc_event(args.gpu, uncorrected=True)
    return f"GPU {args.gpu}: +{args.corrected} corrected, +{args.uncorrected} uncorrected ECC errors"


def _remap(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_remapped_rows(args.gpu, uncorrectable=0 if args.clear else 1, pending=args.pending, failed=args.failed)
    return f"GPU {args.gpu} row remapping: pending={args.pending} failed={args.failed}"


def _pcie(node: Node, args: argparse.Namespace) -> str:
    link = node.sim.pcie_link(args.gpu)
    if args.clear:
        generation, width = link.max_generation, link.max_width
    else:  # an option not given keeps the link's current value (0 is a value, and refused)
        generation = link.current_generation if args.generation is None else args.generation
        width = link.current_width if args.width is None else args.width
    node.sim.set_pcie_link(args.gpu, generation, width)
    return f"GPU {args.gpu} PCIe link gen{generation} x{width}"


def _drift(node: Node, args: argparse.Namespace) -> str:
    # Someone else (an operator, another tool) changes a setting behind the agent's back.
    from agent.backend.sim import SimulatedBackend
    from agent.config import GPU_ITEMS

    operator = SimulatedBackend(
        node.profile, node.sim.state_dir, writable_items=GPU_ITEMS, counter_clock=time.monotonic
    )
    operator.init()
    try:
        operator.set_power_limit_watts(args.gpu, args.power_limit_watts)
    finally:
        operator.shutdown()
    return f"GPU {args.gpu} power limit changed to {args.power_limit_watts:g} W behind the agent's back"


def _hang(node: Node, args: argparse.Namespace) -> str:
    node.sim.hang_call(args.gpu, args.call, None if args.clear else args.seconds)
    return f"GPU {args.gpu} {args.call} " + ("answers again" if args.clear else f"hangs {args.seconds:g} s per call")


def _fail(node: Node, args: argparse.Namespace) -> str:
    node.sim.fail_call(args.gpu, args.call, None if args.clear else GpuErrorKind(args.kind))
    return f"GPU {args.gpu} {args.call} " + ("works again" if args.clear else f"fails with {args.kind}")


def _processes(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_processes(args.gpu, args.pids)
    return f"GPU {args.gpu} processes: {args.pids or 'none'}"


def _recovery_action(node: Node, args: argparse.Namespace) -> str:
    node.sim.set_recovery_action(args.gpu, RecoveryAction[args.action.upper()])
    return f"GPU {args.gpu} recovery action {args.action}"


def _reboot(node: Node, _args: argparse.Namespace) -> str:
    node.sim.reboot()
    return "simulated node rebooted: pending modes applied, settings and faults cleared"


FAULTS: dict[str, tuple[str, Callable[[Node, argparse.Namespace], str]]] = {
    "xid": ("an Xid via NVML events and/or the kernel log", _xid),
    "throttle": ("hold clock-event reasons (thermal, power brake, ...)", _throttle),
    "temperature": ("set the GPU temperature", _temperature),
    "lost": ("the GPU falls off the bus", _lost),
    "reset-required": ("the GPU needs a reset", _reset_required),
    "ecc": ("add ECC errors", _ecc),
    "remap": ("row remapping pending / failed", _remap),
    "pcie": ("degrade the PCIe link", _pcie),
    "drift": ("change the power limit behind the agent's back", _drift),
    "hang": ("make an NVML call hang", _hang),
    "fail": ("make an NVML call fail with an NVML error", _fail),
    "processes": ("set the processes using the GPU", _processes),
    "recovery-action": ("set the driver's GPU recovery action", _recovery_action),
    "reboot": ("reboot the simulated node", _reboot),
}


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    inject = sub.add_parser("inject", help="inject a fault into a simulated node (and a running daemon on it)")
    faults = inject.add_subparsers(dest="fault", required=True, metavar="FAULT")
    for name, (text, _) in FAULTS.items():
        p = faults.add_parser(name, parents=[common], help=text)
        if name != "reboot":
            p.add_argument("--gpu", type=int, required=True, help="GPU index")
        if name in ("throttle", "temperature", "lost", "reset-required", "remap", "pcie", "hang", "fail"):
            p.add_argument("--clear", action="store_true", help="end the fault")
        if name == "xid":
            p.add_argument("code", type=int)
            p.add_argument("--source", choices=["nvml", "kmsg", "both"], default="both")
            p.add_argument("--pid", type=_pid, help="the faulting process the kernel line names")
            p.add_argument("--process")
        elif name == "throttle":
            p.add_argument("--reason", action="append", choices=sorted(REASON_BITS), default=[])
        elif name == "temperature":
            p.add_argument("--celsius", type=int, help="the temperature to read (required unless --clear)")
        elif name == "ecc":
            p.add_argument("--corrected", type=int, default=0)
            p.add_argument("--uncorrected", type=int, default=0)
        elif name == "remap":
            p.add_argument("--pending", action="store_true")
            p.add_argument("--failed", action="store_true")
        elif name == "pcie":
            p.add_argument("--generation", type=int)
            p.add_argument("--width", type=int)
        elif name == "drift":
            p.add_argument("--power-limit-watts", type=float, required=True)
        elif name in ("hang", "fail"):
            p.add_argument("--call", required=True, help="a backend method, e.g. temperature_celsius")
            if name == "hang":
                p.add_argument("--seconds", type=float, default=30.0)
            else:
                p.add_argument("--kind", choices=[k.value for k in GpuErrorKind], default="unknown")
        elif name == "processes":
            p.add_argument("pids", type=_pid, nargs="*")
        elif name == "recovery-action":
            p.add_argument("action", choices=[a.name.lower() for a in RecoveryAction])


def inject(config: AgentConfig, args: argparse.Namespace) -> str:
    from agent.backend.sim import SimulatedBackend

    if config.backend != "simulated":
        raise InjectError("inject only works on a simulated node (backend: simulated); it never touches a real GPU")
    if args.fault == "throttle" and not args.clear and not args.reason:
        raise InjectError("give at least one --reason, or --clear")
    if args.fault == "temperature" and not args.clear and args.celsius is None:
        raise InjectError("give the temperature with --celsius C, or --clear")
    sim = SimulatedBackend(config.simulated.profile, Path(config.state_dir), counter_clock=time.monotonic)
    sim.init()
    try:
        gpu = getattr(args, "gpu", 0)
        if not 0 <= gpu < sim.device_count():
            raise InjectError(f"no GPU {gpu}: the node has GPUs 0-{sim.device_count() - 1}")
        node = Node(sim, HostPaths.at(config.host_root), config.simulated.profile)
        return FAULTS[args.fault][1](node, args)
    finally:
        sim.shutdown()
