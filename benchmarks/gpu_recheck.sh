#!/bin/bash
# Second H200 call: re-run what the first call (gpu_final_check.sh) found failing, after the fixes.
#   source .whl/prelude.sh; bash benchmarks/gpu_recheck.sh "$OUT"
OUT=${1:?usage: gpu_recheck.sh OUTDIR}
W=/tmp/gpu_re; mkdir -p $W/traces
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
S=$OUT/summary.txt
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_runner_gpu.py tests/gpu/test_triton_gpu.py tests/test_capabilities.py \
  -p no:cacheprovider -rfE > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu (runner, triton, capabilities) rc=$? at $(el)" | tee -a $S; tail -n 15 "$OUT/pytest_gpu.log" >> $S
run(){ name=$1; shift
  timeout 45 python3 -m pipeline.cli run --device cuda --json --log-file "$W/traces/$name.jsonl" "$@" > "$W/$name.json" 2> "$W/$name.err"
  echo "run $name rc=$? at $(el): $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ok'], d['resolved'], [(v['role'], round(v['max_rel_err'],5)) for v in d['verified']], [(s['step'], s['graph'], round(s['max_rel_err'],4)) for s in d.get('model_steps', [])][:6], d['error'] and d['error']['message'][:300])" "$W/$name.json" 2>&1)" | tee -a $S; }
run h200_triton --attention-backend triton --page-size 16 --cuda-graph-bs 1 4
run h200_tbo --attention-backend flashinfer --enable-two-batch-overlap --page-size 16 --cuda-graph-bs 1 4
run h200_hybrid --prefill-attention-backend fa3 --decode-attention-backend triton --page-size 16 --cuda-graph-bs 1 4
run h200_gptoss_triton --attention-backend triton --model examples/configs/gpt-oss-20b.json --page-size 16 --cuda-graph-bs 1 4
tar -czf "$OUT/logs.tgz" -C $W . ; echo "total $(el)"
