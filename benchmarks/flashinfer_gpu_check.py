"""One H200 run for the flashinfer/fa3 backends: JIT warmup, correctness grid, CUDA graphs,
workspace-bound proof, tensor-core crossover and our-vs-raw decode benchmark.

Usage (GPU machine): ``python benchmarks/flashinfer_gpu_check.py --out DIR [--jobs 14] [--phases ...]``.
Writes ``DIR/fi_results.json`` and prints a short table last. Each phase is isolated: a failure
is recorded with its traceback and the next phase still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from fi_reference import Scenario, dense_reference, make_kind, make_layer, rel_err  # noqa: E402
from pipeline.backends.flashinfer import rules as sz
from pipeline.core.contracts import ForwardMode  # noqa: E402
from pipeline.backends.flashinfer.jit import Variant, warmup_variants  # noqa: E402
from pipeline.backends.capability import WorkspaceQuery

R: dict = {"cases": [], "errors": {}}
READY: set = set()  # variant names compiled (or cached) by the warmup phase
BIG = dict(max_reqs=300, max_context_len=33024, num_slots=1 << 21)


def variants(arch="sm90"):
    v = []
    for dt, d in (("bfloat16", 128), ("float16", 128), ("bfloat16", 64), ("bfloat16", 256)):
        feats = [(False, False), (True, False), (False, True)] if (dt, d) == ("bfloat16", 128) else [(False, False)]
        for swa, cap in feats:
            base = dict(q_dtype=dt, kv_dtype=dt, head_dim_qk=d, head_dim_vo=d, sliding_window=swa, logit_softcap=cap, arch=arch)
            v += [Variant(kind="decode", backend="cuda_core", **base), Variant(kind="prefill", backend="fa2", **base)]
    b = dict(q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=128, head_dim_vo=128, arch=arch)
    v += [Variant(kind="prefill", backend="fa3", **b), Variant(kind="sink", backend="fa2", **b),
          Variant(kind="sink", backend="fa2", sliding_window=True, **b)]
    return v


def run_case(name, h, hkv, d, dtype, ps, window=None, softcap=None, sinks=False, seed=0):
    """Decode (B=1 long, B=33 ragged, B=256 for page 16) + extend ragged + extend paged for one config."""
    from pipeline.backends.flashinfer import backend as fib

    kind = make_kind(h, hkv, d, window=window, softcap=softcap, sinks=sinks)
    dt = str(dtype)[6:]
    base = dict(q_dtype=dt, kv_dtype=dt, head_dim_qk=d, head_dim_vo=d, arch="sm90")
    if sinks:
        need = [Variant(kind="sink", backend="fa2", sliding_window=bool(window), **base)]
    else:
        f = dict(sliding_window=bool(window), logit_softcap=bool(softcap), **base)
        need = [Variant(kind="prefill", backend="fa3", **f)] if name == "fa3" else [
            Variant(kind="prefill", backend="fa2", **f), Variant(kind="decode", backend="cuda_core", **f)]
    missing = [v.name for v in need if v.name not in READY]
    if missing:
        R["cases"].append(dict(backend=name, h=h, hkv=hkv, d=d, dtype=dt, page=ps, window=window, softcap=softcap,
                               sinks=sinks, skipped=f"not compiled in warmup: {missing}", ok=True, err32=0, err64=0))
        return
    sc = Scenario([kind], dtype=dtype, page_size=ps, name=name, seed=seed, ws_bytes=384 << 20, **BIG)
    be = (fib.create_fa3 if name == "fa3" else fib.create)(sc.ctx)
    rng = random.Random(seed)
    sink_t = torch.randn(h, device="cuda") * 2 if sinks else None
    layer = make_layer(kind, 0, sink_t)
    batches = [("extend_ragged", list(range(0, 4)), [0] * 4, [rng.randint(1, 700) for _ in range(4)]),
               ("extend_paged", list(range(4, 8)), [rng.randint(0, 3000) for _ in range(4)], [rng.randint(1, 500) for _ in range(4)]),
               ("decode_b1", [8], [32000], [1]),
               ("decode_b33", list(range(9, 42)), [rng.randint(0, 4095) for _ in range(33)], [1] * 33)]
    if ps == 16:
        batches.append(("decode_b256", list(range(42, 298)), [rng.randint(0, 2047) for _ in range(256)], [1] * 256))
    for label, reqs, prefix, new in batches:
        sc.fill_prefix(reqs, prefix)
        pre = [sc.alloc.req_lens.get(r, 0) for r in reqs]
        mode = ForwardMode.DECODE if label.startswith("decode") else ForwardMode.EXTEND
        fb = sc.batch(mode, reqs, new)
        T = sum(new)
        q = sc.randn(T, h, d, scale=4.0 if softcap else 1.0)
        k, v = sc.randn(T, hkv, d), sc.randn(T, hkv, d)
        be.init_forward_metadata(fb)
        torch.empty(T * h * d * 2, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison the next block (NaN bf16/fp16)
        out = be.forward(q, k, v, layer, fb).view(T, h, d).float()
        torch.cuda.synchronize()
        nan = bool(torch.isnan(out).any())
        e32, e64, off = 0.0, 0.0, 0
        sample = set(rng.sample(range(len(reqs)), min(2, len(reqs))))
        for i, (r, p, n) in enumerate(zip(reqs, pre, new)):
            kr, vr = sc.request_kv(0, r, p + n)
            kw = dict(prefix=p, scale=kind.scaling, window=window, softcap=softcap, sinks=sink_t)
            e32 = max(e32, rel_err(out[off:off + n], dense_reference(q[off:off + n], kr, vr, dtype=torch.float32, **kw)))
            if i in sample:
                e64 = max(e64, rel_err(out[off:off + n], dense_reference(q[off:off + n], kr, vr, **kw)))
            off += n
        ok = (not nan) and e32 <= 1e-2 and e64 <= 1e-2
        R["cases"].append(dict(backend=name, h=h, hkv=hkv, d=d, dtype=str(dtype)[6:], page=ps, window=window, softcap=softcap,
                               sinks=sinks, batch=label, B=len(reqs), max_ctx=max(p + n for p, n in zip(pre, new)),
                               err32=e32, err64=e64, nan=nan, ok=ok,
                               wrapper=type(be.kinds[0].active).__name__ + ("/tc" if getattr(be.kinds[0].active, "use_tensor_cores", False) else "")))
    be.close()
    del sc, be
    torch.cuda.empty_cache()


def phase_correctness():
    bf = torch.bfloat16
    for ps in (1, 16, 64):
        for h, hkv in ((8, 8), (32, 8), (32, 4)):
            for feat in ({}, {"window": 256}, {"softcap": 30.0}):
                run_case("flashinfer", h, hkv, 128, bf, ps, **feat)
        run_case("fa3", 32, 8, 128, bf, ps)
    run_case("fa3", 8, 8, 128, bf, 16)
    run_case("flashinfer", 32, 8, 128, bf, 16, sinks=True)
    run_case("flashinfer", 64, 8, 128, bf, 16, window=128, sinks=True)  # gqa 8
    run_case("flashinfer", 32, 8, 128, torch.float16, 16)
    run_case("flashinfer", 32, 8, 64, bf, 16)
    run_case("flashinfer", 16, 4, 256, bf, 16)


def phase_graphs():
    """Capture decode at bs (cc and tc paths, and fa3), replay with changed lengths == eager."""
    from pipeline.backends.flashinfer import backend as fib

    for name, h, bs, real in (("flashinfer", 32, 16, 11), ("flashinfer", 32, 4, 3), ("flashinfer", 8, 16, 16), ("fa3", 32, 16, 11)):
        kind = make_kind(h, 8, 128, layer_ids=(0, 1))
        sc = Scenario([kind], page_size=16, name=name, max_reqs=64, max_context_len=8192, extra={"cuda_graph_max_bs": bs},
                      ws_bytes=384 << 20)
        be = (fib.create_fa3 if name == "fa3" else fib.create)(sc.ctx)
        be.init_cuda_graph_state(bs, bs)
        reqs = list(range(1, real + 1))
        sc.fill_prefix(reqs, [random.randint(10, 3000) for _ in reqs])
        layers = [make_layer(kind, 0), make_layer(kind, 1)]
        pad = lambda t, fill: torch.cat([t, torch.full((bs - real,), fill, dtype=t.dtype, device=t.device)])  # noqa: E731
        fb = sc.batch(ForwardMode.DECODE, reqs, [1] * real)
        q = torch.zeros(bs, h, 128, dtype=torch.bfloat16, device="cuda")
        be.init_forward_metadata_capture_cuda_graph(bs, bs, pad(fb.req_pool_indices, 0), pad(fb.seq_lens, 1), None, ForwardMode.DECODE, None)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                [be.forward_decode(q, None, None, l, fb, save_kv_cache=False) for l in layers]
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [be.forward_decode(q, None, None, l, fb, save_kv_cache=False) for l in layers]
        errs = []
        for step in range(3):  # change lengths: append 1..700 tokens per request
            sc.fill_prefix(reqs, [random.randint(1, 700) for _ in reqs])
            fb = sc.batch(ForwardMode.DECODE, reqs, [1] * real)
            q.copy_(torch.randn_like(q))
            be.init_forward_metadata_replay_cuda_graph(bs, pad(fb.req_pool_indices, 0), pad(fb.seq_lens, 1), 0, None,
                                                       ForwardMode.DECODE, None, pad(fb.seq_lens, 1).cpu())
            g.replay()
            torch.cuda.synchronize()
            be.init_forward_metadata(fb)
            for l, o in zip(layers, outs):
                eager = be.forward_decode(q[:real], None, None, l, fb, save_kv_cache=False)
                errs.append(rel_err(o[:real], eager))
        R.setdefault("graphs", []).append(dict(backend=name, h=h, bs=bs, real=real, max_err_vs_eager=max(errs),
                                               tc=bool(getattr(be.graph.wrappers(bs)[0][1], "use_tensor_cores", False))))
        be.close()


def phase_workspace():
    """Plan + capture at the computed size succeed; at half our check fires; FlashInfer then fails too."""
    from pipeline.backends import registry
    from pipeline.backends.flashinfer import backend as fib
    from pipeline.core.errors import ConfigError

    kind = make_kind(32, 8, 128)
    need = sz.workspace_need([sz.HeadShape(32, 8, 128)], num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                             max_batch_size=256, cuda_graph_max_bs=256)
    out = {"need": need.bytes, "parts": need.parts}
    for frac in (1.0, 0.5):
        sc = Scenario([kind], page_size=16, max_reqs=257, max_context_len=4096, num_slots=1 << 20, ws_bytes=int(need.bytes * frac),
                      sm_count=torch.cuda.get_device_properties(0).multi_processor_count, extra={"cuda_graph_max_bs": 256})
        try:  # the check build-mode runs before allocating (the registry entry's)
            registry.get("flashinfer").check_workspace(sc.ctx.workspace.nbytes, WorkspaceQuery(
                kinds=[kind], num_sms=sc.ctx.device.sm_count, max_reqs=sc.ctx.req_to_token_pool.max_reqs,
                graph_max_bs=256))
            out[f"our_check_{frac}"] = "passed"
        except ConfigError as e:
            out[f"our_check_{frac}"] = f"refused: {e}"
        be = fib.create(sc.ctx)  # built either way, to see what FlashInfer itself does at that size
        reqs = list(range(1, 257))
        sc.fill_prefix(reqs, [4000] * 256)
        fb = sc.batch(ForwardMode.DECODE, reqs, [1] * 256)
        try:
            be.init_cuda_graph_state(256, 256)
            be.init_forward_metadata_capture_cuda_graph(256, 256, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
            q = torch.randn(256, 32, 128, dtype=torch.bfloat16, device="cuda")
            layer = make_layer(kind, 0)
            be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
            g.replay()
            torch.cuda.synchronize()
            out[f"flashinfer_{frac}"] = "plan+capture ok"
        except Exception as e:  # FlashInfer's own failure is the observation
            out[f"flashinfer_{frac}"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        be.close()
    R["workspace"] = out


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # µs


def phase_bench():
    """Crossover cc vs tc (raw wrappers), and our 32-layer decode step vs the same raw calls."""
    import flashinfer

    from pipeline.backends.flashinfer import backend as fib

    rows, cross = [], []
    for (h, hkv) in ((32, 32), (32, 8), (32, 4)):
        for B in (1, 8, 64, 256):
            for ctx in (512, 4096, 32768):
                if B * ctx > (1 << 21):
                    continue
                kind = make_kind(h, hkv, 128, layer_ids=(0,))
                sc = Scenario([kind], page_size=16, max_reqs=B + 1, max_context_len=ctx + 16,
                              num_slots=16 * (B * (ctx // 16 + 2) + 2), ws_bytes=384 << 20)
                be = fib.create(sc.ctx)
                reqs = list(range(1, B + 1))
                sc.fill_prefix(reqs, [ctx - 1] * B)
                fb = sc.batch(ForwardMode.DECODE, reqs, [1] * B)
                indptr, indices, last = be.page_table(fb.req_pool_indices, fb.seq_lens_cpu, fb.seq_lens)
                kv = be.paged_kv(0)
                q = torch.randn(B, h, 128, dtype=torch.bfloat16, device="cuda")
                t = {}
                for tc in (False, True):
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(sc.ctx.workspace.buffer, "NHD", use_tensor_cores=tc)
                    w.plan(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=h, num_kv_heads=hkv, head_dim=128,
                           page_size=16, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=kind.scaling)
                    t[tc] = _bench(lambda: w.run(q, kv))
                gb = 2 * B * ctx * hkv * 128 * 2 / 1e9
                cross.append(dict(h=h, hkv=hkv, B=B, ctx=ctx, cc_us=t[False], tc_us=t[True], tc_GBps=gb / (t[True] * 1e-6),
                                  tc_faster=t[True] < t[False]))
                be.close()
                del sc, be
                torch.cuda.empty_cache()
    import decode_step_overhead as dso  # our 32-layer step vs the same raw calls, eager and CUDA graph

    for B in (1, 8, 64, 256):
        for ctx in (512, 4096, 32768):
            if B * ctx <= (1 << 21):
                rows.append(dso.case(B, ctx, reps=15))
                torch.cuda.empty_cache()
    R["crossover"], R["bench"] = cross, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--phases", default="warmup,correctness,graphs,workspace,bench")
    a = ap.parse_args()
    R["device"] = torch.cuda.get_device_name(0)
    t00 = time.time()
    for ph in a.phases.split(","):
        t0 = time.time()
        try:
            if ph == "warmup":
                R["warmup"] = warmup_variants(variants(), jobs=a.jobs)
                READY.update(w["variant"] for w in R["warmup"] if w["status"] != "failed")
            else:
                globals()[f"phase_{ph}"]()
        except Exception:
            R["errors"][ph] = traceback.format_exc()[-3000:]
        R.setdefault("phase_s", {})[ph] = round(time.time() - t0, 1)
        json.dump(R, open(os.path.join(a.out, "fi_results.json"), "w"), indent=1, default=str)
        print(f"phase {ph}: {R['phase_s'][ph]} s{' ERROR' if ph in R['errors'] else ''}", flush=True)
    summarize(time.time() - t00)


def summarize(total):
    for w in R.get("warmup", []):
        print(f"  jit {w['variant']:<45} {w['status']:<9} {w['seconds']:7.1f} s {(w['error'] or '')[-200:]}")
    bad = [c for c in R["cases"] if not c["ok"]]
    print(f"correctness: {len(R['cases']) - len(bad)}/{len(R['cases'])} ok; max err32 "
          f"{max([c['err32'] for c in R['cases']] or [0]):.2e}, max err64 {max([c['err64'] for c in R['cases']] or [0]):.2e}")
    for c in bad[:20]:
        print("  FAIL", c)
    for g in R.get("graphs", []):
        print("  graph", g)
    print("  workspace", R.get("workspace"))
    print(f"{'H/Hkv':>6} {'B':>4} {'ctx':>6} {'cc µs':>8} {'tc µs':>8} {'tc GB/s':>8}")
    for c in R.get("crossover", []):
        print(f"{c['h']}/{c['hkv']:<3} {c['B']:>4} {c['ctx']:>6} {c['cc_us']:8.1f} {c['tc_us']:8.1f} {c['tc_GBps']:8.0f}")
    if R.get("bench"):
        import decode_step_overhead as dso

        print(dso.table(R["bench"]))
    for k, v in R["errors"].items():
        print(f"ERROR in {k}:\n{v[-1500:]}")
    print(f"total {total:.0f} s")


if __name__ == "__main__":
    main()
