#!/bin/bash
# Issue 13, sections 1 and 8 on the H200, one part per device call (each stays inside the 10-minute limit):
#   source .whl/prelude.sh; bash benchmarks/gpu_layer_match_check.sh "$OUT" tests     # per-backend + sync-debug tests
#   source .whl/prelude.sh; bash benchmarks/gpu_layer_match_check.sh "$OUT" runtests  # run flow in process, every config
#   source .whl/prelude.sh; bash benchmarks/gpu_layer_match_check.sh "$OUT" runs      # the same as subprocesses + table
#   source .whl/prelude.sh; bash benchmarks/gpu_layer_match_check.sh "$OUT" bench   # wrapper overhead table
# Outputs under $OUT: <part>.log (full output) and summary.txt (the lines that say pass/fail and the tables).
OUT=${1:?usage: gpu_layer_match_check.sh OUTDIR tests|runtests|runs|bench}; PART=${2:?part: tests|runtests|runs|bench}
mkdir -p "$OUT"; S=$OUT/summary.txt; T0=$(date +%s)
# FlashInfer's AOT kernels carried in .whl (as gpu_final_check.sh does); nothing happens without them
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot 2>/dev/null
case $PART in
  tests)
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      tests/gpu/test_hot_path_gpu.py tests/gpu/test_layer_match_gpu.py > "$OUT/tests.log" 2>&1
    echo "pytest tests rc=$? in $(( $(date +%s) - T0 )) s" | tee -a "$S"; tail -n 30 "$OUT/tests.log" >> "$S" ;;
  runtests)
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/gpu/test_bundled_run_gpu.py \
      > "$OUT/runtests.log" 2>&1
    echo "pytest runtests rc=$? in $(( $(date +%s) - T0 )) s" | tee -a "$S"; tail -n 30 "$OUT/runtests.log" >> "$S" ;;
  runs)
    timeout 560 python3 benchmarks/gpu_bundled_configs.py --out "$OUT/bundled" --timeout 150 > "$OUT/runs.log" 2>&1
    echo "gpu_bundled_configs rc=$? in $(( $(date +%s) - T0 )) s" | tee -a "$S"; grep -v '^done ' "$OUT/runs.log" >> "$S" ;;
  bench)
    timeout 560 python3 benchmarks/wrapper_overhead.py --out "$OUT/bench" > "$OUT/bench.log" 2>&1
    echo "wrapper_overhead rc=$? in $(( $(date +%s) - T0 )) s" | tee -a "$S"; cat "$OUT/bench.log" >> "$S" ;;
  *) echo "unknown part $PART (tests|runtests|runs|bench)" >&2; exit 2 ;;
esac
cat "$S"
