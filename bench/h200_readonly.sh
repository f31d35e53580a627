#!/usr/bin/env bash
# Read-only run of gpu-agent on a real NVIDIA host (observe mode): what the device check ran.
# Never calls a setter: the config is observe mode, so the backend refuses every write itself.
# Usage (on the GPU host, repo root): bench/h200_readonly.sh OUTDIR [DAEMON_SECONDS]
set -uo pipefail
out=${1:?OUTDIR}; daemon_seconds=${2:-20}
mkdir -p "$out"
work=$(mktemp -d)
cat > "$work/agent.yaml" <<YAML
mode: observe
backend: nvml
host_root: /
state_dir: $work/state
interval_seconds: 1
metrics: {listen: "127.0.0.1:9481"}
api: {socket: $work/agent.sock}
remediation: {rules_dir: $work/rules.d}
policy:
  node:
    transparent_hugepages: {enabled: never, defrag: madvise}
    nouveau: blacklisted
    triton_cache: {path: /var/cache/triton, owner: root, group: root, mode: "0755", services: [sglang]}
  gpus:
    - match: {model: "NVIDIA H200*"}
      power_limit_watts: 600
      locked_clocks: {gpu_mhz: [1980, 1980]}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
      persistence: enabled
      ecc: enabled
services:
  - {name: sglang, unit: sglang.service, health_url: "http://127.0.0.1:30000/health", gpus: all}
YAML
mkdir -p "$work/rules.d"
ga() { python3 -m agent.cli "$@"; }
{
  echo "== versions"; python3 --version; python3 -c 'import pynvml; print("nvidia-ml-py", pynvml.__version__ if hasattr(pynvml, "__version__") else "?")'
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader
  echo "== check-config"; ga check-config --config "$work/agent.yaml"; echo "exit $?"
} > "$out/versions.txt" 2>&1
ga status --json --direct --config "$work/agent.yaml" > "$out/status.json" 2> "$out/status.stderr"; echo "status exit $?" >> "$out/versions.txt"
ga plan --json --config "$work/agent.yaml" > "$out/plan.json" 2> "$out/plan.stderr"; echo "plan exit $?" >> "$out/versions.txt"
ga plan --config "$work/agent.yaml" > "$out/plan.txt" 2>&1
nvidia-smi --query-gpu=index,temperature.gpu,power.draw,power.limit,power.min_limit,power.max_limit,clocks.gr,clocks.sm,clocks.mem,clocks_event_reasons.active,ecc.mode.current,ecc.mode.pending,persistence_mode,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,nounits > "$out/nvidia-smi-before.csv" 2>&1
python3 -m agent.cli run --log-format json --config "$work/agent.yaml" > "$out/daemon.log" 2>&1 &
pid=$!
sleep 5
ga status --json --config "$work/agent.yaml" > "$out/daemon-status.json" 2>&1
for i in $(seq 1 "$daemon_seconds"); do
  curl -s -o "$out/metrics.txt" -w '%{time_total}\n' http://127.0.0.1:9481/metrics >> "$out/scrape-seconds.txt"
  sleep 1
done
nvidia-smi --query-gpu=index,temperature.gpu,power.draw,power.limit,clocks.gr,clocks.sm,clocks.mem,clocks_event_reasons.active,ecc.mode.current,persistence_mode,memory.used --format=csv,nounits > "$out/nvidia-smi-after.csv" 2>&1
ps -o pid,rss,etimes,time -p "$pid" > "$out/daemon-ps.txt"
kill -TERM "$pid"; wait "$pid"; echo "daemon exit $?" >> "$out/versions.txt"
