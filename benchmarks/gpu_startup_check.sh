#!/usr/bin/env bash
# Issue 18 on the H200, one call (< 4 min): startup coverage for flashinfer with decode graphs, cold then warm
# JIT cache, --require-warm-cache before/after warmup, and the GPU test of graph bytes / JIT accounting.
#   bash benchmarks/gpu_startup_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
export FLASHINFER_WORKSPACE_BASE=$(mktemp -d)   # an empty FlashInfer cache: the first run compiles
FLAGS="--attention-backend flashinfer --cuda-graph-bs 1 2 4 8"
echo "== plan, cold cache (expect exit 3, cold_jit_cache)"
python3 -m pipeline.cli plan --device-profile auto $FLAGS --require-warm-cache --json | head -c 1500; echo " rc=${PIPESTATUS[0]}"
echo "== coverage, cold cache (compiles)"
python3 benchmarks/startup_coverage.py --device cuda --extra="$FLAGS" --configs llama-3.1-8b
echo "== coverage, warm cache (the same variants, now cached)"
python3 benchmarks/startup_coverage.py --device cuda --extra="$FLAGS" --configs llama-3.1-8b
echo "== warmup (records compile seconds), then plan --require-warm-cache (expect exit 0)"
python3 -m pipeline.cli warmup $FLAGS --json | head -c 1500; echo
python3 -m pipeline.cli plan --device-profile auto $FLAGS --require-warm-cache >/dev/null; echo "plan rc=$?"
echo "== GPU test"
python3 -m pytest -q -m gpu tests/gpu/test_startup_gpu.py -s 2>&1 | tail -5
