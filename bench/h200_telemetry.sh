#!/usr/bin/env bash
# Read-only on the H200: the profiling telemetry's readings against independent readers, the poll cost and the
# daemon's footprint with the new telemetry on (observe mode, no setter).
set -u
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# compiled ahead as the packages are: a daemon importing from source keeps ~16 MB more RSS
python3 -m compileall -q agent bench >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m bench.h200_telemetry_compare --out-dir $OUT > $OUT/compare.log 2>&1; echo "compare rc=$?"
timeout 120 python3 -m bench.collect_cost --backend nvml --out $OUT/collect_cost.json --seconds 10 > $OUT/collect_cost.log 2>&1; echo "collect rc=$?"
timeout 150 python3 -m bench.daemon_footprint --backend nvml --seconds 60 --interval 1 --out $OUT/daemon_footprint.json > $OUT/footprint.log 2>&1; echo "footprint rc=$?"
tail -5 $OUT/compare.log; tail -8 $OUT/collect_cost.log; tail -8 $OUT/footprint.log
