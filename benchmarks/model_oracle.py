"""Each model's attention through a backend vs the model's own eager attention in transformers, on a GPU.

For every config (default: the bundled examples/configs), :func:`pipeline.runtime.model_oracle.check_model` builds the
transformers model (random weights, layers cut to cover every kind, MLP / vocabulary / experts shrunk, attention
untouched; float32 eager reference) and runs each attention layer through ``--backend`` (q, k, v and the paged KV pool
in ``--dtype``) with our reading of the layer. The prompt is one past the largest window or chunk (capped by
``--max-seq``), so windows and chunks are exercised. Prints one row per config and backend: layers checked, the
worst relative error (max|ours-ref| / max|ref|), the dtype's tolerance, and the first mismatch or error.

Usage: ``python benchmarks/model_oracle.py [--backend flashinfer --backend fa3 --backend triton] [--dtype bfloat16]
[--max-seq 8200] [CONFIG ...]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=sorted(str(p) for p in (ROOT / "examples" / "configs").glob("*.json")))
    ap.add_argument("--backend", action="append", default=[])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-seq", type=int, default=8200)
    ns = ap.parse_args()
    import torch

    from pipeline.runtime.model_oracle import check_model

    dtype = getattr(torch, ns.dtype)
    rows, failed = [], 0
    for cfg in ns.configs:
        for backend in ns.backend or ["flashinfer", "fa3", "triton"]:
            t = time.perf_counter()
            try:
                res = check_model(cfg, backend, device=ns.device, backend_dtype=dtype, max_seq=ns.max_seq)
                bad = [r for r in res if not r.passed]
                worst = max(r.rel_err for r in res)
                note = (bad[0].mismatch or f"layer {bad[0].layer_id} err {bad[0].rel_err:.2e}") if bad else ""
                rows.append((Path(cfg).stem, backend, len(res), res[0].seq, f"{worst:.2e}", f"{res[0].tol:.0e}",
                             "yes" if not bad else "NO", note, time.perf_counter() - t))
                failed += bool(bad)
            except Exception as e:  # noqa: BLE001 - a refusal or a crash is a row too
                rows.append((Path(cfg).stem, backend, 0, 0, "-", "-", "NO", f"{type(e).__name__}: {str(e)[:90]}",
                             time.perf_counter() - t))
                failed += 1
            r = rows[-1]
            print(f"{r[0]:<40} {r[1]:<11} {r[2]:>3} {r[3]:>5} {r[4]:>9} {r[5]:>6} {r[6]:>4}  {r[8]:5.1f}s  {r[7]}",
                  flush=True)
    print(f"{len(rows) - failed} of {len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
