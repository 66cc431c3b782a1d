#!/bin/bash
# One H200 call that checks everything GPU-facing (run from the repository root on the GPU machine):
#   source .whl/prelude.sh; bash benchmarks/gpu_final_check.sh "$OUT"
# 1) every GPU-marked test; 2) `attn-setup run --device cuda` per backend and mode (traces kept as golden
# candidates); 3) CUDA-graph decode and startup benchmarks. Each step has a hard timeout so the call
# ends inside the device tool's 10-minute limit. Outputs: $OUT/pytest_gpu.log, $OUT/summary.txt,
# $OUT/logs.tgz (runs, traces, benchmark logs).
OUT=${1:?usage: gpu_final_check.sh OUTDIR}
W=/tmp/gpu_final; mkdir -p $W/traces
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
S=$OUT/summary.txt
timeout 260 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$? at $(el)" | tee -a $S; tail -n 25 "$OUT/pytest_gpu.log" >> $S
run(){ name=$1; shift
  timeout 60 python3 -m pipeline.cli run --device cuda --json --log-file "$W/traces/$name.jsonl" "$@" > "$W/$name.json" 2> "$W/$name.err"
  echo "run $name rc=$? at $(el): $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ok'], d['resolved'], [(v['role'], round(v['max_rel_err'],5)) for v in d['verified']], [(s['step'], s['graph'], round(s['max_rel_err'],4)) for s in d.get('model_steps', [])][:6], d['error'] and d['error']['message'][:300])" "$W/$name.json" 2>&1)" | tee -a $S; }
run h200_flashinfer --attention-backend flashinfer --page-size 16 --num-layers 4 --cuda-graph-bs 1 2 4 8
run h200_auto --page-size 16
run h200_fa3 --attention-backend fa3 --page-size 16 --cuda-graph-bs 1 4
run h200_triton --attention-backend triton --page-size 16 --cuda-graph-bs 1 4
run h200_tbo --attention-backend flashinfer --enable-two-batch-overlap --page-size 16
run h200_pdmux4 --attention-backend flashinfer --enable-pdmux --sm-group-num 4 --page-size 16
run h200_hybrid --prefill-attention-backend fa3 --decode-attention-backend triton --page-size 16 --cuda-graph-bs 1 4
run h200_gemma2_fi --attention-backend flashinfer --model examples/configs/gemma-2-9b.json --dtype bfloat16 --page-size 16
run h200_gptoss_triton --attention-backend triton --model examples/configs/gpt-oss-20b.json --page-size 16
for b in flashinfer triton; do
  timeout 75 python3 benchmarks/cuda_graph_decode.py --backend $b --json "$W/bench_graph_$b.json" > "$W/bench_graph_$b.log" 2>&1
  echo "bench graph $b rc=$? at $(el)" | tee -a $S; tail -n 8 "$W/bench_graph_$b.log" >> $S
done
timeout 70 python3 benchmarks/startup.py --backend flashinfer --runs 3 > "$W/startup.log" 2>&1
echo "startup rc=$? at $(el)" | tee -a $S; tail -n 8 "$W/startup.log" >> $S
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
tar -czf "$OUT/logs.tgz" -C $W . ; ls -la $OUT; echo "total $(el)"
