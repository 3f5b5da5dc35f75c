#!/usr/bin/env bash
# What a lease of the H200 runs, one device-tool call a step (each under 10 min), every
# output under $OUT. Carry .peers/ (benchmarks/NOTES.md, "Peers tried").
#   check  every test, compiled by this GPU's Triton (about 5 min with 8 workers)
#   tune   the quick sweep of TP8, TP16 and TP1 (estimated 4-5 min); then copy
#          $OUT/NVIDIA_H200.json to autotune_configs/ and $OUT/NVIDIA_H200.md (tuned vs
#          default at every point, same run) to benchmarks/results/H200-tuning.md here
#   bench  bench_layer (checked, then timed) and the reliability checks
# Measured cost (2026-12-02): check > 300 s; tune --quick (before the thread-pool
# compiles) > 5 min at TP8 alone: the route kernel compiles in 10-25 s a config.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
case "${1:-}" in
  check)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    HYPOTHESIS_PROFILE=ci timeout 540 python -m pytest -q -n 8 -p no:benchmark tests/ \
      > "$OUT/tests.log" 2>&1
    tail -5 "$OUT/tests.log"
    PYTHONPATH=.peers timeout 50 python -m pytest -q benchmarks/test_peers.py 2>&1 | tail -3
    ;;
  tune)
    # --time-limit: past 450 s no kernel starts, and the table of what is done is written
    # (a cut run resumes from $OUT/NVIDIA_H200.partial.json).
    timeout 560 python -m wide_moe_triton.tune --quick --tp ${2:-8 16 1} --time-limit 450 \
      --out "$OUT/NVIDIA_H200.json" > "$OUT/tune.log" 2>&1
    tail -80 "$OUT/tune.log"
    ;;
  bench)
    timeout 120 python benchmarks/reliability.py --invariance 2>&1 | grep "invariance"
    PYTHONPATH=.peers timeout 300 python benchmarks/bench_layer.py --shapes tp8 tp1 \
      --out "$OUT" > "$OUT/bench.log" 2>&1
    grep "^|" "$OUT/bench.log" | tail -80
    timeout 60 python benchmarks/reliability.py --replays 10000 2>&1 | tail -4
    timeout 60 compute-sanitizer --tool memcheck python benchmarks/reliability.py --sanitize \
      2>&1 | tail -3
    ;;
  *) echo "usage: $0 check|tune [TP]|bench" >&2; exit 2 ;;
esac
