#!/bin/bash
# One H200 call for our Triton kernels (issues 16 §2 / §4 and 19), from the repository root:
#   source .whl/prelude.sh; source .whl/aot.sh; restore_aot; bash benchmarks/gpu_p4k_check.sh "$OUT"
# Phase 1 (parallel, <= 160 s): the GPU tests of the triton backend (two pytest processes: GQA/fp8/window and MLA),
#   every FlashInfer module the tables use warmed in its own process (a module that does not load or compile in
#   140 s leaves no $OUT/fi_ok/NAME.ok and its rows become error rows instead of a JIT compile in the timed run),
#   and our kernel variants compiled into Triton's cache in parallel processes.
# Phase 2 (<= 90 s): benchmarks/triton_kernels.py --runs 3 --sweep  -> $OUT/triton_kernels.{json,log}
# Phase 3 (<= 75 s):  benchmarks/mla_decode.py --sweep               -> $OUT/mla_decode.json, $OUT/mla_bench.log
OUT=${1:?usage: gpu_p4k_check.sh OUTDIR}
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
mkdir -p "$OUT/fi_ok"
for w in $(python3 benchmarks/triton_kernels.py --warm list); do
  timeout 140 python3 benchmarks/triton_kernels.py --warm "$w" --fi-ok "$OUT/fi_ok" > "$OUT/warm_$w.log" 2>&1 &
done
timeout 140 python3 benchmarks/mla_decode.py --warm > "$OUT/warm_mla.log" 2>&1 &
timeout 160 python3 benchmarks/triton_kernels.py --sweep --precompile 5 --precompile-only > "$OUT/precompile_tk.log" 2>&1 &
timeout 160 python3 benchmarks/mla_decode.py --sweep --precompile 5 --precompile-only > "$OUT/precompile_mla.log" 2>&1 &
timeout 160 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_triton_gpu.py > "$OUT/pytest_triton.log" 2>&1 & P1=$!
timeout 160 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_triton_mla_gpu.py > "$OUT/pytest_mla.log" 2>&1 & P2=$!
wait $P1; echo "pytest triton rc=$? at $(el)"; tail -n 12 "$OUT/pytest_triton.log"
wait $P2; echo "pytest mla rc=$? at $(el)"; tail -n 12 "$OUT/pytest_mla.log"
wait; echo "warm-ups and precompiles done at $(el); flashinfer modules ready: $(ls "$OUT/fi_ok" | tr '\n' ' ')"
grep -h "error" "$OUT"/precompile_*.log | head -5
timeout 90 python3 benchmarks/triton_kernels.py --runs 3 --sweep --fi-ok "$OUT/fi_ok" --out "$OUT" \
  > "$OUT/triton_kernels.log" 2>&1
echo "triton_kernels rc=$? at $(el)"; sed -n '/^targets/,$p' "$OUT/triton_kernels.log" | head -60
timeout 75 python3 benchmarks/mla_decode.py --sweep --out "$OUT" > "$OUT/mla_bench.log" 2>&1
echo "mla_decode rc=$? at $(el)"; grep -E "^sweep |^target|^device" "$OUT/mla_bench.log"
type save_aot >/dev/null 2>&1 && save_aot "$OUT" > /dev/null 2>&1 && echo "flashinfer modules packed at $(el)"
echo "total $(el)"
