"""gpu-agent benchmarks: run from the repository root as `python3 -m bench.NAME` (see bench/README.md)."""
