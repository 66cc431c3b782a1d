#!/bin/bash
# One H200 call for the Triton MLA kernels (issue 16), run from the repository root on the GPU machine:
#   source .whl/prelude.sh; bash benchmarks/gpu_mla_check.sh "$OUT" [tests|bench|all]
# tests: FlashInfer's MLA module JIT-compiles in the background while tests/gpu/test_triton_mla_gpu.py runs;
#        the FlashInfer cache is then packed into $OUT (carry it back as .whl/fi-cache.tgz.part-* next time).
# bench: our kernel variants compile in 12 processes, then benchmarks/mla_decode.py --sweep --runs 2
#        (JSON in $OUT/mla_decode.json, table in $OUT/mla_bench.log).
# all:   both in one call (the benchmark then with --runs 1 and a shorter limit). Each step has a hard
#        timeout so the call ends inside the 10-minute limit.
OUT=${1:?usage: gpu_mla_check.sh OUTDIR [tests|bench|all]}; WHAT=${2:-all}
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
if [ "$WHAT" != bench ]; then
  timeout 330 python3 benchmarks/mla_decode.py --warm > "$OUT/fi_warm.log" 2>&1 & W=$!
  timeout 330 python3 -m pytest -q tests/gpu/test_triton_mla_gpu.py -p no:cacheprovider -rfE --durations=8 \
    > "$OUT/pytest_mla.log" 2>&1
  echo "pytest rc=$? at $(el)"; tail -n 30 "$OUT/pytest_mla.log"
  wait $W; echo "flashinfer warm rc=$? at $(el)"; tail -n 3 "$OUT/fi_warm.log"
  type save_fi_cache >/dev/null 2>&1 && save_fi_cache "$OUT" >/dev/null && echo "fi cache saved at $(el)"
fi
if [ "$WHAT" != tests ]; then
  if [ "$WHAT" = all ]; then LIMIT=230; RUNS=1; else LIMIT=560; RUNS=2; fi
  timeout $LIMIT python3 benchmarks/mla_decode.py --sweep --runs $RUNS --precompile 12 \
    --out "$OUT" > "$OUT/mla_bench.log" 2>&1
  echo "bench rc=$? at $(el)"; grep -E "^sweep|^device|run |median|error" "$OUT/mla_bench.log" | head -30
  tail -n 16 "$OUT/mla_bench.log"
fi
echo "total $(el)"
