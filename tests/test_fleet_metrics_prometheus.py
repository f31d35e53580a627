"""A fleet's view of the service figures and NVIDIA's dcgm-exporter dashboard, end to end: one real
Prometheus (every shipped rule file, 1 s scrapes) scrapes two real agents (`gpu-agent run` on two
simulated H200 nodes with different host names, both behind 127.0.0.1) and, beside them, the two
inference servers the agents read (stand-in sglang servers at different loads).

- The fleet p95 from the agents' counter histograms is what the servers' own histograms give, and
  so is tokens per joule (the servers' token counters over the energy counters of their GPUs).
- Every query of NVIDIA's dcgm-exporter dashboard (grafana.com 12239, kept in
  tests/fixtures/dcgm-exporter-dashboard-queries.json) returns data for each host name, and the
  Hostname of each agent's series is its node's host name, not the scrape address.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_harness import DEFAULT_POLICY, RunningAgent, command_service, running_agent
from hosttree import make_host_tree
from test_dashboard_prometheus import ALERTS, COMPAT_RULES, PROMETHEUS, RECORDING, Prometheus

from agent.demo.standin_process import StandinServer, free_port
from agent.host.paths import BOOT_ID_PATH

pytestmark = pytest.mark.real_daemon

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_QUERIES = ROOT / "tests/fixtures/dcgm-exporter-dashboard-queries.json"
#: (host name, the stand-in's requests per second): two nodes that differ in name and in load.
NODES = (("h200-node-a", 6.0), ("h200-node-b", 14.0))
WINDOW = "20s"
#: Tokens per joule read two ways takes the token counters at other instants: Prometheus scrapes each
#: server and each agent once a second, and the agent's counter is the server's as it read it up to
#: half a second earlier, moving in steps of what half a second brings. The energy side is the same
#: counters both ways. rate() over a 20 s window of 1 s scrapes can be off by up to a scrape interval
#: at each end of it: 2 x 1 s / 20 s. (Measured: 2 to 7 % apart.)
TOKENS_PER_JOULE_TOLERANCE = 0.10
#: The share of its bucket's width the fleet p95 from the agents may be from the servers' own.
P95_TOLERANCE = 0.05


@dataclass
class Fleet:
    prometheus: Prometheus
    agents: dict[str, RunningAgent]  # host name -> its agent
    instance_of: dict[str, str]  # host name -> the instance label Prometheus gives its agent


def host_tree(directory: Path, hostname: str) -> None:
    """The node's host tree with its own host name, as `/proc/sys/kernel/hostname` gives it."""
    root = directory / "host"
    make_host_tree(root, kernel_sysfs=False)
    boot_id = root / BOOT_ID_PATH.lstrip("/")
    boot_id.parent.mkdir(parents=True, exist_ok=True)
    boot_id.write_text(f"{uuid.uuid4()}\n")
    (root / "proc/sys/kernel/hostname").write_text(hostname + "\n")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if PROMETHEUS is None:
        pytest.skip("prometheus server not installed (apt-get install prometheus)")
    with contextlib.ExitStack() as stack:
        agents: dict[str, RunningAgent] = {}
        servers: list[int] = []
        for hostname, rate in NODES:
            directory = tmp_path_factory.mktemp(hostname)
            host_tree(directory, hostname)
            port = free_port()
            standin = ("--flavor", "sglang", "--request-rate", str(rate), "--sim-state-dir", str(directory / "state"))
            standin += ("--sim-profile", "h200x2", "--gpus", "0,1")
            stack.enter_context(StandinServer(directory, port=port, extra_args=standin))
            servers.append(port)
            agents[hostname] = stack.enter_context(
                running_agent(
                    directory,
                    watchdog_usec=None,
                    profile="h200x2",
                    interval=0.5,
                    policy=DEFAULT_POLICY + command_service(port),
                )
            )
        for agent in agents.values():
            agent.notifications.wait_for("READY", "1")
        prometheus = Prometheus(
            tmp_path_factory.mktemp("prometheus"),
            [agent.port for agent in agents.values()],
            [ALERTS, RECORDING, COMPAT_RULES],
            {"sglang": servers},
        )
        stack.callback(prometheus.stop)

        def rates_everywhere() -> bool:
            """Both agents' histograms and energy, and both servers' own pages, have a window of rates."""
            return (
                len(
                    prometheus.query(
                        f"rate(gpu_agent_service_request_duration_seconds_count{{kind='e2e'}}[{WINDOW}]) > 0"
                    )
                )
                == 2
                and len(prometheus.query(f"rate(gpu_agent_service_gpu_energy_joules_total[{WINDOW}]) > 0")) == 2
                and len(prometheus.query(f"rate(sglang:e2e_request_latency_seconds_count[{WINDOW}]) > 0")) == 2
                and len(prometheus.query(f"count_over_time(gpu_agent_up[{WINDOW}]) >= 15")) == 2
            )

        prometheus.wait_for("a window of the agents' and the servers' counters", rates_everywhere, 90.0)
        instance_of = {name: f"127.0.0.1:{agent.port}" for name, agent in agents.items()}
        yield Fleet(prometheus, agents, instance_of)


def value(result: list[dict[str, object]]) -> float:
    (series,) = result
    sample = series["value"]
    assert isinstance(sample, list)
    return float(sample[1])


def test_the_fleet_p95_is_the_servers_own(fleet: Fleet) -> None:
    """The agents' counter histograms added up over both nodes give the p95 the servers' own
    histograms give: PromQL interpolates both inside the same bucket of the same counts, which the
    agents read up to a scrape later than Prometheus does. At a steady load that moves the rank
    inside the bucket by a request or two of the hundreds in it: the tolerance is 5 % of the width of
    the bucket holding the p95 (measured: 1e-5 s apart in a 0.2 s bucket)."""
    at = time.time()
    agents = f"sum by (le) (rate(gpu_agent_service_request_duration_seconds_bucket{{kind='e2e'}}[{WINDOW}]))"
    servers = f"sum by (le) (rate(sglang:e2e_request_latency_seconds_bucket[{WINDOW}]))"
    from_agents = value(fleet.prometheus.query(f"histogram_quantile(0.95, {agents})", at))
    from_servers = value(fleet.prometheus.query(f"histogram_quantile(0.95, {servers})", at))
    bounds = sorted(
        float(series["metric"]["le"])
        for series in fleet.prometheus.query(servers, at)
        if series["metric"]["le"] != "+Inf"
    )
    upper = next(bound for bound in bounds if bound >= from_servers)
    lower = max((bound for bound in bounds if bound < upper), default=0.0)
    assert from_servers > 0
    assert lower < from_agents <= upper, (from_agents, from_servers, (lower, upper))  # the same bucket
    assert abs(from_agents - from_servers) <= P95_TOLERANCE * (upper - lower), (from_agents, from_servers)
    # and per node, the same (the two nodes' loads differ: the fleet figure is not one node's)
    per_node = f"histogram_quantile(0.95, sum by (instance, le) (rate(gpu_agent_service_request_duration_seconds_bucket{{kind='e2e'}}[{WINDOW}])))"
    assert len(fleet.prometheus.query(per_node, at)) == 2


def test_tokens_per_joule_across_the_fleet_is_the_servers_tokens_over_their_gpus_energy(fleet: Fleet) -> None:
    at = time.time()
    agents = (
        f"sum(rate(gpu_agent_service_generated_tokens_total[{WINDOW}]))"
        f" / sum(rate(gpu_agent_service_gpu_energy_joules_total[{WINDOW}]))"
    )
    # the same figure from the servers' own counters and the energy of the GPUs they run on (all of
    # each node's: `gpus: all`)
    servers = (
        f"sum(rate(sglang:generation_tokens_total[{WINDOW}])) / sum(rate(gpu_agent_gpu_energy_joules_total[{WINDOW}]))"
    )
    from_agents = value(fleet.prometheus.query(agents, at))
    from_servers = value(fleet.prometheus.query(servers, at))
    assert from_servers > 0
    assert from_agents == pytest.approx(from_servers, rel=TOKENS_PER_JOULE_TOLERANCE)


def dashboard() -> dict[str, object]:
    data: dict[str, object] = json.loads(DASHBOARD_QUERIES.read_text())
    return data


def test_every_query_of_nvidias_dashboard_has_data_for_each_host(fleet: Fleet) -> None:
    board = dashboard()
    panels = board["panels"]
    assert isinstance(panels, list) and len(panels) == 8
    hostnames = [name for name, _ in NODES]
    (variable,) = [v for v in board["variables"] if v["name"] == "Hostname"]  # type: ignore[union-attr,index]
    listed = re.fullmatch(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)", variable["query"])
    assert listed is not None
    offered = {series["metric"][listed["label"]] for series in fleet.prometheus.query(listed["selector"])}
    assert offered == set(hostnames)  # the Hostname picker lists each node by its own name
    failures = []
    for hostname in hostnames:
        for panel in panels:
            expr = panel["expr"].replace("$Hostname", hostname).replace("$gpu", ".*")
            if not fleet.prometheus.query(expr):
                failures.append(f"{panel['title']} on {hostname}: no data for {expr}")
        (gpus,) = [v for v in board["variables"] if v["name"] == "gpu"]  # type: ignore[union-attr,index]
        selector = re.fullmatch(r"label_values\((.+),\s*gpu\)", gpus["query"].replace("$Hostname", hostname))
        assert selector is not None
        assert {s["metric"]["gpu"] for s in fleet.prometheus.query(selector[1])} == {"0", "1"}, hostname
    assert failures == []


def test_dcgm_hostname_is_the_nodes_and_xid_errors_read_0_on_every_gpu(fleet: Fleet) -> None:
    by_instance = {
        series["metric"]["instance"]: series["metric"]["Hostname"]
        for series in fleet.prometheus.query("DCGM_FI_DEV_GPU_TEMP")
    }
    # both agents are scraped at 127.0.0.1: Hostname tells them apart by their own names
    assert by_instance == {fleet.instance_of[name]: name for name, _ in NODES}
    xids = fleet.prometheus.query("DCGM_FI_DEV_XID_ERRORS")
    assert sorted((s["metric"]["Hostname"], s["metric"]["gpu"], float(s["value"][1])) for s in xids) == [
        (name, gpu, 0.0) for name, _ in NODES for gpu in ("0", "1")
    ]
    assert len(fleet.prometheus.query("DCGM_FI_DEV_CLOCKS_EVENT_REASONS")) == 4
    assert len(fleet.prometheus.query("DCGM_FI_DEV_ROW_REMAP_FAILURE == 0")) == 4
