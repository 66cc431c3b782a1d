#!/bin/bash
# H200: cleanup check of issue 8 (memory back to baseline after faults), plus the FlashInfer GPU tests again.
#   source .whl/prelude.sh; bash benchmarks/gpu_release_check.sh "$OUT"
OUT=${1:?usage: gpu_release_check.sh OUTDIR}
mkdir -p /tmp/site/flashinfer/data/aot && cat .whl/fi-aot.tgz.part-* 2>/dev/null | tar xz -C /tmp/site/flashinfer/data/aot
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_release_gpu.py tests/gpu/test_flashinfer_gpu.py -p no:cacheprovider -rfE \
  > "$OUT/pytest_release.log" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_release.log" | tail -15
