"""EAGLE trees on the target and draft branches on the draft: backends x tree shapes x eager / CUDA graph.

For each backend (flashinfer, triton) and shape (steps, top-k, draft tokens — a chain, sglang's Llama default, wider
and deeper trees), one attention layer of Llama-3.1-8B's shape (32 q heads, 8 kv heads, head dim 128, bf16, page 16)
runs a target verify of random trees of that size for a batch of requests over ragged cached prefixes, eager and
replayed from a CUDA graph (captured with sglang's hooks, replayed for a new batch after the replay metadata); and a
draft-decode step of top-k branches at the shape's last step. Each output row is compared with the float64 reference
that applies the tree mask (:mod:`pipeline.runtime.spec_check`); the time is the median layer call (CUDA events; a
graph: the replay). Prints a markdown table (paste it into benchmarks/RESULTS.md) and writes JSON to ``--out``.
Exit 1 when a row is beyond its tolerance (1e-2).

On the H200, from the repository root::

    python benchmarks/speculative_trees.py --out spec_trees.json
    python benchmarks/speculative_trees.py --bs 1 8 64 --prefix 1024 --out spec_trees.json   # other batches
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipeline.core.contracts import LayerKind, SpeculativeParams  # noqa: E402
from pipeline.runtime.spec_check import backend_over, check_draft, check_verify, draft_scratch, make_pools  # noqa: E402

TOL = 1e-2
SHAPES = {  # steps x top-k / draft tokens -> (num_steps, topk, num_draft_tokens)
    "3x1/4": (3, 1, 4),      # a chain
    "5x4/8": (5, 4, 8),      # sglang's default for Llama
    "3x4/16": (3, 4, 16),
    "4x8/64": (4, 8, 64),
    "6x10/60": (6, 10, 60),
}
KIND = LayerKind(kind="full", layer_ids=[0], num_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_v=128,
                 scaling=128 ** -0.5)


def prefixes(bs: int, prefix: int) -> list[int]:
    """Ragged cached prefixes around ``prefix`` (half to one and a half times it), fixed per batch size."""
    g = torch.Generator().manual_seed(bs)
    return [max(1, int(prefix * (0.5 + torch.rand(1, generator=g).item()))) for _ in range(bs)]


def row(backend: str, shape: str, step: str, bs: int, prefix: int, page: int, graph: bool, iters: int) -> dict:
    steps, topk, n = SHAPES[shape]
    pre = prefixes(bs, prefix)
    spec = SpeculativeParams(algorithm="EAGLE", num_steps=steps, topk=topk, num_draft_tokens=n, source="flags")
    if step == "target_verify":
        pools = make_pools(KIND, pre, n, page, torch.bfloat16, "cuda")
        r = check_verify(backend_over(backend, KIND, pools), KIND, prefix_lens=pre, spec=spec, page_size=page,
                         graph=graph, iters=iters, pools=pools)
        rows_per_req = n
    else:
        pools = make_pools(KIND, pre, 0, page, torch.bfloat16, "cuda", scratch=draft_scratch(topk, steps - 1))
        r = check_draft(backend_over(backend, KIND, pools), KIND, prefix_lens=pre, topk=topk, step=steps - 1,
                        page_size=page, graph=graph, iters=iters, pools=pools)
        rows_per_req = topk
    torch.cuda.empty_cache()
    return {"backend": backend, "shape": shape, "step": step, "bs": bs, "rows": bs * rows_per_req, "prefix": prefix,
            "page_size": page, "graph": graph, "max_rel_err": r.max_rel_err, "us": r.us,
            "passed": r.max_rel_err <= TOL}


def table(rows: list[dict]) -> str:
    out = ["| backend | step | steps x top-k / draft tokens | bs | query rows | graph | max rel err vs float64 "
           "| µs per layer |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("error") or f"{r['max_rel_err']:.2e}" + ("" if r["passed"] else " FAIL")
        out.append(f"| {r['backend']} | {r['step'].replace('_', ' ')} | {r['shape']} | {r['bs']} | {r.get('rows', '')} "
                   f"| {'yes' if r['graph'] else 'no'} | {err} | {r.get('us', 0):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["flashinfer", "triton"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bs", nargs="+", type=int, default=[8])
    p.add_argument("--prefix", type=int, default=1024, help="mean cached prefix per request (tokens)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="timed calls per row (median)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for backend in ns.backends:
        for shape in ns.shapes:
            for step in ("target_verify", "draft_decode"):
                for bs in ns.bs:
                    for graph in (False, True):
                        try:
                            rows.append(row(backend, shape, step, bs, ns.prefix, ns.page_size, graph, ns.iters))
                        except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not hidden
                            rows.append({"backend": backend, "shape": shape, "step": step, "bs": bs, "graph": graph,
                                         "passed": False, "error": f"{type(e).__name__}: {e}"[:200]})
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"{torch.cuda.get_device_name(0)}; Llama-3.1-8B layer (32/8 heads, d128), bf16, page {ns.page_size}, "
          f"prefix ~{ns.prefix} (ragged 0.5-1.5x), tolerance {TOL}")
    print(table(rows))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name(0)}, indent=1) + "\n")
    bad = [r for r in rows if not r["passed"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows within {TOL}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
