"""`gpu-agent demo`: the agent on a simulated node, in a scratch directory, changing nothing real.

It builds a fake host tree (THP sysfs files, /proc/modules with nouveau loaded, an Ubuntu
/etc/os-release, empty /etc/modprobe.d and /etc/systemd/system), writes a config in
enforce mode with an example policy for a mixed H200 + RTX PRO 6000 node, and runs
plan -> apply -> plan, printing each step.
"""

from __future__ import annotations

import grp
import os
import pwd
import tempfile
from pathlib import Path

DEMO_CONFIG = """\
# gpu-agent demo config: a simulated node (4x H200 SXM, 2x RTX PRO 6000) and a fake host tree.
mode: enforce
backend: simulated
simulated: {{profile: mixed}}
host_root: {host_root}
state_dir: {state_dir}
policy:
  node:
    transparent_hugepages: {{enabled: never, defrag: never}}
    nouveau: blacklisted
    triton_cache: {{path: /var/cache/triton, owner: {user}, group: {group}, mode: "0755", services: [sglang]}}
  gpus:
    - match: {{model: "NVIDIA H200*"}}
      power_limit_watts: 600
      locked_clocks: {{gpu_mhz: [1980, 1980]}}
      persistence: enabled
      ecc: enabled
    - match: {{model: "NVIDIA RTX PRO 6000*"}}
      power_limit_watts: 450
      fan_curve: [[30, 30], [50, 60], [75, 100]]
      persistence: enabled
      ecc: enabled
services:
  - {{name: sglang, unit: sglang.service, health_url: "http://127.0.0.1:30000/health", gpus: all}}
"""


def build_demo_host(root: Path) -> None:
    """A small fake host: what the node policy items read and write, nothing else."""
    thp = root / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True, exist_ok=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    (thp / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    (root / "sys/module/nouveau").mkdir(parents=True, exist_ok=True)
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "modules").write_text(
        "nvidia_uvm 1794048 0 - Live 0x0000000000000000 (POE)\n"
        "nouveau 3096576 0 - Live 0x0000000000000000\n"
        "nvidia 14381056 1 nvidia_uvm, Live 0x0000000000000000 (POE)\n"
    )
    etc = root / "etc"
    (etc / "modprobe.d").mkdir(parents=True, exist_ok=True)
    (etc / "systemd/system").mkdir(parents=True, exist_ok=True)
    (etc / "os-release").write_text('NAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\nID_LIKE=debian\n')


def write_demo_config(directory: Path) -> Path:
    host_root = directory / "host"
    state_dir = directory / "state"
    build_demo_host(host_root)
    state_dir.mkdir(parents=True, exist_ok=True)
    config = directory / "agent.yaml"
    config.write_text(
        DEMO_CONFIG.format(
            host_root=host_root,
            state_dir=state_dir,
            user=pwd.getpwuid(os.getuid()).pw_name,
            group=grp.getgrgid(os.getgid()).gr_name,
        )
    )
    return config


def run_demo(directory: Path | None = None) -> int:
    from agent.cli import main

    directory = directory or Path(tempfile.mkdtemp(prefix="gpu-agent-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    config = write_demo_config(directory)
    print(f"gpu-agent demo: a simulated node (4x H200, 2x RTX PRO 6000) under {directory}")
    print(f"config: {config}  (nothing outside that directory is read or changed)\n")
    steps = [
        ("1. plan: what differs from the policy", ["plan"]),
        ("2. apply: enforce it", ["apply"]),
        ("3. plan again: in sync, except what waits for a reboot", ["plan"]),
    ]
    codes = []
    for title, argv in steps:
        print(f"== {title}  (gpu-agent {' '.join(argv)} --config {config.name})")
        code = main([*argv, "--config", str(config)])
        print(f"-> exit code {code}\n")
        codes.append(code)
    print(f"Try: gpu-agent status --config {config}")
    # plan before apply must show drift (2); apply must succeed (0); afterwards only
    # reboot-pending items (ECC, nouveau) remain, which plan reports as 2.
    return 0 if codes[1] == 0 and codes[0] == 2 else 1
