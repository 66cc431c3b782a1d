#!/bin/bash
# One H200 call after the page-table / per-layer changes (session 2 of issue #5):
#   source .whl/prelude.sh; bash benchmarks/gpu_session2_check.sh "$OUT"
# 1) every GPU-marked test plus the kv_indices tests on CUDA; 2) `attn-setup run --device cuda` for
# flashinfer (graphs), TBO and PD-mux; 3) benchmarks/attention_kernels.py (crossover + our decode step
# vs raw FlashInfer, eager and CUDA graph). Outputs under $OUT.
OUT=${1:?usage: gpu_session2_check.sh OUTDIR}
W=/tmp/gpu_s2; mkdir -p $W/traces
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
S=$OUT/summary.txt
timeout 240 python3 -m pytest -q -m gpu tests tests/test_kv_indices.py -p no:cacheprovider -rfE > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$? at $(el)" | tee -a $S; tail -n 25 "$OUT/pytest_gpu.log" >> $S
timeout 60 python3 -m pytest -q tests/test_kv_indices.py -p no:cacheprovider -rfE > "$OUT/pytest_kvi.log" 2>&1
echo "pytest kv_indices (CUDA) rc=$? at $(el)" | tee -a $S; tail -n 3 "$OUT/pytest_kvi.log" >> $S
run(){ name=$1; shift
  timeout 60 python3 -m pipeline.cli run --device cuda --json --log-file "$W/traces/$name.jsonl" "$@" > "$W/$name.json" 2> "$W/$name.err"
  echo "run $name rc=$? at $(el): $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ok'], d['resolved'], [(v['role'], round(v['max_rel_err'],5)) for v in d['verified']], [(s['step'], s['graph'], round(s['max_rel_err'],4)) for s in d.get('model_steps', [])][:6], d['error'] and d['error']['message'][:300])" "$W/$name.json" 2>&1)" | tee -a $S; }
run h200_flashinfer --attention-backend flashinfer --page-size 16 --num-layers 4 --cuda-graph-bs 1 2 4 8
run h200_tbo --attention-backend flashinfer --enable-two-batch-overlap --page-size 16
run h200_pdmux4 --attention-backend flashinfer --enable-pdmux --sm-group-num 4 --page-size 16
timeout 240 python3 benchmarks/attention_kernels.py --out "$OUT" > "$OUT/attention_kernels.log" 2>&1
echo "attention_kernels rc=$? at $(el)" | tee -a $S; grep -v "jit_variant\|jit_heartbeat" "$OUT/attention_kernels.log" | tail -n 40 >> $S
tar -czf "$OUT/logs.tgz" -C $W . ; echo "total $(el)" | tee -a $S
