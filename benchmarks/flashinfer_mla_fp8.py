"""Benchmark: our flashinfer backend's MLA decode step vs raw FlashInfer, and fp8 KV vs bf16 — one process.

Sections (each a printed table; all rows go to ``--out`` as JSON):

1. ``mla``: absorbed-MLA decode at DeepSeek-V3 dims (128 q heads, one latent head of 512 + 64, bf16, page 64,
   its YaRN softmax scale), B in {1, 8, 64, 256} x ctx in {512, 4096, 32768} (every request at ctx tokens, pages
   scrambled over one latent buffer larger than L2). Per shape, both as CUDA-graph replays of ``--layers`` layers
   (one latent buffer, as ``decode_step_overhead.py`` does) and timed in interleaved turns
   (:func:`decode_step_overhead.interleaved`):
   ``ours`` = ``init_forward_metadata_replay_cuda_graph`` (page table gathered from ``req_to_token`` + MLA ``plan``)
   + the graph of ``forward_decode`` per layer; ``raw`` = ``BatchMLAPagedAttentionWrapper.plan`` on precomputed
   page ids + the graph of ``run`` per layer. ``raw/ours`` >= 0.97 is the target. ``GB/s`` = latent bytes read
   (``B * ctx * 576 * 2``) / the time of one raw MLA kernel (a 1-layer graph, ``triton.testing.do_bench`` median,
   L2 flushed), against the copy ceiling measured here (4265 GB/s r+w on the H200).
   Our Triton MLA kernels against FlashInfer's are ``benchmarks/mla_decode.py`` (same shapes; reused helpers).
2. ``fp8_decode``: decode at B=64, ctx 4096, D 128, page 16, heads 32/8 (the target shape), 32/32 and 64/8: our
   flashinfer backend's graph-replayed step (``--layers`` layers) with a bf16 cache (its own decode path) and with
   fp8 e4m3 / e5m2 caches (k_scale 0.5, v_scale 2.0) on the CUDA-core and on the tensor-core path (each forced
   through ``pipeline.backends.flashinfer.rules.FP8_DECODE_PATH``). ``fp8/bf16`` <= 0.60 is the target (half the
   bytes); ``GB/s`` counts K+V bytes per layer. The row marked ``rule`` is the path :data:`FP8_DECODE_PATH` picks today:
   update the table from these rows.
3. ``fp8_extend`` (report, no target): 32/8 heads, D 128, page 16, eager ``init_forward_metadata`` + ``--layers``
   ``forward_extend``: B=8 x 512 new tokens on a 3584-token prefix and B=1 x 4096 new tokens without a prefix
   (bf16 takes the ragged path there, fp8 always the paged one), bf16 vs fp8 e4m3 / e5m2.

Needs CUDA and FlashInfer (0.6.13; restore the AOT modules first: MLA fa3 bf16, fp8 decode-cc and fa2 prefill
d128 are in .whl/fi-aot.tgz). About 2-3 minutes on the H200. Usage:
``python benchmarks/flashinfer_mla_fp8.py [--out DIR_OR_FILE] [--layers 8] [--sections mla,fp8_decode,fp8_extend]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from decode_step_overhead import interleaved  # noqa: E402
from fi_reference import Scenario, make_kind, make_layer, make_mla_kind  # noqa: E402
from mla_decode import COPY_CEILING_GBPS, _us, copy_bandwidth  # noqa: E402
from pipeline.backends.flashinfer import rules as sz
from pipeline.backends.flashinfer.jit import mla_backend
from pipeline.backends.base import PlannedLayers  # noqa: E402
from pipeline.core.contracts import ForwardMode  # noqa: E402

V3_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2   # DeepSeek-V3: (128 + 64)^-0.5 * YaRN mscale(40, 1.0)^2
MLA_B, MLA_CTX = (1, 8, 64, 256), (512, 4096, 32768)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TARGET_MLA, TARGET_FP8 = 0.97, 0.60


def _many_layers(be: Any, kind: Any, n: int, views: Any) -> list:
    """Let ``be`` serve layer ids 0..n-1 of ``kind`` over layer 0's buffers (one KV buffer, n layers of calls)."""
    be.layer_kind = {i: 0 for i in range(n)}
    be.planned = PlannedLayers([msgspec.structs.replace(kind, layer_ids=list(range(n)))], backend=be.name,
                               role="primary")
    be._paged_views = {i: views for i in range(n)}
    pool = be.kv_pool
    pool.k_scales, pool.v_scales = pool.k_scales[:1] * n, pool.v_scales[:1] * n  # layer 0's scales for every call
    return [make_layer(kind, i) for i in range(n)]


def _capture(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        body()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            body()
    torch.cuda.current_stream().wait_stream(s)
    return g


def _fill_requests(sc: Scenario, reqs: list[int], ctx: int) -> None:
    """Give each request ctx - 1 cached tokens (pages only; the buffer holds random values already) + 1 new."""
    for r in list(sc.alloc.req_pages):
        sc.alloc.free(r)
    for r in reqs:
        sc.alloc.extend(r, ctx - 1)


# ------------------------------------------------------------------------------------------- MLA


def mla_rows(layers: int, ceiling: float, shapes) -> list[dict]:
    import flashinfer

    from pipeline.backends.flashinfer import backend as fib

    page, bmax, cmax = 64, max(b for b, _ in shapes), max(c for _, c in shapes)
    kind = make_mla_kind(128, scaling=V3_SCALE)
    sc = Scenario([kind], page_size=page, max_reqs=bmax + 1, max_context_len=cmax + page,
                  num_slots=page * (bmax * (-(-cmax // page)) + 4), ws_bytes=384 << 20,
                  extra={"cuda_graph_max_bs": bmax})
    sc.kv.k_buffer[0].normal_()
    be = fib.create(sc.ctx)
    lays = _many_layers(be, kind, layers, be.mla_kv(0))
    ckv, kpe = be.mla_kv(0)
    arch = sc.ctx.device.arch
    be.init_cuda_graph_state(bmax, bmax)
    ws = sc.ctx.workspace.buffer
    rows, graphs = [], {}
    for b, ctx in shapes:
        reqs = list(range(1, b + 1))
        _fill_requests(sc, reqs, ctx)
        fb = sc.batch(ForwardMode.DECODE, reqs, [1] * b)
        seq_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)
        q = torch.randn(b, 128, 576, dtype=torch.bfloat16, device="cuda")
        if b not in graphs:  # one captured graph per batch size; replays re-plan for the new lengths
            be.init_forward_metadata_capture_cuda_graph(b, b, fb.req_pool_indices, fb.seq_lens, None,
                                                        ForwardMode.DECODE, None)
            out: dict = {}

            def body(q=q, fb=fb, out=out):
                for lay in lays:
                    out["o"] = be.forward_decode(q, None, None, lay, fb, save_kv_cache=False)
            graphs[b] = (_capture(body), q, out)
        g_ours, q_ours, out_ours = graphs[b]
        q_ours.copy_(q)
        # raw FlashInfer: the same kernels, page ids precomputed (our gather, once), plan + graph of `layers` runs
        indptr, indices, _ = be.page_table(fb.req_pool_indices, fb.seq_lens_cpu, fb.seq_lens)
        qo = torch.arange(b + 1, dtype=torch.int32)
        i32 = dict(dtype=torch.int32, device="cuda")
        raw = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            ws, use_cuda_graph=True, qo_indptr=torch.empty(b + 1, **i32), kv_indptr=torch.empty(b + 1, **i32),
            kv_indices=torch.empty(indices.numel(), **i32), kv_len_arr=torch.empty(b, **i32),
            backend=mla_backend(arch))
        plan_kw = dict(metadata=flashinfer.mla.MLAPlanMetadata.csr(qo, indptr, indices, seq_cpu), num_heads=128,
                       head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=False, sm_scale=V3_SCALE,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, query_layout="split",
                       kv_cache_layout="split")  # FlashInfer 0.7.2's canonical form, as the backend plans
        raw.plan(**plan_kw)
        o_raw = torch.empty(b, 128, 512, dtype=torch.bfloat16, device="cuda")

        def raw_body(n=layers):
            for _ in range(n):
                raw.run(query=(q[..., :512], q[..., 512:]), kv_cache=(ckv, kpe), out=o_raw)
        g_raw = _capture(raw_body)
        g_kernel = _capture(lambda: raw_body(1))

        def ours_step():
            be.init_forward_metadata_replay_cuda_graph(b, fb.req_pool_indices, fb.seq_lens, 0, None,
                                                       ForwardMode.DECODE, None, seq_cpu)
            g_ours.replay()

        def raw_step():
            raw.plan(**plan_kw)
            g_raw.replay()

        ours_step()
        raw_step()
        torch.cuda.synchronize()
        same = bool(torch.equal(out_ours["o"].view(b, 128, 512), o_raw))
        spread: dict = {}
        t = interleaved(dict(ours=ours_step, raw=raw_step), reps=11, spread=spread)
        k_us = _us(g_kernel.replay)
        gbps = b * ctx * 576 * 2 / k_us / 1e3
        rows.append(dict(section="mla", B=b, ctx=ctx, layers=layers, backend=mla_backend(arch),
                         ours_us=t["ours"], raw_us=t["raw"], ratio=t["raw"] / t["ours"], kernel_us=k_us,
                         gbps=gbps, pct_copy=100 * gbps / ceiling, outputs_equal=same, spread_us=spread,
                         meets=t["raw"] / t["ours"] >= TARGET_MLA))
        del raw, g_raw, g_kernel, o_raw
    be.close()
    return rows


# ------------------------------------------------------------------------------------------- fp8 decode


def _decode_step(h: int, hkv: int, kv_name: str, path: str | None, layers: int, b: int = 64, ctx: int = 4096):
    """(µs per graph-replayed step, the decode wrapper class used) of our backend over a ``kv_name`` cache."""
    from pipeline.backends.flashinfer import backend as fib

    g = h // hkv
    old = sz.FP8_DECODE_PATH.get(g)
    if path is not None:
        sz.FP8_DECODE_PATH[g] = path
    try:
        kind = make_kind(h, hkv, 128)
        kvd = FP8.get(kv_name, torch.bfloat16)
        scales = dict(k_scales=[0.5], v_scales=[2.0]) if kv_name in FP8 else {}
        sc = Scenario([kind], page_size=16, max_reqs=b + 1, max_context_len=ctx + 16,
                      num_slots=16 * (b * (ctx // 16 + 2) + 2), ws_bytes=384 << 20, kv_dtype=kvd,
                      extra={"cuda_graph_max_bs": b}, **scales)
        for buf in (sc.kv.k_buffer[0], sc.kv.v_buffer[0]):
            buf.copy_((torch.randn(buf.shape, device="cuda") * 2).to(kvd))
        be = fib.create(sc.ctx)
        lays = _many_layers(be, kind, layers, be.paged_kv(0))
        reqs = list(range(1, b + 1))
        _fill_requests(sc, reqs, ctx)
        fb = sc.batch(ForwardMode.DECODE, reqs, [1] * b)
        seq_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)
        q = torch.randn(b, h, 128, dtype=torch.bfloat16, device="cuda")
        be.init_cuda_graph_state(b, b)
        be.init_forward_metadata_capture_cuda_graph(b, b, fb.req_pool_indices, fb.seq_lens, None,
                                                    ForwardMode.DECODE, None)
        wrapper = be.graph.wrappers(b)[0][1]
        tc = bool(wrapper.use_tensor_cores)  # FlashInfer 0.6.13's property

        def body():
            for lay in lays:
                be.forward_decode(q, None, None, lay, fb, save_kv_cache=False)
        graph = _capture(body)

        def step():
            be.init_forward_metadata_replay_cuda_graph(b, fb.req_pool_indices, fb.seq_lens, 0, None,
                                                       ForwardMode.DECODE, None, seq_cpu)
            graph.replay()
        t = interleaved(dict(step=step), reps=11)["step"]
        be.close()
        del sc, graph
        torch.cuda.empty_cache()
        return t, ("tensor_core" if tc else "cuda_core")
    finally:
        if old is None:
            sz.FP8_DECODE_PATH.pop(g, None)
        else:
            sz.FP8_DECODE_PATH[g] = old


def fp8_decode_rows(layers: int, ceiling: float) -> list[dict]:
    rows = []
    b, ctx = 64, 4096
    for h, hkv in ((32, 8), (32, 32), (64, 8)):
        base_t, base_path = _decode_step(h, hkv, "bfloat16", None, layers)
        kv_bytes = lambda elem: b * ctx * hkv * 128 * 2 * elem  # noqa: E731  K and V, one layer
        rows.append(dict(section="fp8_decode", heads=f"{h}/{hkv}", kv="bfloat16", path=base_path, B=b, ctx=ctx,
                         layers=layers, step_us=base_t, gbps=kv_bytes(2) * layers / base_t / 1e3, ratio=1.0,
                         rule=True))
        rule = sz.FP8_DECODE_PATH.get(h // hkv, "tensor_core")
        for kv in FP8:
            for path in ("cuda_core", "tensor_core"):
                t, used = _decode_step(h, hkv, kv, path, layers)
                rows.append(dict(section="fp8_decode", heads=f"{h}/{hkv}", kv=kv, path=used, B=b, ctx=ctx,
                                 layers=layers, step_us=t, gbps=kv_bytes(1) * layers / t / 1e3, ratio=t / base_t,
                                 rule=path == rule, meets=t / base_t <= TARGET_FP8))
    for r in rows:
        r["pct_copy"] = 100 * r["gbps"] / ceiling
    return rows


# ------------------------------------------------------------------------------------------- fp8 extend


def fp8_extend_rows(layers: int) -> list[dict]:
    from pipeline.backends.flashinfer import backend as fib

    rows = []
    for b, prefix, new in ((8, 3584, 512), (1, 0, 4096)):
        base = None
        for kv in ("bfloat16", *FP8):
            kind = make_kind(32, 8, 128)
            kvd = FP8.get(kv, torch.bfloat16)
            scales = dict(k_scales=[0.5], v_scales=[2.0]) if kv in FP8 else {}
            sc = Scenario([kind], page_size=16, max_reqs=b + 1, max_context_len=prefix + new + 16,
                          num_slots=16 * (b * ((prefix + new) // 16 + 2) + 2), ws_bytes=384 << 20, kv_dtype=kvd,
                          **scales)
            be = fib.create(sc.ctx)
            lays = _many_layers(be, kind, layers, be.paged_kv(0))
            reqs = list(range(1, b + 1))
            if prefix:
                for r in reqs:
                    sc.alloc.extend(r, prefix)
            fb = sc.batch(ForwardMode.EXTEND, reqs, [new] * b)
            t_tok = b * new
            q = torch.randn(t_tok, 32, 128, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(t_tok, 8, 128, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(t_tok, 8, 128, dtype=torch.bfloat16, device="cuda")

            def step():
                be.init_forward_metadata(fb)
                for lay in lays:
                    be.forward_extend(q, k, v, lay, fb, save_kv_cache=lay.layer_id == 0)
            t = interleaved(dict(step=step), reps=7)["step"]
            base = base or t
            rows.append(dict(section="fp8_extend", B=b, prefix=prefix, new=new, kv=kv, layers=layers, step_us=t,
                             path="ragged" if be.extend_ragged else "paged", ratio=t / base))
            be.close()
            del sc
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- report


def print_rows(rows: list[dict]) -> None:
    for sec in ("mla", "fp8_decode", "fp8_extend"):
        rs = [r for r in rows if r["section"] == sec]
        if not rs:
            continue
        print(f"\n== {sec}")
        if sec == "mla":
            print(f"{'B':>4} {'ctx':>6} {'ours µs':>9} {'raw µs':>9} {'raw/ours':>8} {'kernel µs':>9} {'GB/s':>6} "
                  f"{'%copy':>6} {'equal':>5} {'>=0.97':>6}")
            for r in rs:
                print(f"{r['B']:4} {r['ctx']:6} {r['ours_us']:9.1f} {r['raw_us']:9.1f} {r['ratio']:8.3f} "
                      f"{r['kernel_us']:9.1f} {r['gbps']:6.0f} {r['pct_copy']:6.1f} {str(r['outputs_equal']):>5} "
                      f"{'met' if r['meets'] else 'NOT':>6}")
        elif sec == "fp8_decode":
            print(f"{'heads':>6} {'kv':>9} {'path':>11} {'rule':>4} {'step µs':>9} {'GB/s':>6} {'%copy':>6} "
                  f"{'fp8/bf16':>8} {'<=0.60':>6}")
            for r in rs:
                met = "" if r["kv"] == "bfloat16" else ("met" if r["meets"] else "NOT")
                print(f"{r['heads']:>6} {r['kv']:>9} {r['path']:>11} {'*' if r['rule'] else '':>4} {r['step_us']:9.1f} "
                      f"{r['gbps']:6.0f} {r['pct_copy']:6.1f} {r['ratio']:8.3f} {met:>6}")
        else:
            print(f"{'B':>3} {'prefix':>6} {'new':>5} {'kv':>9} {'path':>6} {'step µs':>9} {'vs bf16':>7}")
            for r in rs:
                print(f"{r['B']:3} {r['prefix']:6} {r['new']:5} {r['kv']:>9} {r['path']:>6} {r['step_us']:9.1f} "
                      f"{r['ratio']:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="a JSON file, or a directory that gets flashinfer_mla_fp8.json")
    ap.add_argument("--layers", type=int, default=8, help="layers per step (one KV buffer)")
    ap.add_argument("--sections", default="mla,fp8_decode,fp8_extend")
    ap.add_argument("--shapes", help="MLA shapes B:CTX,... (default: B 1/8/64/256 x ctx 512/4096/32768)")
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.monotonic()
    ceiling = copy_bandwidth("cuda")
    import flashinfer

    head = dict(device=torch.cuda.get_device_name(0), flashinfer=getattr(flashinfer, "__version__", "?"),
                torch=torch.__version__, copy_gbps=ceiling, copy_reference_gbps=COPY_CEILING_GBPS,
                fp8_decode_path=dict(sz.FP8_DECODE_PATH), layers=a.layers)
    print(json.dumps(head))
    shapes = ([tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")] if a.shapes
              else [(b, c) for c in MLA_CTX for b in MLA_B])
    rows: list[dict] = []
    sections = a.sections.split(",")
    for sec, fn in (("mla", lambda: mla_rows(a.layers, ceiling, shapes)),
                    ("fp8_decode", lambda: fp8_decode_rows(a.layers, ceiling)),
                    ("fp8_extend", lambda: fp8_extend_rows(a.layers))):
        if sec not in sections:
            continue
        ts = time.monotonic()
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - one failing section is reported, the others still run
            rows.append(dict(section=sec, error=f"{type(e).__name__}: {e}"[:500]))
            print(f"section {sec} failed: {rows[-1]['error']}")
        print(f"section {sec}: {time.monotonic() - ts:.1f} s")
        torch.cuda.empty_cache()
    print_rows([r for r in rows if "error" not in r])
    summary = {
        "mla_min_ratio": min((r["ratio"] for r in rows if r["section"] == "mla" and "ratio" in r), default=None),
        "mla_all_met": all(r.get("meets") for r in rows if r["section"] == "mla" and "ratio" in r),
        "fp8_32_8_best": min((r["ratio"] for r in rows if r["section"] == "fp8_decode" and r.get("heads") == "32/8"
                              and r.get("kv") != "bfloat16"), default=None),
        "fp8_32_8_rule": [(r["kv"], r["path"], r["ratio"]) for r in rows if r["section"] == "fp8_decode"
                          and r.get("heads") == "32/8" and r.get("kv") != "bfloat16" and r.get("rule")],
    }
    print("\nsummary:", json.dumps(summary))
    print(f"total {time.monotonic() - t0:.1f} s")
    if a.out:
        path = os.path.join(a.out, "flashinfer_mla_fp8.json") if os.path.isdir(a.out) else a.out
        with open(path, "w") as fh:
            json.dump(dict(head, rows=rows, summary=summary), fh, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
