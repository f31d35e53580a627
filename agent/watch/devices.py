"""GPUs appearing on or disappearing from the node, by polling, with udev as an early wake-up.

`DeviceWatcher` compares the GPUs of each loop with the previous loop's, by (UUID, PCI bus id): the
first loop is the baseline, a pair that appears is GPU_ADDED, one that goes is GPU_REMOVED (a board
that moved to another bus id is both). A GPU that is still enumerated but cannot name itself (fallen
off the bus) keeps the identity it had at that index: it is lost, which GpuLostWatcher reports, not
removed.

`UdevWakeup` listens for PCI uevents of NVIDIA devices (vendor 0x10de) and calls `on_change` so the
daemon can re-enumerate at once instead of at the next loop. It is only a shortcut: when udev is not
there (no /run/udev/control, as in containers and minimal hosts, or pyudev/libudev missing) it says
so and the daemon relies on polling alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.host.paths import HostPaths
from agent.logs import get_logger
from agent.state import GpuSample

log = get_logger()

UDEV_CONTROL = "/run/udev/control"  # the socket systemd-udevd listens on: present only where udevd runs
NVIDIA_PCI_VENDOR = "10DE"
#: uevent actions that change which GPUs the driver can see.
_UDEV_ACTIONS = frozenset({"add", "remove", "bind", "unbind", "change"})


@dataclass(frozen=True)
class _Gpu:
    uuid: str
    pci_bus_id: str
    index: int
    name: str


class DeviceWatcher:
    name = "devices"

    def __init__(self) -> None:
        self._present: dict[tuple[str, str], _Gpu] | None = None  # None until the baseline loop
        self._removed: dict[int, _Gpu] = {}

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        by_index = {gpu.index: gpu for gpu in (self._present or {}).values()}
        present: dict[tuple[str, str], _Gpu] = {}
        for sample in samples:
            if sample.uuid:
                gpu = _Gpu(sample.uuid, sample.pci_bus_id, sample.index, sample.name)
            elif sample.index in by_index:
                gpu = by_index[sample.index]
            else:
                continue  # enumerated but never identified: nothing to compare with yet
            present[(gpu.uuid, gpu.pci_bus_id)] = gpu
        previous, self._present = self._present, present
        if previous is None:
            return []
        events: list[Event] = []
        for key in previous.keys() - present.keys():
            gpu = previous[key]
            self._removed[gpu.index] = gpu
            events.append(self._event(EventKind.GPU_REMOVED, gpu, now_seconds))
        for key in present.keys() - previous.keys():
            events.append(self._event(EventKind.GPU_ADDED, present[key], now_seconds))
        for gpu in present.values():
            # The index answers again, with this board or another one renumbered into it.
            self._removed.pop(gpu.index, None)
        return sorted(events, key=lambda e: (e.kind is EventKind.GPU_ADDED, e.gpu))

    def present(self) -> list[tuple[str, str]]:
        """(uuid, pci_bus_id) of every GPU seen in the last loop."""
        return sorted(self._present or {})

    def health(self, gpu: int) -> Health:
        removed = self._removed.get(gpu)
        if removed is None:
            return Health.healthy()
        return Health(
            HealthState.UNHEALTHY,
            f"{removed.uuid} ({removed.pci_bus_id}) left the node",
            SuggestedAction.ALERT,
            (FaultCause.GPU_REMOVED,),
        )

    @staticmethod
    def _event(kind: EventKind, gpu: _Gpu, now_seconds: float) -> Event:
        added = kind is EventKind.GPU_ADDED
        return Event(
            kind=kind,
            # A GPU leaving takes serving capacity with it; whether it was maintenance is for a person.
            severity=Severity.INFO if added else Severity.CRITICAL,
            gpu=gpu.index,
            uuid=gpu.uuid,
            message=f"GPU {gpu.index} {gpu.name} {gpu.uuid} at {gpu.pci_bus_id} "
            + ("appeared" if added else "is no longer enumerated"),
            timestamp_seconds=now_seconds,
            source="poll",
            key=f"{kind.value}:{gpu.uuid}:{gpu.pci_bus_id}",
            data={"pci_bus_id": gpu.pci_bus_id, "name": gpu.name, "index": gpu.index},
            suggested_action=SuggestedAction.NONE if added else SuggestedAction.ALERT,
        )


def is_nvidia_pci_event(action: str | None, properties: Mapping[str, str]) -> bool:
    """A uevent worth re-enumerating for: an NVIDIA PCI function added, removed, (un)bound or changed.

    PCI_ID ("10DE:2335") comes with the uevent itself, so it is there for a removal too, when the
    device's sysfs attributes are already gone.
    """
    if action not in _UDEV_ACTIONS:
        return False
    return properties.get("PCI_ID", "").upper().startswith(NVIDIA_PCI_VENDOR + ":")


class UdevWakeup:
    """Calls `on_change` (from a background thread) when an NVIDIA PCI device changes.

    `available` and `reason` say whether udev can be used; `start()` returns whether it listens.
    """

    def __init__(self, on_change: Callable[[], None], paths: HostPaths | None = None) -> None:
        self.on_change = on_change
        self.paths = paths or HostPaths.at("/")
        self.reason = ""
        self._observer: Any = None
        self._pyudev: Any = None
        if not self.paths.exists(UDEV_CONTROL):
            self.reason = f"no udev daemon ({self.paths.path(UDEV_CONTROL)} is missing): polling only"
            return
        try:
            import pyudev  # optional: the agent runs without it
        except ImportError as exc:
            self.reason = f"pyudev cannot be imported ({exc}): polling only"
            return
        self._pyudev = pyudev

    @property
    def available(self) -> bool:
        return self._pyudev is not None

    @property
    def running(self) -> bool:
        return self._observer is not None

    def start(self) -> bool:
        if self._observer is not None:
            return True
        if self._pyudev is None:
            return False
        try:
            monitor = self._pyudev.Monitor.from_netlink(self._pyudev.Context())
            monitor.filter_by(subsystem="pci")
            observer = self._pyudev.MonitorObserver(monitor, callback=self._on_device, name="gpu-agent-udev")
            observer.start()
        except (ImportError, OSError, ValueError) as exc:
            # pyudev raises ImportError when libudev itself cannot be loaded, OSError for the socket.
            self.reason = f"udev monitor unavailable ({exc}): polling only"
            self._pyudev = None
            return False
        self._observer = observer
        return True

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()

    def handle(self, action: str | None, properties: Mapping[str, str]) -> bool:
        """Call on_change for an NVIDIA PCI uevent; True when it did. A failing callback is logged,
        never raised: an exception would end the observer thread and the wake-ups with it."""
        if not is_nvidia_pci_event(action, properties):
            return False
        try:
            self.on_change()
        except Exception:
            log.exception("udev wake-up callback failed")
        return True

    def _on_device(self, device: Any) -> None:
        self.handle(device.action, device.properties)
