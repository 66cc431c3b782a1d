#!/bin/bash
# One GPU call for the runner (issue 6). Run on the H200 from the repository root:
#   OUT=<dir> bash benchmarks/gpu_runner_check.sh      (it sources .whl/prelude.sh itself)
# Writes under $OUT: pytest.log, bench_<backend>.{log,json}, run_cuda.json and the runner trace
# golden_h200_runner.jsonl (copy to tests/data/golden/ to keep it). Assumes a warm FlashInfer JIT cache.
source .whl/prelude.sh;
OUT=${OUT:?set OUT to the output folder}
T0=$(date +%s)
python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py -p no:cacheprovider -rf > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "passed|failed|skipped|Error" "$OUT/pytest.log" | tail -20
for b in flashinfer triton; do
  timeout 90 python3 benchmarks/cuda_graph_decode.py --backend $b --json "$OUT/bench_$b.json" > "$OUT/bench_$b.log" 2>&1
  echo "bench $b rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 5 "$OUT/bench_$b.log"
done
rm -f "$OUT/golden_h200_runner.jsonl"
python3 -m pipeline.cli run --device cuda --attention-backend flashinfer --page-size 16 --num-layers 4 --cuda-graph-bs 1 2 4 8 \
  --json --log-file "$OUT/golden_h200_runner.jsonl" > "$OUT/run_cuda.json" 2> "$OUT/run_cuda.err"
echo "run rc=$? at $(( $(date +%s) - T0 )) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ok'], d['runner_states'], d['model_steps'], d['error'])" "$OUT/run_cuda.json"
