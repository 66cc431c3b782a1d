#!/bin/bash
# Issue 13 §2-3 on one H200 (run from the repository root on the GPU machine):
#   source .whl/prelude.sh; bash benchmarks/gpu_layer_kinds_check.sh "$OUT"
# 1) the GPU tests of chunked local attention in our Triton kernels (decode grid, extend grid, CUDA-graph
#    replay) and every triton capability claim (chunked_local_attention included);
# 2) `attn-setup run --device cuda` for the bundled hybrid / chunked / per-layer-sliding configs and for
#    Gemma-2 with --dtype auto (now bfloat16); each prints ok, the resolved pair with dtype + rule and the
#    not-attention layers, and every verification error.
# Outputs: $OUT/pytest_chunked.log, $OUT/summary.txt, $OUT/traces.tgz.
OUT=${1:?usage: gpu_layer_kinds_check.sh OUTDIR}
W=/tmp/gpu_layer_kinds; mkdir -p $W/traces
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
S=$OUT/summary.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/gpu/test_triton_gpu.py \
  "tests/test_capabilities.py::test_gpu_record_claims_run" -k "chunked or triton" > "$OUT/pytest_chunked.log" 2>&1
echo "pytest chunked/triton rc=$? at $(el)" | tee -a $S; tail -n 15 "$OUT/pytest_chunked.log" >> $S
run(){ name=$1; shift
  timeout 75 python3 -m pipeline.cli run --device cuda --json --log-file "$W/traces/$name.jsonl" "$@" > "$W/$name.json" 2> "$W/$name.err"
  echo "run $name rc=$? at $(el): $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['resolved'] or {}; print(d['ok'], r.get('prefill'), r.get('decode'), r.get('dtype'), [(g['kind'], len(g['layer_ids'])) for g in r.get('not_attention', [])], [(v['role'], round(v['max_rel_err'],5), v['detail'][-60:]) for v in d['verified']], [(s['step'], s['graph'], round(s['max_rel_err'],4)) for s in d.get('model_steps', [])][:6], d['error'] and d['error']['message'][:300])" "$W/$name.json" 2>&1)" | tee -a $S; }
C=examples/configs
run h200_qwen3next_auto --model $C/qwen3-next-80b-a3b-instruct.json --page-size 16 --cuda-graph-bs 1 4
run h200_llama4_auto --model $C/llama-4-scout-17b-16e-instruct.json --page-size 16 --cuda-graph-bs 1 4
run h200_llama4_triton_p1 --model $C/llama-4-scout-17b-16e-instruct.json --attention-backend triton --page-size 1
run h200_gemma3_triton --model $C/gemma-3-12b-it.json --attention-backend triton --page-size 16 --cuda-graph-bs 1 4
run h200_gemma3_auto --model $C/gemma-3-12b-it.json --page-size 16
run h200_gemma2_auto_triton --model $C/gemma-2-9b.json --attention-backend triton --page-size 16
run h200_gemma2_auto --model $C/gemma-2-9b.json --page-size 16
for m in qwen3-next-80b-a3b-instruct llama-4-scout-17b-16e-instruct gemma-3-12b-it gemma-2-9b; do
  echo "plan $m: $(python3 -m pipeline.cli plan --device-profile auto --model $C/$m.json --json | python3 -c "import json,sys; d=json.load(sys.stdin); r=d.get('resolved') or {}; print(d['ok'], r.get('prefill'), r.get('dtype'), [(x['backend']) for x in d.get('rejected', {}).get('decode', [])])")" | tee -a $S
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
tar -czf "$OUT/traces.tgz" -C $W . ; echo "total $(el)" | tee -a $S
