#!/bin/bash
# One H200 call for issue 16's FlashInfer / fp8-KV / MLA part (run from the repository root on the GPU machine):
#   source .whl/prelude.sh; source .whl/aot.sh; restore_aot; bash benchmarks/gpu_p4fi_check.sh "$OUT" [all|tests|bench]
# tests: tests/gpu/test_flashinfer_mla_fp8_gpu.py (MLA through flashinfer / triton / torch_native over one latent
#        buffer, 16 and 128 heads, ctx to 32k, pages 1/16/64, eager + graph replay; fp8 e4m3/e5m2 with scales,
#        GQA 32/8 and MHA, both decode paths), the GPU record claims for MLA and fp8 (tests/test_capabilities.py),
#        and the bundled runs of DeepSeek-V2-Lite / V3 and fp8 KV (tests/gpu/test_bundled_run_gpu.py).
# bench: the issue's commands (run --device cuda for DeepSeek-V2-Lite and -V3 --num-layers 2, plan h200 fp8, run
#        --device cuda fp8) and benchmarks/flashinfer_mla_fp8.py (JSON in $OUT/flashinfer_mla_fp8.json).
# Every step has a hard timeout so the call ends inside the 10-minute limit; logs land in $OUT.
OUT=${1:?usage: gpu_p4fi_check.sh OUTDIR [all|tests|bench]}; WHAT=${2:-all}
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
S=$OUT/p4fi_summary.txt
if [ "$WHAT" != bench ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_flashinfer_mla_fp8_gpu.py -p no:cacheprovider -rfE \
    --durations=10 > "$OUT/pytest_p4fi.log" 2>&1
  echo "pytest mla/fp8 rc=$? at $(el)" | tee -a $S; tail -n 30 "$OUT/pytest_p4fi.log" >> $S
  timeout 120 python3 -m pytest -q -m gpu tests/test_capabilities.py -k "gpu_record_claims_run and (fp8 or mla)" \
    -p no:cacheprovider -rfE > "$OUT/pytest_p4fi_claims.log" 2>&1
  echo "pytest claims rc=$? at $(el)" | tee -a $S; tail -n 12 "$OUT/pytest_p4fi_claims.log" >> $S
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_bundled_run_gpu.py -k "deepseek or kv-cache" \
    -p no:cacheprovider -rfE > "$OUT/pytest_p4fi_runs.log" 2>&1
  echo "pytest bundled runs rc=$? at $(el)" | tee -a $S; tail -n 12 "$OUT/pytest_p4fi_runs.log" >> $S
fi
if [ "$WHAT" != tests ]; then
  show(){ python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ok'], (d.get('resolved') or {}).get('prefill'), (d.get('resolved') or {}).get('decode'), [(v['role'], round(v['max_rel_err'],5), v['passed']) for v in d.get('verified', [])], [(s['step'], s['graph'], round(s['max_rel_err'],4)) for s in d.get('model_steps', [])], d.get('error') and d['error']['message'][:300])" "$1" 2>&1; }
  cmd(){ name=$1; shift; timeout 90 python3 -m pipeline.cli "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.err"
    echo "$name rc=$? at $(el): $(show "$OUT/$name.json")" | tee -a $S; }
  cmd run_dsv2lite run --device cuda --model examples/configs/deepseek-v2-lite.json
  cmd run_dsv3 run --device cuda --model examples/configs/deepseek-v3.json --num-layers 2
  cmd run_fp8_e4m3 run --device cuda --kv-cache-dtype fp8_e4m3 --page-size 16
  cmd plan_fp8 plan --device-profile h200 --installed torch,triton,flashinfer-python --kv-cache-dtype fp8_e4m3
  timeout 240 python3 benchmarks/flashinfer_mla_fp8.py --out "$OUT" > "$OUT/flashinfer_mla_fp8.log" 2>&1
  echo "bench rc=$? at $(el)" | tee -a $S; tail -n 45 "$OUT/flashinfer_mla_fp8.log" >> $S
fi
echo "total $(el)" | tee -a $S
