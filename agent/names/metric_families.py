"""The named families of `/metrics`, what each holds and whether a default scrape shows it.

Every series the agent exports belongs to one family, and `metrics.families` in agent.yaml switches
families on and off by these names (as dcgm-exporter's counters file and node_exporter's collector
flags do). A family that is off still shows its notable series: a counter or flag once it is not 0,
a link that is down, a state that is not the normal one. So what does not fit the default is one
switch away and nothing that happens is hidden. docs/metrics.md lists the series each family adds
on an 8-GPU node.

Pure data: the config validates `metrics.families` against these names without the exporter, and
tests/readings/test_reading_table.py holds the reading table's family names to this list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class FamilyInfo:
    default_on: bool
    what: str


_FAMILIES: dict[str, FamilyInfo] = {
    # -- GPU readings (agent/readings/table.py) ---------------------------------------------------
    "temperature": FamilyInfo(True, "GPU and HBM temperature"),
    "temperature_thresholds": FamilyInfo(False, "the slowdown, shutdown and HBM temperature thresholds"),
    "power": FamilyInfo(True, "board power draw, the power limit in force and the energy counter"),
    "power_instant": FamilyInfo(False, "board power draw right now (not averaged)"),
    "clocks": FamilyInfo(True, "SM and memory clocks"),
    "clock_details": FamilyInfo(False, "graphics clock, performance state, maximum and applications clocks"),
    "utilization": FamilyInfo(True, "GPU and memory utilization"),
    "memory": FamilyInfo(True, "device memory used, free, reserved and installed"),
    "modes": FamilyInfo(False, "persistence, ECC and MIG modes (now and pending)"),
    "ecc": FamilyInfo(
        False, "ECC errors over the GPU's lifetime (aggregate) and since the driver loaded; non-zero ones always"
    ),
    "row_remap": FamilyInfo(False, "rows remapped, remap pending or failed, page retirement; non-zero ones always"),
    "pcie_link": FamilyInfo(False, "PCIe link generation and width, now and at most"),
    "pcie_errors": FamilyInfo(False, "PCIe replays and correctable and fatal errors; non-zero ones always"),
    "fans": FamilyInfo(True, "fan speeds (boards with fans)"),
    "clock_events": FamilyInfo(
        False, "clock-event reasons active and the time each held the clocks back; active and non-zero ones always"
    ),
    "recovery": FamilyInfo(False, "the driver's recovery action, one series per action; any but none always"),
    "activity": FamilyInfo(True, "GPM graphics, SM, tensor and DRAM activity and SM occupancy"),
    "throughput": FamilyInfo(True, "GPM PCIe and NVLink traffic"),
    "nvlink": FamilyInfo(False, "NVLink error counters per GPU (all links added up); non-zero ones always"),
    "nvlink_links": FamilyInfo(False, "NVLink state and error counters per link; a link with errors or down always"),
    "fabric": FamilyInfo(False, "NVSwitch fabric registration; an unfinished or failed one always"),
    # -- the agent's own families (agent/metrics/) -------------------------------------------------
    "gpu": FamilyInfo(True, "GPU identity, up, health verdict and its cause, failed readings"),
    "faults": FamilyInfo(
        False,
        "open faults per GPU and cause, throttling by reason, PCIe degraded, stale readings; the open ones always",
    ),
    "xid": FamilyInfo(True, "Xid errors per GPU and per code, when each code was last seen, the catalog's class"),
    "node": FamilyInfo(
        True, "the agent and node: build, host name, backend, node problems, attention, reboot, readiness"
    ),
    "collectors": FamilyInfo(True, "each collector's last run: success and duration"),
    "policy": FamilyInfo(True, "policy items: enforced or observed, targets per plan status"),
    "policy_detail": FamilyInfo(
        False, "each policy item per GPU: in sync, drift, plan status; drift and failures always"
    ),
    "remediation": FamilyInfo(True, "remediation decisions per rule, action and outcome"),
    "services": FamilyInfo(
        True,
        "inference services: probe, the server's gauges, generated tokens and GPU energy counters, GPU memory",
    ),
    "service_latency": FamilyInfo(True, "request duration histograms, end to end and to the first token"),
    "service_latency_detail": FamilyInfo(False, "request duration histograms between tokens and in the queue"),
    "service_latency_quantiles": FamilyInfo(
        False, "p50/p95/p99 over the agent's 5-minute window (what `gpu-agent status` shows)"
    ),
    "tune": FamilyInfo(
        True, "the last measured gpu-agent tune sweep of each service and kind: its steps and recommendation"
    ),
}

FAMILIES: Mapping[str, FamilyInfo] = MappingProxyType(_FAMILIES)
FAMILY_NAMES: tuple[str, ...] = tuple(_FAMILIES)


@dataclass(frozen=True)
class FamilySwitches:
    """Which families a scrape shows whole: the defaults, with `metrics.families` applied."""

    on: frozenset[str]

    @classmethod
    def of(cls, overrides: Mapping[str, bool] | None = None) -> FamilySwitches:
        """The defaults with `overrides` (name -> on) applied; an unknown name is a KeyError."""
        states = {name: info.default_on for name, info in _FAMILIES.items()}
        for name, on in (overrides or {}).items():
            if name not in states:
                raise KeyError(f"unknown metrics family {name!r}")
            states[name] = on
        return cls(frozenset(name for name, on in states.items() if on))

    @classmethod
    def everything(cls) -> FamilySwitches:
        return cls(frozenset(_FAMILIES))

    def shows(self, family: str) -> bool:
        return family in self.on


DEFAULT_SWITCHES = FamilySwitches.of()
