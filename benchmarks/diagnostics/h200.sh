#!/usr/bin/env bash
# Runs on an H200, one mode a call (each within 9.5 minutes); the usual order:
#   probe  (when the experts kernels changed) probe_experts.py's configs, then the
#          experts' GPU tests; VARIANT=FILE (a copy of kernels/experts/tiles.py, e.g. from a
#          branch) also times the best pairs with that file's kernels
#   profile  (to find what limits the experts) Nsight Compute over one experts call in
#          each weight layout and over the matmul_ogs peer's GEMMs, as CSV
#          (PROFILE_B: the width, default 256; PROFILE_LAYOUTS: default "wgmma wgmma_decode")
#   tests  the GPU test suite (HYPOTHESIS_PROFILE=gpu-check, 16 workers, each test's
#          result on its own line so a timeout still names what failed); it compiles
#          for minutes: more than 530 s on 2026-12-03, hence a call of its own
#   check  the matmul_ogs peer's test, then reliability: invariance + claim order +
#          2 000 graph replays at b = 65 / 256 / 1024 (E = 896), memcheck and racecheck
#          on a tiny run
#   tune   the quick sweep at TP8, TP16, TP1 into $OUT/<GPU name>.json (candidates
#          compiled in a thread pool first; TUNE_RESUME=FILE goes on from an earlier
#          call's .partial.json); fold it into autotune_configs/ and copy $OUT/<GPU
#          name>.md (tuned vs default at every point, same run) to
#          benchmarks/results/<GPU>-tuning.md before `bench`
#   layer  the whole layer at T = 1 and at simulated T = 2 (the tail's all-reduces over the
#          mailbox) at b = 1 / 65 / 1024, eager and graph, the stock layer timed at b = 1
#          only; then host_overhead.py --gpu (eager minus graph a call at b = 1 / 65 / 1024)
#   regs   the up launch's register cap where maxnreg 96 spilled in the loop (TP1 b = 512,
#          TP16 b = 512: the table's entry against 96), a fourth stage at TP8, then the
#          TP1 whole layer
#   bench  bench_layer over tp8, tp16, then tp1 (whole layer, its batch-invariance line at
#          E = 896) last, its stock calls being seconds each (BENCH_SHAPES to choose;
#          results written after each shape and on the timeout's SIGTERM)
#   rank0  rank 0's whole TP8 and TP16 layer, its peers' words pre-filled, at the seed's
#          widths, beside its per-rank floor and the seed's figures (bench_layer --rank0;
#          BENCH_SHAPES to choose): $OUT/<GPU>-tp8-layer.csv and .md
# Every step runs under `timeout`, bounded by what is left of the call's time
# (BUDGET seconds, default 560), its log under $OUT; a summary is printed last.
# The peers need .peers/ (benchmarks/NOTES.md, "Peers"). Compiled kernels go to .triton-cache/
# (ignored): a later call on the same machine reuses them.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for the logs and results}"
export TRITON_CACHE_DIR="$PWD/.triton-cache"
BUDGET=${BUDGET:-560}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

# step NAME LIMIT MIN CMD...: run CMD under timeout min(LIMIT, budget left - 10 s),
# output to $OUT/NAME.log; skipped when less than MIN seconds are left.
step() {
  local name=$1 limit=$2 min=$3; shift 3
  local left=$((BUDGET - SECONDS - 10))
  if ((left < min)); then
    echo "$name: SKIPPED (${left} s left of the budget, needs ${min})" >> "$SUMMARY"
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local what="rc $rc"
  ((rc == 124 || rc == 137)) && what="TIMED OUT"
  echo "$name: $what, $((SECONDS - t0)) s (limit $limit s)" >> "$SUMMARY"
}

show() {  # show NAME PATTERN [N]: the log's last N lines matching PATTERN
  [[ -f "$OUT/$1.log" ]] && grep -E "$2" "$OUT/$1.log" | tail -"${3:-20}" | sed "s/^/  $1| /" >> "$SUMMARY"
}

case "${1:-}" in
  tests)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
    # worksteal: an idle worker takes queued tests from a busy one, so the run does not
    # end on one worker's queue; $OUT/test_times.txt names every phase over a second as
    # it ends (conftest.py), also when the limit cuts the run
    step tests 545 60 env HYPOTHESIS_PROFILE=gpu-check WIDE_MOE_TEST_TIMES="$OUT/test_times.txt" \
      python -m pytest -v -rf --tb=short -n 16 --dist worksteal -p no:benchmark \
      -p no:cacheprovider --durations=20 tests/
    show tests "FAILED|ERROR|passed|failed" 30
    [[ -f "$OUT/test_times.txt" ]] && sort -rn "$OUT/test_times.txt" | head -15 | sed "s/^/  slowest| /" >> "$SUMMARY"
    ;;
  probe)
    # the experts' configs in both Hopper layouts (probe_experts.py), then their GPU tests
    step probe 300 60 python benchmarks/diagnostics/probe_experts.py --tp 8 --batches 65 256 1024 \
      --layouts wgmma wgmma_decode --top 4 --no-untiled ${VARIANT:+--variant "$VARIANT"}
    show probe "^\|" 8
    step tests_experts 150 60 env HYPOTHESIS_PROFILE=gpu-check python -m pytest -q -rf \
      --tb=short -n 16 -p no:cacheprovider tests/test_experts.py
    show tests_experts "FAILED|ERROR|passed|failed" 10
    ;;
  profile)
    # Nsight Compute over one experts call (both layouts) and the matmul_ogs peer's GEMMs
    # (benchmarks/diagnostics/profile_experts.py); the details and per-SASS-line source pages as CSV
    for layout in ${PROFILE_LAYOUTS:-wgmma wgmma_decode}; do
      kernels="experts_(up|down)"; [[ $layout == wgmma ]] && kernels="$kernels|matmul_ogs"
      step "ncu_$layout" 200 60 env PYTHONPATH=.peers ncu --clock-control none --set full \
        -k "regex:$kernels" -o "$OUT/$layout" python benchmarks/diagnostics/profile_experts.py --b "${PROFILE_B:-256}" \
        --layout "$layout"
      show "ncu_$layout" "rel err|matmul_ogs|Error|ERROR" 5
      if [[ -f "$OUT/$layout.ncu-rep" ]]; then
        ncu --import "$OUT/$layout.ncu-rep" --page details --csv > "$OUT/${layout}_details.csv"
        ncu --import "$OUT/$layout.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/${layout}_source.csv"
        gzip -f "$OUT/${layout}_details.csv" "$OUT/${layout}_source.csv"
        rm -f "$OUT/$layout.ncu-rep"
        python benchmarks/diagnostics/ncu_summary.py "$OUT/${layout}_details.csv.gz" \
          "$OUT/${layout}_source.csv.gz" > "$OUT/${layout}_summary.txt" 2>&1
        head -40 "$OUT/${layout}_summary.txt" | sed "s/^/  $layout| /" >> "$SUMMARY"
      fi
    done
    ls -la "$OUT" >> "$SUMMARY"
    ;;
  check)
    step peers 60 30 env PYTHONPATH=.peers python -m pytest -q -p no:cacheprovider \
      benchmarks/test_peers.py
    show peers "passed|failed|error" 2
    # at E = 896 with the tuned configs (their graph != eager at b = 65-256 showed only
    # there: NOTES, Register-operand wait); on a difference it names the first stage
    # that differs
    step reliability 240 60 python benchmarks/reliability.py --experts 896 --invariance \
      --claim-order --batch 65 256 1024 --replays 2000 --check-every 100
    show reliability "invariance|claim order|replays|differ|DIFFER|reliability:|Error"
    step memcheck 75 30 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer \
      --tool memcheck --error-exitcode 9 python benchmarks/reliability.py --sanitize
    show memcheck "ERROR SUMMARY|sanitize b=|Error" 5
    step racecheck 90 30 compute-sanitizer --tool racecheck --error-exitcode 9 \
      python benchmarks/reliability.py --sanitize --sanitize-batches 17
    show racecheck "RACECHECK SUMMARY|ERROR SUMMARY|hazard|sanitize b=|Error" 5
    ;;
  tune)
    # the running GPU's table file (tuning.table_file: its name, spaces as underscores)
    table=$(python -c "from wide_moe_triton import tuning; print(tuning.table_file(tuning.gpu_name()))") \
      || { echo "tune: no GPU name (is a CUDA GPU visible?)" >> "$SUMMARY"; cat "$SUMMARY"; exit 1; }
    # TUNE_RESUME=FILE: an earlier call's .partial.json (sent in the working tree) to go on from
    [[ -n "${TUNE_RESUME:-}" ]] && cp "$TUNE_RESUME" "$OUT/${table%.json}.partial.json"
    # TUNE_KERNELS="front ...": sweep those kernels only, folded into a copy of the
    # shipped table (tune --kernels folds into the table at --out; without a shipped
    # table, into the one the layer reads); TUNE_ARGS: more options (e.g.
    # "--experts-layout wgmma_decode")
    [[ -n "${TUNE_KERNELS:-}" && -f "autotune_configs/$table" ]] && cp "autotune_configs/$table" "$OUT/$table"
    step tune 560 60 python -m wide_moe_triton.tune --quick --tp 8 16 1 --time-limit "${TUNE_LIMIT:-450}" \
      ${TUNE_KERNELS:+--kernels $TUNE_KERNELS} ${TUNE_ARGS:-} --out "$OUT/$table"
    tail -30 "$OUT/tune.log" | sed "s/^/  tune| /" >> "$SUMMARY"
    ;;
  bench)
    # the table the running GPU's layer reads (its own, or the fallback: tuning.choose_table)
    python -c "from wide_moe_triton import tuning; c = tuning.choose_table(tuning.gpu_info()); \
t = tuning.read_table(c.path) if c.path else {}; \
print('table', c.source, c.path, t.get('date'), sorted(t.get('kernels', {})))" >> "$SUMMARY" 2>&1
    step bench 545 120 env PYTHONPATH=.peers python benchmarks/bench_layer.py \
      --shapes ${BENCH_SHAPES:-tp8 tp16 tp1} --batches 65 128 256 512 1024 --out "$OUT"
    show bench "^# .* done in|batch invariance|^!!|not run|Traceback" 30
    [[ -f "$OUT/results.md" ]] && sed "s/^/  results| /" "$OUT/results.md" >> "$SUMMARY"
    ;;
  layer)
    step layer 330 120 python benchmarks/bench_layer.py --shapes tp1 --layer-only --no-peers \
      --simulated 2 --layer-batches 1 65 1024 --stock-batches 1 --out "$OUT"
    show layer "^# .* done in|batch invariance|^!!|Traceback|SIGTERM" 20
    [[ -f "$OUT/results.md" ]] && sed "s/^/  results| /" "$OUT/results.md" >> "$SUMMARY"
    step host 150 60 python benchmarks/host_overhead.py --gpu --batches 1 65 1024
    show host "^\||^NVIDIA|Error|Traceback" 12
    ;;
  regs)
    # the up launch's register cap at the table's widths where maxnreg 96 spilled inside
    # the loop (benchmarks/NOTES.md, "A model of the experts launches"): each probe times
    # the table's config first, then the same at maxnreg 96 (and uncapped at TP1)
    d='"A_BF16": 1, "num_warps": 4, "num_stages": 3, "MASK_ROWS": 1'
    u16="{\"BLOCK_M\": 16, \"BLOCK_N\": 64, $d"
    u32="{\"BLOCK_M\": 32, \"BLOCK_N\": 64, $d, \"HALF_TILE\": 1"
    # (TP1's probe holds three layouts of 896 experts: it needs the H200's memory)
    step regs_tp1 200 60 python benchmarks/diagnostics/probe_experts.py --tp 1 --batches 512 \
      --layouts wgmma_decode --no-untiled --up "[$u16, \"maxnreg\": 128}, $u16, \"maxnreg\": 96}, $u16, \"maxnreg\": 0}]" \
      --down "[{\"BLOCK_M\": 32, \"BLOCK_N\": 256, $d, \"maxnreg\": 0, \"COLS\": 2, \"HALF_TILE\": 1}]"
    show regs_tp1 "^  (up|down) |^\|" 12
    step regs_tp16 120 60 python benchmarks/diagnostics/probe_experts.py --tp 16 --batches 512 \
      --layouts wgmma_decode --no-untiled --up "[$u32, \"maxnreg\": 168}, $u32, \"maxnreg\": 96}]" \
      --down "[{\"BLOCK_M\": 16, \"BLOCK_N\": 128, $d, \"maxnreg\": 128, \"COLS\": 4}]"
    show regs_tp16 "^  (up|down) |^\|" 12
    # the model's lever (NOTES, "A model of the experts launches"): a fourth stage, more
    # bytes in flight at the same programs a SM (no spill in the loop at 4 stages, AOT)
    step stages_tp8 130 60 python benchmarks/diagnostics/probe_experts.py --tp 8 --batches 256 1024 \
      --layouts wgmma_decode --no-untiled --up "[$u16, \"maxnreg\": 128}, $u16, \"maxnreg\": 128, \"num_stages\": 4}]" \
      --down "[{\"BLOCK_M\": 16, \"BLOCK_N\": 128, $d, \"maxnreg\": 128, \"COLS\": 4}, {\"BLOCK_M\": 16, \"BLOCK_N\": 128, $d, \"maxnreg\": 128, \"COLS\": 4, \"num_stages\": 4}]"
    show stages_tp8 "^  (up|down) |^\|" 12
    # then the TP1 whole layer (CUDA graph and eager; the stock layer at b = 65 only)
    step layer_tp1 400 120 python benchmarks/bench_layer.py --shapes tp1 --layer-only --no-peers \
      --batches 65 128 256 512 1024 --stock-batches 65 --out "$OUT"
    show layer_tp1 "^# .* done in|batch invariance|^!!|Traceback|SIGTERM" 20
    [[ -f "$OUT/results.md" ]] && sed "s/^/  results| /" "$OUT/results.md" >> "$SUMMARY"
    ;;
  rank0)
    step rank0 545 120 python benchmarks/bench_layer.py --rank0 --shapes ${BENCH_SHAPES:-tp8 tp16} \
      --out "$OUT"
    show rank0 "^# .* done in|^!!|differs|Traceback|SIGTERM" 30
    for md in "$OUT"/*-tp8-layer.md; do [[ -f "$md" ]] && sed "s/^/  rank0| /" "$md" >> "$SUMMARY"; done
    ;;
  procs)
    # ranks as processes on ONE GPU (fits one H100): procs_gpu.py at T = 8, 4, 2 (a small
    # config that admits T = 8, and Kimi-K3's dims with PROCS_EXPERTS experts, default
    # 64), its log $OUT/procs_gpu.log with each check PASS/FAIL; then the launcher,
    # torchrun -m wide_moe_triton --share-gpus at T = 2, 4, 8 (the same dims and
    # wide_rows, so its kernels are in the cache)
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
    e=${PROCS_EXPERTS:-64}
    # PROCS_ARGS: more options (e.g. "--worlds 2 4" or "--configs kimi" for a second call)
    step procs_gpu 330 120 python benchmarks/procs_gpu.py --out "$OUT/procs_gpu.log" \
      --experts "$e" --budget 230 ${PROCS_ARGS:-}
    show procs_gpu "FAIL|SKIPPED|procs_gpu:|Traceback|Error" 30
    for t in 2 4 8; do
      step "launcher_t$t" 60 40 env OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node "$t" \
        -m wide_moe_triton --tp "$t" --share-gpus --experts "$e" --wide-rows 256 --batches 1 65
      show "launcher_t$t" "wide_moe_triton, T|^ +[0-9]+ |GPU memory|OK:|MISMATCH|error" 8
    done
    grep -c PASS "$OUT/procs_gpu.log" 2>/dev/null | sed "s/^/  procs| PASS lines: /" >> "$SUMMARY"
    ;;
  *) echo "usage: OUT=DIR bash $0 probe|profile|tests|check|tune|layer|bench|regs|rank0|procs" >&2; exit 2 ;;
esac
echo "== ${1} (${SECONDS} s of ${BUDGET}) ==" >> "$SUMMARY"
cat "$SUMMARY"
