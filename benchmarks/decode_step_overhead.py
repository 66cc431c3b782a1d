"""Where the host time of our FlashInfer decode step goes, against the same raw FlashInfer calls.

For H=32 q / 8 kv heads, head dim 128, bf16, page 16, 32 layers sharing one KV buffer (as in
``flashinfer_gpu_check.phase_bench``), side by side in one process (median µs per step of
interleaved back-to-back turns, :func:`interleaved`):

- ``step``: ours = ``init_forward_metadata`` + 32 ``forward_decode`` (q as the engine passes it,
  ``[B, H*D]``); raw = ``plan`` on precomputed indices + 32 ``run`` (same ``enable_pdl`` as ours);
  ``ours q3``: ours with q already ``[B, H, D]``; ``raw+pt``: raw plus what an engine calling
  FlashInfer itself must also do (page ids from ``req_to_token``, q and output views);
- the 32 layers share one KV buffer (memory), so at short contexts it stays in L2 and the GPU part
  is smaller than in a real model: host-bound rows here are host-bound at least as much there;
- ``plan``: the planning half alone; ``layers``: the 32 per-layer calls alone;
- ``page table``: our gather (``kv_indices``) vs the torch-op gather it replaced (``LegacyPageTable``);
- ``graph``: one CUDA-graph decode step (re-plan outside the graph + replay of the 32 layers), ours
  through ``init_forward_metadata_replay_cuda_graph`` vs a raw ``use_cuda_graph=True`` wrapper;
- with ``--profile``, the top host functions (cProfile, 200 steps) of ours and raw.

Usage (GPU): ``python benchmarks/decode_step_overhead.py [--out DIR] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

from typing import Optional

import msgspec
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from fi_reference import Scenario, make_kind, make_layer  # noqa: E402
from pipeline.backends.base import PlannedLayers  # noqa: E402
from pipeline.backends.flashinfer import rules as sz
from pipeline.core.contracts import ForwardMode  # noqa: E402

L = 32


def interleaved(fns: dict, reps: int = 21, target_us: float = 20000.0, spread: Optional[dict] = None) -> dict:
    """Median µs per call of each function, timed in turns (A B C A B C ...) to cancel drift.

    Each turn runs the function back to back n times between two ``torch.cuda.synchronize`` and
    divides the wall time by n (n sized for ~20 ms a turn): the throughput of a decode loop, host-
    or GPU-bound, whichever binds. (Per-call event timing, as in ``do_bench``, drains the queue and
    flushes L2 between calls, which misstates host-bound steps.)
    """
    spread = {} if spread is None else spread
    n = {}
    for k, f in fns.items():
        f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        n[k] = max(3, int(target_us / max((time.perf_counter() - t) * 1e6, 1.0)))
    res: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n[k]):
                f()
            torch.cuda.synchronize()
            res[k].append((time.perf_counter() - t) / n[k] * 1e6)
    spread.update({k: (min(v), max(v)) for k, v in res.items()})
    return {k: statistics.median(v) for k, v in res.items()}


class LegacyPageTable:
    """The page table this backend used before ``kv_indices`` (kept here, as it was, to compare against).

    Host torch ops build every page's (row, column) pair into a cached page-locked staging buffer
    (guarded by an event so it is reused only after its copy finished), one async copy sends it,
    and the page ids are gathered from ``req_to_token`` with torch indexing on the device.
    """

    def __init__(self, be) -> None:
        self.be, self.stage, self.event = be, None, None

    def _staging(self, n: int) -> torch.Tensor:
        if self.stage is None or self.stage.numel() < n:
            self.stage = torch.empty(max(n, 1 << 16), dtype=torch.int64, pin_memory=True)
            self.event = torch.cuda.Event()
        else:
            self.event.synchronize()
        return self.stage[:n]

    def __call__(self, req_pool_indices, seq_lens):
        ps = self.be.page_size
        seq = torch.tensor(seq_lens, dtype=torch.int64)
        npages = (seq + ps - 1) // ps
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(npages, 0, out=indptr[1:])
        total = int(indptr[-1])
        rc = self._staging(2 * total).view(2, total)
        rc[0].copy_(torch.repeat_interleave(torch.arange(len(seq_lens)), npages, output_size=total))
        torch.mul(torch.arange(total) - indptr[:-1].repeat_interleave(npages, output_size=total), ps, out=rc[1])
        dev_rc = rc.to(req_pool_indices.device, non_blocking=True)
        self.event.record()
        indices = self.be.req_pool.req_to_token[req_pool_indices[dev_rc[0]], dev_rc[1]] // ps
        last = (seq - (npages - 1) * ps).to(torch.int32)
        return indptr.to(torch.int32), indices, last


def top(fn, n=200, k=14) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    return s.getvalue()


def case(B, ctx, profile=False, graphs=True, reps=21):
    import flashinfer

    from pipeline.backends.flashinfer import backend as fib

    h, hkv, d = 32, 8, 128
    kind = make_kind(h, hkv, d, layer_ids=(0,))
    sc = Scenario([kind], page_size=16, max_reqs=B + 1, max_context_len=ctx + 16,
                  num_slots=16 * (B * (ctx // 16 + 2) + 2), ws_bytes=384 << 20, extra={"cuda_graph_max_bs": B})
    be = fib.create(sc.ctx)
    be.layer_kind = {i: 0 for i in range(L)}
    # ... planned for all L layer ids (one kind), so the per-layer check accepts layers 1..L-1 too
    be.planned = PlannedLayers([msgspec.structs.replace(kind, layer_ids=list(range(L)))], backend=be.name, role="primary")
    be._paged_views = {i: be.paged_kv(0) for i in range(L)}  # 32 layers over one KV buffer (memory)
    reqs = list(range(1, B + 1))
    sc.fill_prefix(reqs, [ctx - 1] * B)
    fb = sc.batch(ForwardMode.DECODE, reqs, [1] * B)
    layers = [make_layer(kind, i) for i in range(L)]
    q2 = torch.randn(B, h * d, dtype=torch.bfloat16, device="cuda")
    q3 = q2.view(B, h, d)
    kv = be.paged_kv(0)
    indptr, indices, last = be.page_table(fb.req_pool_indices, fb.seq_lens_cpu, fb.seq_lens)
    legacy_page_table = LegacyPageTable(be)
    old = legacy_page_table(fb.req_pool_indices, fb.seq_lens_cpu)
    assert torch.equal(old[1], indices) and torch.equal(old[0], indptr) and torch.equal(old[2], last)
    tc = sz.use_tensor_core_decode(h // hkv, B)
    same = dict(use_tensor_cores=tc, backend="fa2" if tc else "auto")  # the kernels our backend picks
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(sc.ctx.workspace.buffer, "NHD", **same)
    plan_kw = dict(num_qo_heads=h, num_kv_heads=hkv, head_dim=d, page_size=16, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16, sm_scale=kind.scaling)

    def raw_plan():
        raw.plan(indptr=indptr, indices=indices, last_page_len=last, **plan_kw)

    pdl = be.enable_pdl  # the same run() arguments ours passes (FlashInfer's own default on this GPU)

    def raw_layers():
        for _ in range(L):
            raw.run(q3, kv, enable_pdl=pdl)

    def raw_step():
        raw_plan()
        raw_layers()

    def ours_plan():
        be.init_forward_metadata(fb)

    def ours_layers():
        for lay in layers:
            be.forward_decode(q2, None, None, lay, fb, save_kv_cache=False)

    def ours_step():
        ours_plan()
        ours_layers()

    ours_step()
    raw_step()
    torch.cuda.synchronize()
    o_ours = be.forward_decode(q2, None, None, layers[0], fb, save_kv_cache=False)
    o_raw = raw.run(q3, kv, enable_pdl=pdl).view(B, -1)
    assert torch.equal(o_ours, o_raw), "ours and raw differ"
    spread: dict = {}
    row = dict(B=B, ctx=ctx, tc=tc, min_max_us=spread)

    def ours_step3():  # q already [B, H, D], as the raw calls get it
        ours_plan()
        for lay in layers:
            be.forward_decode(q3, None, None, lay, fb, save_kv_cache=False)

    def raw_engine_step():  # what an engine calling FlashInfer itself must also do: page table, q/o views
        ip, ix, la = be.page_table(fb.req_pool_indices, fb.seq_lens_cpu, fb.seq_lens)
        raw.plan(indptr=ip, indices=ix, last_page_len=la, **plan_kw)
        for _ in range(L):
            raw.run(q2.view(-1, h, d), kv, enable_pdl=pdl).view(-1, h * d)

    t = interleaved(dict(step_ours=ours_step, step_ours_q3=ours_step3, step_raw=raw_step, step_raw_engine=raw_engine_step,
                         plan_ours=ours_plan, plan_raw=raw_plan, layers_ours=ours_layers, layers_raw=raw_layers,
                         pt_new=lambda: be.page_table(fb.req_pool_indices, fb.seq_lens_cpu, fb.seq_lens),
                         pt_old=lambda: legacy_page_table(fb.req_pool_indices, fb.seq_lens_cpu)),
                    reps=reps, spread=spread)
    row.update({f"{k}_us": v for k, v in t.items()})
    row["step_ratio"] = t["step_raw"] / t["step_ours"]
    row["step_ratio_q3"] = t["step_raw"] / t["step_ours_q3"]
    row["step_ratio_engine"] = t["step_raw_engine"] / t["step_ours"]
    if not graphs:
        be.close()
        return row
    # CUDA graphs: replay step = plan outside the graph + replay
    be.init_cuda_graph_state(B, B)
    be.init_forward_metadata_capture_cuda_graph(B, B, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
    g_ours = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ours_layers()
        torch.cuda.synchronize()
        with torch.cuda.graph(g_ours, stream=s):
            out_ours = be.forward_decode(q2, None, None, layers[0], fb, save_kv_cache=False)
            for lay in layers[1:]:
                be.forward_decode(q2, None, None, lay, fb, save_kv_cache=False)
    torch.cuda.current_stream().wait_stream(s)
    gbuf = dict(paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buffer=torch.zeros(B, dtype=torch.int32, device="cuda"))
    graw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(sc.ctx.workspace.buffer, "NHD", use_cuda_graph=True,
                                                         **same, **gbuf)
    graw.plan(indptr=indptr, indices=indices, last_page_len=last, **plan_kw)
    g_raw = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        for _ in range(2):
            graw.run(q3, kv, enable_pdl=pdl)
        torch.cuda.synchronize()
        with torch.cuda.graph(g_raw, stream=s):
            out_raw = graw.run(q3, kv, enable_pdl=pdl)
            for _ in range(L - 1):
                graw.run(q3, kv, enable_pdl=pdl)
    torch.cuda.current_stream().wait_stream(s)
    seq_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)

    def ours_graph():
        be.init_forward_metadata_replay_cuda_graph(B, fb.req_pool_indices, fb.seq_lens, 0, None, ForwardMode.DECODE,
                                                   None, seq_cpu)
        g_ours.replay()

    def raw_graph():
        graw.plan(indptr=indptr, indices=indices, last_page_len=last, **plan_kw)
        g_raw.replay()

    ours_graph()
    raw_graph()
    torch.cuda.synchronize()
    assert torch.equal(out_ours, out_raw.view(B, -1)), "graph outputs differ"
    t = interleaved(dict(graph_ours=ours_graph, graph_raw=raw_graph), reps=reps, spread=spread)
    row.update({f"{k}_us": v for k, v in t.items()})
    row["graph_ratio"] = t["graph_raw"] / t["graph_ours"]
    if profile:
        row["profile_ours"], row["profile_raw"] = top(ours_step), top(raw_step)
    be.close()
    return row


COLS = (("step_ours_us", "step ours"), ("step_ours_q3_us", "ours q3"), ("step_raw_us", "step raw"),
        ("step_ratio", "raw/ours"), ("step_ratio_q3", "raw/ours q3"), ("step_raw_engine_us", "raw+pt"),
        ("step_ratio_engine", "(raw+pt)/ours"), ("plan_ours_us", "plan ours"), ("plan_raw_us", "plan raw"),
        ("layers_ours_us", "layers ours"), ("layers_raw_us", "layers raw"), ("pt_new_us", "pt new"),
        ("pt_old_us", "pt old"), ("graph_ours_us", "graph ours"), ("graph_raw_us", "graph raw"),
        ("graph_ratio", "graph raw/ours"))


def table(rows) -> str:
    """A Markdown table of the rows (µs, ratios to 3 places)."""
    cols = [c for c in COLS if any(c[0] in r for r in rows)]
    out = ["| B | ctx | tc | " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * (3 + len(cols))]
    for r in rows:
        cells = [f"{r[k]:.3f}" if "ratio" in k else f"{r[k]:.1f}" for k, _ in cols]
        out.append(f"| {r['B']} | {r['ctx']} | {int(r['tc'])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true", help="print cProfile top functions per case")
    ap.add_argument("--cases", default="1x512,1x4096,8x512,8x4096,64x512,64x4096,256x512")
    a = ap.parse_args()
    rows = []
    for c in a.cases.split(","):
        B, ctx = map(int, c.split("x"))
        rows.append(case(B, ctx, a.profile))
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "decode_step_overhead.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(table(rows))
    if a.profile:
        for r in rows[:3]:
            print(f"\n==== B={r['B']} ctx={r['ctx']} ours\n{r['profile_ours']}\n==== raw\n{r['profile_raw']}")


if __name__ == "__main__":
    main()
