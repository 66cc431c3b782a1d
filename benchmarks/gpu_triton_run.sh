#!/bin/bash
# One GPU call for the triton backend (issue 7): GPU tests + FlashInfer JIT warm-up in parallel, then the benchmark.
# Usage on the GPU machine:  source .whl/prelude.sh; bash benchmarks/gpu_triton_run.sh "$OUT" [--sweep]
OUT=${1:?usage: gpu_triton_run.sh OUTDIR [--sweep]}; shift
python benchmarks/triton_kernels.py --warm decode > "$OUT/warm_decode.log" 2>&1 & W1=$!
python benchmarks/triton_kernels.py --warm prefill > "$OUT/warm_prefill.log" 2>&1 & W2=$!
T0=$(date +%s)
python -m pytest tests/gpu/test_triton_gpu.py -q -p no:cacheprovider -rf > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "passed|failed|Error" "$OUT/pytest.log" | tail -25
wait $W1 $W2; tail -n 3 "$OUT"/warm_*.log; echo "warm done at $(( $(date +%s) - T0 )) s"
python benchmarks/triton_kernels.py "$@" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
tar -czf "$OUT/fi-cache.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache && ls -la "$OUT/fi-cache.tgz"
tail -n 90 "$OUT/bench.log"
