#!/bin/bash
# Two GPUs (run from the repository root on a 2-GPU machine, e.g. nvidia-h200-x2):
#   source .whl/prelude.sh; bash benchmarks/two_gpu_check.sh "$OUT"
# Under `torchrun --nproc-per-node 2` (NCCL world group, gloo CPU group), launches of `attn-setup run`:
#   ok          --tp-size 2, flashinfer, page 16, CUDA graphs for bs 1 2 4 8: both ranks exit 0 (memory_balanced,
#               resolution_agreed, graphs captured after the pre-capture barrier; each rank 16 of Llama-3.1-8B's 32
#               heads and 4 of its 8 kv heads, instance_verified for its shard and for role world.tp)
#   tp2_triton  the same with triton
#   mla         --tp-size 2 DeepSeek-V2-Lite (MLA, 8 of 16 heads per rank, the latent cache on both), flashinfer
#   mla_triton  the same with triton
#   pp2         --pp-size 2, flashinfer: rank 0 layers 0-15, rank 1 layers 16-31 (world.tp: each stage alone vs all heads)
#   layout      rank 1 asks for --tp-size 1 --pp-size 2: both ranks exit 3 (rank_divergence naming args.tp_size,
#               args.pp_size and shard)
#   backend     rank 1 asks for triton: both ranks exit 3 (rank_divergence naming args.attention_backend)
#   pool        rank 1 has --max-reqs 16: both ranks exit 3 (rank_divergence naming pool.max_reqs, cuda_graph_bs)
#   stall       rank 1 sleeps 20 s in resolve, --dist-timeout 8: rank 0 exits 1 with rank_stalled naming rank 1,
#               last state resolve, doing "injected sleep (two_gpu_check)", within 8 s + one heartbeat
# Prints a summary table (also $OUT/two_gpu_summary.txt: exit codes, error codes, every verified instance and the
# world.tp check per rank) and copies the successful launches' traces to $OUT/h200_{tp2_flashinfer,tp2_triton,
# tp2_mla_flashinfer,tp2_mla_triton,pp2_flashinfer}_rank{0,1}.jsonl (check them into tests/data/golden/: test_replay
# replays every *.jsonl).
OUT=${1:?usage: two_gpu_check.sh OUTDIR}
W=/tmp/two_gpu; rm -rf $W; mkdir -p $W
# FlashInfer AOT kernels carried in .whl (as the other GPU scripts restore them: gz or xz parts)
AOT=/tmp/site/flashinfer/data/aot; mkdir -p $AOT
ls .whl/fi-aot.tgz.part-* >/dev/null 2>&1 && cat .whl/fi-aot.tgz.part-* | tar -xz -C $AOT
ls .whl/fi-aot.txz.part-* >/dev/null 2>&1 && cat .whl/fi-aot.txz.part-* | xz -d -T0 | tar -x -C $AOT
echo "aot modules: $(ls $AOT | wc -l)"
T0=$(date +%s); el(){ echo "$(( $(date +%s) - T0 )) s"; }
launch(){ name=$1; shift; mkdir -p $W/$name
  ATTN_SETUP_RUN_ID=h200-tp2-$name timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/two_gpu_rank.py $W/$name "$@" > $W/$name/stdout.txt 2> $W/$name/stderr.txt
  echo "launch $name torchrun rc=$? at $(el)"; }
# DEVICE/BACKEND/ALT exist so the script can be smoke-tested on CPU (DEVICE=cpu BACKEND=torch_native); defaults are the GPU run
DEVICE=${DEVICE:-cuda}; BACKEND=${BACKEND:-flashinfer}; ALT=${ALT:-triton}
COMMON="run --device $DEVICE --json --page-size 16 --num-layers 4"
V2L=examples/configs/deepseek-v2-lite.json
launch ok -- $COMMON --tp-size 2 --attention-backend $BACKEND --cuda-graph-bs 1 2 4 8 --log-file "$W/ok/{run_id}.rank{rank}.jsonl"
launch tp2_triton -- $COMMON --tp-size 2 --attention-backend $ALT --cuda-graph-bs 1 2 4 8 --log-file "$W/tp2_triton/{run_id}.rank{rank}.jsonl"
launch mla -- $COMMON --tp-size 2 --model $V2L --attention-backend $BACKEND --cuda-graph-bs 1 2 4 8 --log-file "$W/mla/{run_id}.rank{rank}.jsonl"
launch mla_triton -- $COMMON --tp-size 2 --model $V2L --attention-backend $ALT --cuda-graph-bs 1 2 4 8 --log-file "$W/mla_triton/{run_id}.rank{rank}.jsonl"
launch pp2 -- $COMMON --pp-size 2 --attention-backend $BACKEND --cuda-graph-bs 1 2 4 8 --log-file "$W/pp2/{run_id}.rank{rank}.jsonl"
launch layout --on-rank 1 "--tp-size 1 --pp-size 2" -- $COMMON --attention-backend $BACKEND --log-file "$W/layout/{run_id}.rank{rank}.jsonl"
launch backend --on-rank 1 "--attention-backend $ALT" -- $COMMON --attention-backend $BACKEND --log-file "$W/backend/{run_id}.rank{rank}.jsonl"
launch pool --on-rank 1 "--max-reqs 16" -- $COMMON --attention-backend $BACKEND --log-file "$W/pool/{run_id}.rank{rank}.jsonl"
launch stall --stall-rank 1 20 -- $COMMON --attention-backend $BACKEND --dist-timeout 8 --log-file "$W/stall/{run_id}.rank{rank}.jsonl"
python3 - "$W" <<'PY' | tee "$OUT/two_gpu_summary.txt"
import json, subprocess, sys
from pathlib import Path
W = Path(sys.argv[1])
print(f"{'launch':8} {'rank':4} {'exit':4} {'status':10} {'code':16} {'last state':20} {'waited for':10} detail")
for name in ("ok", "tp2_triton", "mla", "mla_triton", "pp2", "layout", "backend", "pool", "stall"):
    logs = sorted(str(p) for p in (W / name).glob("*.jsonl"))
    if not logs:
        print(f"{name:8} no traces; stderr tail: {(W / name / 'stderr.txt').read_text()[-400:]!r}"); continue
    rep = json.loads(subprocess.run([sys.executable, "-m", "pipeline.cli", "inspect", "--json", *logs],
                                    capture_output=True, text=True).stdout)
    rows = {r["rank"]: r for r in rep["ranks"]}
    for run in rep["runs"]:
        f = run["failure"] or {}
        flags = {x["name"]: x["value"] for x in f.get("flags", [])}
        detail = (flags.get("diverging") or (f"stalled_rank={flags.get('stalled_rank')} last_state={flags.get('last_state')} "
                  f"since_hb={flags.get('seconds_since_heartbeat')} doing={flags.get('doing')!r}" if f.get("code") == "rank_stalled" else ""))
        ex = (W / name / f"exit.rank{run['rank']}")
        print(f"{name:8} {run['rank']:<4} {ex.read_text() if ex.exists() else '-':4} {run['status']:10} {f.get('code', '-'):16} "
              f"{rows.get(run['rank'], {}).get('last_state', run['last_state']):20} {str(rows.get(run['rank'], {}).get('waited_for', '')):10} {detail}")
    for line in (W / name / "stdout.txt").read_text().splitlines():
        if line.startswith("{"):
            got = json.loads(line)
            for v in got.get("verified", []):
                print(f"{name:8} verified {v['role']:10} {v['backend']:12} max_rel_err {v['max_rel_err']:.2e} "
                      f"tol {v['tol']:.0e} {'PASS' if v['passed'] else 'FAIL'} {v['detail'][:90]}")
    for cp in rep["critical_path"]:
        print(f"{name:8} critical path total {cp['total_ms']:.1f} ms: " + ", ".join(f"{s['state']}=r{s['rank']}:{s['duration_ms']:.0f}" for s in cp["states"]))
PY
for pair in ok:tp2_flashinfer tp2_triton:tp2_triton mla:tp2_mla_flashinfer mla_triton:tp2_mla_triton pp2:pp2_flashinfer; do
  name=${pair%%:*}; gold=${pair#*:}
  for r in 0 1; do cp $W/$name/h200-tp2-$name.rank$r.jsonl "$OUT/h200_${gold}_rank$r.jsonl"; done
  python3 -m pipeline.cli replay $W/$name/*.jsonl | tee -a "$OUT/two_gpu_summary.txt"
done
tar -czf "$OUT/two_gpu_logs.tgz" -C $W . ; ls -la $OUT; echo "total $(el)"
