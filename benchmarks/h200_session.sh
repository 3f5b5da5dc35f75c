#!/usr/bin/env bash
# What one lease of the H200 runs, in two calls of the device tool (each under 10 min),
# every output under $OUT. Call 1: `benchmarks/h200_session.sh check-tune`; copy
# $OUT/NVIDIA_H200.json to autotune_configs/; call 2: `benchmarks/h200_session.sh bench`.
# The peer (triton_kernels) travels in .peers/ (benchmarks/NOTES.md, "Peers tried").
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
case "${1:-}" in
  check-tune)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    # Every kernel compiled by this GPU's Triton and checked against the references.
    HYPOTHESIS_PROFILE=ci timeout 300 python -m pytest -q -n 8 tests/ 2>&1 | tail -15 \
      | tee "$OUT/tests.log"
    PYTHONPATH=.peers timeout 90 python -m pytest -q benchmarks/test_peers.py 2>&1 | tail -3
    timeout 330 python -m wide_moe_triton.tune --quick --tp 8 16 1 \
      --out "$OUT/NVIDIA_H200.json" 2>&1 | tail -60 | tee "$OUT/tune.log"
    ;;
  bench)
    PYTHONPATH=.peers timeout 330 python benchmarks/bench_layer.py --shapes tp8 tp1 \
      --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^   \|^|"
    timeout 60 python benchmarks/reliability.py --invariance 2>&1 | tail -8
    timeout 60 python benchmarks/reliability.py --replays 10000 2>&1 | tail -4
    timeout 90 compute-sanitizer --tool memcheck python benchmarks/reliability.py --sanitize \
      2>&1 | tail -3
    timeout 120 compute-sanitizer --tool racecheck python benchmarks/reliability.py --sanitize \
      2>&1 | tail -3
    tail -80 "$OUT/bench.log" | grep "^|"
    ;;
  *) echo "usage: $0 check-tune|bench" >&2; exit 2 ;;
esac
