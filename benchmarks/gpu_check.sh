#!/bin/bash
# The one GPU check: named parts, each one device call inside the 10-minute limit (see benchmarks/README.md).
# On the GPU machine, from the repository root, with .whl carried (FlashInfer 0.7.2 as .whl/flashinfer-0.7.2.tar.xz,
# which .whl/prelude.sh unpacks into /tmp/site with its dist-info):
#   source .whl/prelude.sh; bash benchmarks/gpu_check.sh PART "$OUT"
# PART:
#   warm       compile the FlashInfer variants the other parts use: `attn-setup warmup` per bundled config and mode,
#              8 processes at a time (each variant compiles once; then save-aot brings them back) -> warm_*.log
#   probe      the short FlashInfer compatibility probe to run first on a new FlashInfer: tests/gpu/test_flashinfer_api.py
#              (installed version, JIT module names, every wrapper kind warns nothing: GQA, sinks, MLA) -> probe.log
#   tests      every GPU-marked test except the Triton kernel files (tests/gpu/, the capability records' GPU claims,
#              kv_indices on CUDA)                                              -> $OUT/tests.log
#   kernels    the Triton kernel GPU tests (tests/gpu/test_triton_gpu.py, test_triton_mla_gpu.py)  -> kernels.log
#   runs       `attn-setup run --device cuda` per backend and mode (flashinfer with graphs, auto, fa3, triton, TBO,
#              PD-mux, fa3+triton hybrid, Gemma-2, gpt-oss, DeepSeek-V2-Lite/V3 MLA, fp8 KV) -> one line each
#              (ok, resolved pair, verification errors), traces in $OUT/traces/
#   bundled    benchmarks/gpu_bundled_configs.py: every bundled config with the default choice -> $OUT/bundled/
#   bench      CUDA-graph decode per backend, startup, wrapper overhead                -> bench_*.json / *.log
#   triton     benchmarks/triton_kernels.py --sweep and benchmarks/mla_decode.py --sweep (FlashInfer modules warmed and
#              our variants precompiled in parallel first)                              -> triton_kernels.*, mla_*
#   mla-fp8    benchmarks/flashinfer_mla_fp8.py (FlashInfer MLA and fp8-KV decode tables) -> flashinfer_mla_fp8.*
#   startup    startup accounting with a cold then a warm FlashInfer JIT cache (benchmarks/startup_coverage.py),
#              plan --require-warm-cache before (exit 3) and after warmup (exit 0), tests/gpu/test_startup_gpu.py
#                                                                                       -> startup.log
#   spec       speculative decoding: tests/gpu/test_speculative_gpu.py (EAGLE trees and draft branches, flashinfer and
#              triton, eager and CUDA-graph replay)                                    -> spec.log
#   spec-bench `run` with the EAGLE flags (flashinfer and triton target workers, a draft worker) and
#              benchmarks/speculative_trees.py (the backends x shapes x graph table)   -> spec_trees.log/.json
#   auto       benchmarks/auto_evidence.py: --warm (every case built and run once: JIT compiles), then the measured
#              table auto orders by                  -> $OUT/auto_evidence.json (copy to pipeline/data/), auto_*.log
#   save-aot   pack the FlashInfer JIT modules compiled here into $OUT/fi-aot-<version>.txz.part-* (carry them back
#              into .whl/)
# pytest parts run GPU_TEST_PROCS (default 4) worker processes (pytest-xdist, carried in .whl).
# Every part first restores the carried FlashInfer AOT modules of the installed FlashInfer version
# (.whl/fi-aot-<version>.t{gz,xz}.part-*), so nothing is JIT-compiled that was compiled before. Modules of another
# version are never restored: FlashInfer loads <package>/data/aot/<module>/<module>.so by name, and many names (decode,
# fa3 prefill) did not change from 0.6.13 to 0.7.2 while the code did. The unversioned .whl/fi-aot.t{gz,xz}.part-* of
# earlier sessions hold 0.6.13 modules. Every step has a hard timeout. $OUT/summary.txt collects the lines that say
# pass/fail and the tables.
PART=${1:?usage: gpu_check.sh warm|probe|tests|kernels|runs|bundled|bench|triton|mla-fp8|startup|spec|spec-bench|auto|save-aot OUTDIR}
OUT=${2:?usage: gpu_check.sh PART OUTDIR}
case $PART in warm|probe|tests|kernels|runs|bundled|bench|triton|mla-fp8|startup|spec|spec-bench|auto|save-aot) ;;
  *) echo "unknown part '$PART' (warm|probe|tests|kernels|runs|bundled|bench|triton|mla-fp8|startup|spec|spec-bench|auto|save-aot)" >&2; exit 2 ;; esac
mkdir -p "$OUT"; S=$OUT/summary.txt; T0=$(date +%s)
el(){ echo "$(( $(date +%s) - T0 )) s"; }
note(){ echo "$*" | tee -a "$S"; }
FIV=$(python3 -c "import importlib.metadata as m; print(m.version('flashinfer-python'))" 2>/dev/null || echo none)
AOT=/tmp/site/flashinfer/data/aot; mkdir -p $AOT
if ls .whl/fi-aot-"$FIV".tgz.part-* >/dev/null 2>&1; then cat .whl/fi-aot-"$FIV".tgz.part-* | tar -xz -C $AOT; fi
if ls .whl/fi-aot-"$FIV".txz.part-* >/dev/null 2>&1; then cat .whl/fi-aot-"$FIV".txz.part-* | xz -d -T0 | tar -x -C $AOT; fi
if ls .whl/fi-aot.t?z.part-* >/dev/null 2>&1; then note "not restored: .whl/fi-aot.t?z.part-* (unversioned: 0.6.13 modules)"; fi
note "part $PART; flashinfer $FIV; AOT modules restored: $(ls $AOT | wc -l)"

pytest_part(){ name=$1; shift
  timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=10 -n ${GPU_TEST_PROCS:-4} "$@" > "$OUT/$name.log" 2>&1
  note "pytest $name rc=$? at $(el)"; tail -n 30 "$OUT/$name.log" >> "$S"; }

show(){ python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d.get('resolved') or {}; print(d['ok'], \
r.get('prefill'), r.get('decode'), [(v['role'], round(v['max_rel_err'], 5), v['passed']) for v in d.get('verified', [])], \
[(s['step'], s['graph'], round(s['max_rel_err'], 4)) for s in d.get('model_steps', [])][:6], \
d.get('error') and d['error']['message'][:300])" "$1" 2>&1; }
run(){ name=$1; shift; mkdir -p "$OUT/traces"
  timeout 75 python3 -m pipeline.cli run --device cuda --json --log-file "$OUT/traces/$name.jsonl" "$@" \
    > "$OUT/$name.json" 2> "$OUT/$name.err"
  note "run $name rc=$? at $(el): $(show "$OUT/$name.json")"; }

C=examples/configs
case $PART in
  warm)
    W="--device cuda --page-size 16 --jobs 2"
    { for m in llama-3.1-8b gemma-2-9b gemma-3-12b-it gpt-oss-20b deepseek-v2-lite deepseek-v3 qwen3-next-80b-a3b-instruct \
               llama-4-scout-17b-16e-instruct mistral-7b-v0.1 qwen2.5-7b; do
        echo "$m --attention-backend flashinfer --model $C/$m.json"; done
      echo "llama-fa3 --attention-backend fa3"
      echo "llama-hybrid --prefill-attention-backend fa3 --decode-attention-backend triton"
      echo "llama-fp8e4 --attention-backend flashinfer --kv-cache-dtype fp8_e4m3"
      echo "llama-fp8e5 --attention-backend flashinfer --kv-cache-dtype fp8_e5m2"
      echo "llama-pdmux --attention-backend flashinfer --enable-pdmux --sm-group-num 4"
      echo "llama-spec --attention-backend flashinfer --speculative-algorithm EAGLE --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --speculative-num-steps 3"
      echo "llama-spec-draft --draft-worker --speculative-algorithm EAGLE --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --speculative-num-steps 3"
      echo "gemma2-auto --model $C/gemma-2-9b.json"; echo "gptoss-auto --model $C/gpt-oss-20b.json"
    } | while read -r name args; do echo "$name|$args"; done | sort -t'|' -k1,1 -s | awk '/fa3|spec|hybrid/{print; next} {r=r $0 "\n"} END{printf "%s", r}' > /tmp/warm.list
    timeout 330 xargs -P 8 -a /tmp/warm.list -I{} bash -c 'n=${1%%|*}; a=${1#*|}; timeout 280 python3 -m pipeline.cli warmup '"$W"' $a \
      > "'"$OUT"'/warm_$n.log" 2>&1; echo "warm $n rc=$?"' _ {} | tee -a "$S"
    note "warm done at $(el)" ;;
  probe)
    pytest_part probe tests/gpu/test_flashinfer_api.py -k "not fa3 and (supported_one or own or gqa or sinks or mla or \
workspace)" ;;
  tests)
    pytest_part tests tests/gpu tests/test_capabilities.py tests/test_kv_indices.py \
      --ignore=tests/gpu/test_triton_gpu.py --ignore=tests/gpu/test_triton_mla_gpu.py \
      --ignore=tests/gpu/test_speculative_gpu.py ;;
  kernels)
    pytest_part kernels tests/gpu/test_triton_gpu.py tests/gpu/test_triton_mla_gpu.py ;;
  runs)
    run h200_flashinfer --attention-backend flashinfer --page-size 16 --num-layers 4 --cuda-graph-bs 1 2 4 8
    run h200_auto --page-size 16
    run h200_fa3 --attention-backend fa3 --page-size 16 --cuda-graph-bs 1 4
    run h200_triton --attention-backend triton --page-size 16 --cuda-graph-bs 1 4
    run h200_tbo --attention-backend flashinfer --enable-two-batch-overlap --moe-a2a-backend deepep --page-size 16
    run h200_pdmux4 --attention-backend flashinfer --enable-pdmux --sm-group-num 4 --page-size 16
    run h200_hybrid --prefill-attention-backend fa3 --decode-attention-backend triton --page-size 16 --cuda-graph-bs 1 4
    run h200_gemma2_fi --attention-backend flashinfer --model $C/gemma-2-9b.json --dtype bfloat16 --page-size 16
    run h200_gptoss --model $C/gpt-oss-20b.json --page-size 16
    run h200_dsv2lite --model $C/deepseek-v2-lite.json
    run h200_dsv3 --model $C/deepseek-v3.json --num-layers 2
    run h200_fp8_e4m3 --kv-cache-dtype fp8_e4m3 --page-size 16 ;;
  bundled)
    timeout 560 python3 benchmarks/gpu_bundled_configs.py --out "$OUT/bundled" --timeout 150 > "$OUT/bundled.log" 2>&1
    note "gpu_bundled_configs rc=$? at $(el)"; grep -v '^done ' "$OUT/bundled.log" >> "$S" ;;
  bench)
    for b in flashinfer triton; do
      timeout 100 python3 benchmarks/cuda_graph_decode.py --backend $b --json "$OUT/bench_graph_$b.json" \
        > "$OUT/bench_graph_$b.log" 2>&1
      note "cuda_graph_decode $b rc=$? at $(el)"; tail -n 8 "$OUT/bench_graph_$b.log" >> "$S"
    done
    timeout 120 python3 benchmarks/startup.py --backend flashinfer --runs 3 > "$OUT/startup.log" 2>&1
    note "startup rc=$? at $(el)"; tail -n 8 "$OUT/startup.log" >> "$S"
    timeout 200 python3 benchmarks/wrapper_overhead.py --out "$OUT/wrapper" > "$OUT/wrapper_overhead.log" 2>&1
    note "wrapper_overhead rc=$? at $(el)"; tail -n 20 "$OUT/wrapper_overhead.log" >> "$S" ;;
  triton)
    SWEEP=${SWEEP---sweep}   # SWEEP= (empty): the default shapes only, about half the time
    mkdir -p "$OUT/fi_ok"
    for w in $(python3 benchmarks/triton_kernels.py --warm list); do
      timeout 140 python3 benchmarks/triton_kernels.py --warm "$w" --fi-ok "$OUT/fi_ok" > "$OUT/warm_$w.log" 2>&1 &
    done
    timeout 140 python3 benchmarks/mla_decode.py --warm > "$OUT/warm_mla.log" 2>&1 &
    timeout 160 python3 benchmarks/triton_kernels.py $SWEEP --precompile 5 --precompile-only > "$OUT/precompile_tk.log" 2>&1 &
    timeout 160 python3 benchmarks/mla_decode.py $SWEEP --precompile 5 --precompile-only > "$OUT/precompile_mla.log" 2>&1 &
    wait; note "warm-ups and precompiles done at $(el); flashinfer modules ready: $(ls "$OUT/fi_ok" | tr '\n' ' ')"
    timeout 200 python3 benchmarks/triton_kernels.py --runs 3 $SWEEP --fi-ok "$OUT/fi_ok" --out "$OUT" \
      > "$OUT/triton_kernels.log" 2>&1
    note "triton_kernels rc=$? at $(el)"; sed -n '/^targets/,$p' "$OUT/triton_kernels.log" | head -60 >> "$S"
    timeout 150 python3 benchmarks/mla_decode.py $SWEEP --out "$OUT" > "$OUT/mla_bench.log" 2>&1
    note "mla_decode rc=$? at $(el)"; grep -E "^sweep |^target|^device" "$OUT/mla_bench.log" >> "$S" ;;
  mla-fp8)
    timeout 400 python3 benchmarks/flashinfer_mla_fp8.py --out "$OUT" > "$OUT/flashinfer_mla_fp8.log" 2>&1
    note "flashinfer_mla_fp8 rc=$? at $(el)"; tail -n 45 "$OUT/flashinfer_mla_fp8.log" >> "$S" ;;
  startup)
    ( export FLASHINFER_WORKSPACE_BASE=$(mktemp -d)   # an empty FlashInfer JIT cache: the first run compiles
      F="--attention-backend flashinfer --cuda-graph-bs 1 2 4 8"
      echo "== plan, cold cache (expect exit 3, cold_jit_cache)"
      timeout 60 python3 -m pipeline.cli plan --device-profile auto $F --require-warm-cache --json | head -c 1500
      echo " rc=${PIPESTATUS[0]}"
      echo "== coverage, cold cache (compiles)"
      timeout 200 python3 benchmarks/startup_coverage.py --device cuda --extra="$F" --configs llama-3.1-8b
      echo "== coverage, warm cache (the same variants, now cached)"
      timeout 120 python3 benchmarks/startup_coverage.py --device cuda --extra="$F" --configs llama-3.1-8b
      echo "== warmup (records compile seconds), then plan --require-warm-cache (expect exit 0)"
      timeout 120 python3 -m pipeline.cli warmup $F --json | head -c 1500; echo
      timeout 60 python3 -m pipeline.cli plan --device-profile auto $F --require-warm-cache >/dev/null; echo "plan rc=$?"
      echo "== GPU test"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_startup_gpu.py -s 2>&1 | tail -5
    ) > "$OUT/startup.log" 2>&1
    note "startup at $(el)"; grep -E "rc=|coverage|unaccounted|passed|failed" "$OUT/startup.log" >> "$S" ;;
  spec)
    pytest_part spec tests/gpu/test_speculative_gpu.py ;;
  spec-bench)
    E="--speculative-algorithm EAGLE --speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --speculative-num-steps 3"
    run h200_spec_flashinfer --attention-backend flashinfer --page-size 16 --num-layers 4 --cuda-graph-bs 1 2 4 8 $E
    run h200_spec_triton --attention-backend triton --page-size 16 --cuda-graph-bs 1 2 4 8 $E
    run h200_spec_draft --draft-worker --page-size 16 --cuda-graph-bs 1 2 4 8 $E
    timeout 360 python3 benchmarks/speculative_trees.py --out "$OUT/spec_trees.json" > "$OUT/spec_trees.log" 2>&1
    note "speculative_trees rc=$? at $(el)"; tail -n 26 "$OUT/spec_trees.log" >> "$S" ;;
  auto)
    timeout 330 python3 benchmarks/auto_evidence.py --warm > "$OUT/auto_warm.log" 2>&1
    note "auto_evidence --warm rc=$? at $(el)"; grep failed "$OUT/auto_warm.log" >> "$S"
    timeout 200 python3 benchmarks/auto_evidence.py --out "$OUT/auto_evidence.json" > "$OUT/auto_evidence.log" 2>&1
    note "auto_evidence rc=$? at $(el)"; cat "$OUT/auto_evidence.log" >> "$S" ;;
  save-aot)
    # this FlashInfer version's modules only: the JIT cache keeps one directory per version
    st=/tmp/aotstage; rm -rf $st; mkdir -p $st; cp -r $AOT/. $st/ 2>/dev/null
    for so in $(find "${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}/.cache/flashinfer/$FIV" -path '*cached_ops*' -name '*.so' \
                2>/dev/null); do
      n=$(basename "$(dirname "$so")"); mkdir -p $st/$n; cp "$so" $st/$n/; done
    tar -c -C $st . | xz -9 -T0 > /tmp/fi-aot.txz && split -b 15M /tmp/fi-aot.txz "$OUT/fi-aot-$FIV.txz.part-"
    note "aot saved: $(ls $st | wc -l) modules of flashinfer $FIV" ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$S" 2>&1
note "total $(el)"
