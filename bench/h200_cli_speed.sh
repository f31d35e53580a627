#!/usr/bin/env bash
# Read-only on the H200: how fast the CLI answers (`status` against the daemon, a direct read,
# --version, --help) beside a bare python3, a pynvml one-liner reading 12 values, nvidia-smi and
# `nvitop -1`, and the daemon's CPU with two services at a 1 s loop (bench/cli_speed.py). In a venv
# holding only the package's dependencies, bytecode compiled ahead and the version baked into
# agent/_build_info.py, as the packages install it. Observe mode, no setter. Needs the cp312 wheels
# of every runtime dependency in .whl/ (carried to the device) and the build's name in
# .whl/version and .whl/revision (the device gets no .git: `git describe`'s work is done here);
# optional: .whl/tools/ (nvitop's wheel) and .whl/before/agent (an earlier commit's agent/, timed too).
set -u
python3 -m venv --without-pip /tmp/pkgvenv || exit 1
site=/tmp/pkgvenv/lib/python3.12/site-packages
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target $site .whl/*.whl || exit 1
python3 -c "import sys; sys.path.insert(0, '.'); from agent import version as v; print(v.build_info_module(v.BuildInfo(sys.argv[1], sys.argv[2])), end='')" \
    "$(cat .whl/version 2>/dev/null || echo 0.0.0.dev0)" "$(cat .whl/revision 2>/dev/null || echo unknown)" > agent/_build_info.py || exit 1
trap 'rm -f agent/_build_info.py' EXIT  # a checkout's own version comes from git again afterwards
/tmp/pkgvenv/bin/python -I -m compileall -q "$PWD/agent" "$PWD/bench" $site >/dev/null || exit 1
if ls .whl/tools/*.whl >/dev/null 2>&1 && ! command -v nvitop >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/tools .whl/tools/*.whl &&
        mkdir -p /tmp/toolbin && printf '#!/bin/sh\nPYTHONPATH=/tmp/tools exec python3 -m nvitop "$@"\n' >/tmp/toolbin/nvitop &&
        chmod +x /tmp/toolbin/nvitop && python3 -m compileall -q /tmp/tools >/dev/null && export PATH=$PATH:/tmp/toolbin
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
py=/tmp/pkgvenv/bin/python
# With an earlier agent/ there: its --version, --help and status timed in the same rounds (paired).
before=()
if [ -d .whl/before/agent ]; then
    $py -I -m compileall -q "$PWD/.whl/before/agent" >/dev/null
    before=(--before-tree "$PWD/.whl/before")
fi
timeout 420 $py -m bench.cli_speed --backend nvml --runs "${RUNS:-15}" --cpu-seconds "${CPU_SECONDS:-60}" --label "H200 (nvml)" \
    ${before[@]+"${before[@]}"} --out $OUT/cli_speed.json > $OUT/cli_speed.log 2>&1; echo "cli_speed rc=$?"
if [ -d .whl/before/agent ]; then
    timeout 200 $py -m bench.cli_speed --backend nvml --runs 9 --cpu-seconds 0 --agent-tree "$PWD/.whl/before" \
        --label "H200 (nvml), before" --out $OUT/cli_speed_before.json > $OUT/cli_speed_before.log 2>&1
    echo "before rc=$?"
fi
tail -32 $OUT/cli_speed.log
[ -f $OUT/cli_speed_before.log ] && tail -24 $OUT/cli_speed_before.log
