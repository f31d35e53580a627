#!/usr/bin/env bash
# Read-only on the H200 host: gpu-agent in observe mode (plan, status --direct) with the report-only
# driver and next_boot items, plus the raw facts they read, so the items' reports can be checked against what the host says.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/ga/state
cat > /tmp/ga/agent.yaml <<YAML
mode: observe
backend: nvml
host_root: /
state_dir: /tmp/ga/state
api: {socket: /tmp/ga/agent.sock}
metrics: {listen: "127.0.0.1:19481"}
remediation: {rules_dirs: [/tmp/ga/rules.d]}
policy:
  node: {driver: {min_version: "580.0", branch: datacenter}}
  gpus:
    - match: {model: "NVIDIA H200*"}
      vbios_min: "96.00.A5.00.00"
services:
  - {name: sglang, manager: command, start_command: [/bin/true], stop_command: [/bin/true], cuda_version: "12.8"}
YAML
{
echo "== uname -r"; uname -r
echo "== /proc/driver/nvidia/version"; cat /proc/driver/nvidia/version
echo "== /boot"; ls -la /boot 2>&1 | head -30
echo "== /boot/loader/entries"; ls /boot/loader/entries 2>&1 | head
echo "== /lib/modules"; ls /lib/modules 2>&1
for k in $(ls /lib/modules 2>/dev/null); do echo "-- $k nvidia modules"; find /lib/modules/$k -name 'nvidia*.ko*' 2>/dev/null | head; done
echo "== efi"; ls /sys/firmware/efi 2>&1 | head -3; od -An -tx1 /sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c 2>&1 | head -2
echo "== dpkg nvidia"; dpkg -l 2>/dev/null | grep -i -E "nvidia|cuda-drivers" | head -20
echo "== /proc/devices nvidia"; grep -i nvidia /proc/devices
echo "== tools"; for t in grubby mokutil lsinitramfs lsinitrd zstd modinfo; do printf '%s: ' $t; command -v $t || echo missing; done
} > $OUT/host-facts.txt 2>&1
python3 -m agent.cli plan --json --config /tmp/ga/agent.yaml > $OUT/plan.json 2> $OUT/plan.stderr; echo "plan rc=$?" >> $OUT/host-facts.txt
python3 -m agent.cli plan --config /tmp/ga/agent.yaml > $OUT/plan.txt 2>&1
python3 -m agent.cli status --direct --config /tmp/ga/agent.yaml > $OUT/status.txt 2>&1; echo "status rc=$?" >> $OUT/host-facts.txt
nvidia-smi --query-gpu=driver_version,vbios_version --format=csv >> $OUT/host-facts.txt 2>&1
nvidia-smi -q | grep -i "CUDA Version" >> $OUT/host-facts.txt 2>&1
cat $OUT/plan.txt; tail -5 $OUT/host-facts.txt
