#!/usr/bin/env bash
# Read-only on the H200: the poll cost and the daemon's footprint in a venv holding only the
# package's dependencies, as the .deb/.rpm install them (the device image's python carries more).
# Observe mode, no setter. Needs the dependency wheels for cp312 in .whl/ (carried to the device).
#
# Bytecode is compiled ahead, as pip does when install-env builds the package's environment: a
# daemon that imports from source compiles every module in-process, and the compiler's transient
# allocations leave about 16 MB more RSS behind (87.8 MB against 71.8 MB on the H200).
set -u
python3 -m venv --without-pip /tmp/pkgvenv || exit 1
python3 -m pip install -q --no-index --no-deps --no-cache-dir \
    --target /tmp/pkgvenv/lib/python3.12/site-packages .whl/*.whl || exit 1
/tmp/pkgvenv/bin/python -I -m compileall -q "$PWD/agent" "$PWD/bench" >/dev/null || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=/tmp/pkgvenv/bin/python
timeout 120 $py -m bench.collect_cost --backend nvml --out $OUT/collect_cost.json --seconds 10 > $OUT/collect_cost.log 2>&1; echo "collect rc=$?"
timeout 150 $py -m bench.daemon_footprint --backend nvml --seconds 60 --interval 1 --out $OUT/daemon_footprint.json > $OUT/footprint.log 2>&1; echo "footprint rc=$?"
tail -12 $OUT/collect_cost.log; tail -6 $OUT/footprint.log
