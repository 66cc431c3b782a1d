"""Benchmark: the measured table auto-selection orders its candidates by (``pipeline/data/auto_evidence.json``).

One row per (device class, phase, layer kind, KV dtype), each candidate backend timed on the stated shape as a
CUDA-graph replay (median of ``triton.testing.do_bench``, the helpers of ``triton_kernels.py`` / ``mla_decode.py``),
bf16 q, scrambled pages. ``torch_native`` is the float64-checked reference and is not timed (``excluded``). A
measurement that raises is recorded under ``failed`` (the row then says ``unmeasured`` for that backend in
``plan``), never a crash. The table is stamped with the date, the GPU's name, its device class and arch, and the
torch / triton / flashinfer-python versions (states.evidence compares them with the installed ones).

Cases (phase, layer kind, KV dtype: shape — backends):

- decode, full, 16bit: B=64 ctx 4096, 32 q / 8 kv heads, D 128, page 16 — flashinfer, triton;
- decode, sinks, 16bit (gpt-oss): B=64 ctx 4096, 64 / 8 heads, D 64, window 128, per-head sinks — flashinfer
  (its attention-sink wrapper, fa2), triton;
- decode, softcap, 16bit (Gemma-2): B=32 ctx 8192, 16 / 8 heads, D 256, window 4096, softcap 50 — flashinfer,
  triton;
- decode, mla, 16bit (DeepSeek-V3): B=64 ctx 4096, 128 heads, latent 512 + 64, page 64 — flashinfer, triton;
- decode, full, fp8_e4m3: the full decode shape, k_scale 0.5, v_scale 0.25 — flashinfer, triton;
- prefill, full, 16bit: extend 8 x 512 new tokens on a 3584 prefix, 32 / 8 heads, D 128 — fa3, flashinfer (fa2),
  triton.

FlashInfer's decode path follows our backend's rule (``use_tensor_core_decode``). Runtime: ~1-2 minutes once
FlashInfer's modules and our kernels are compiled: run ``--warm`` first (every case's callables built and run once,
untimed; JIT compiles there); ``--budget-s`` (default 110) stops starting measurements past it (recorded as failed).
``--dry-run`` writes a table of fake timings without a GPU (the writer's test). ``--out PATH`` (default the shipped
table).

Usage (GPU): ``python3 benchmarks/auto_evidence.py --warm && python3 benchmarks/auto_evidence.py``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the repository (states, pipeline) and the timing helpers

from states import evidence  # noqa: E402  (torch-free)

SOURCE = "benchmarks/auto_evidence.py"
EXCLUDED = {"torch_native": "the float64-checked reference, not a serving kernel"}
DISTS = ("torch", "triton", "flashinfer-python")


class Case(NamedTuple):
    name: str
    phase: str
    layer_kind: str
    kv_dtype: str
    shape: str
    backends: tuple[str, ...]


CASES = (
    Case("decode-full", "decode", "full", "16bit", "B=64 ctx=4096 H=32/8 D=128 page 16", ("flashinfer", "triton")),
    Case("decode-sinks", "decode", "sinks", "16bit", "B=64 ctx=4096 window=128 sinks H=64/8 D=64 page 16 (gpt-oss)",
         ("flashinfer", "triton")),
    Case("decode-softcap", "decode", "softcap", "16bit",
         "B=32 ctx=8192 window=4096 softcap=50 H=16/8 D=256 page 16 (Gemma-2)", ("flashinfer", "triton")),
    Case("decode-mla", "decode", "mla", "16bit", "B=64 ctx=4096 H=128 latent 512+64 page 64 (DeepSeek-V3)",
         ("flashinfer", "triton")),
    Case("decode-fp8", "decode", "full", "fp8_e4m3", "B=64 ctx=4096 H=32/8 D=128 page 16 k_scale=0.5 v_scale=0.25",
         ("flashinfer", "triton")),
    Case("prefill-full", "prefill", "full", "16bit", "extend 8 x 512 new on a 3584 prefix H=32/8 D=128 page 16",
         ("fa3", "flashinfer", "triton")),
)


def measure(cases, time_one: Callable[[Case, str], float], device_class: str, budget_s: float,
            log: Callable[[str], None] = print) -> list[evidence.Row]:
    """A row per case: ``time_one(case, backend)`` µs per backend; what raises (or starts past ``budget_s``) is
    recorded under ``failed``."""
    rows, t0 = [], time.monotonic()
    for c in cases:
        times, failed = {}, {}
        for b in c.backends:
            if time.monotonic() - t0 > budget_s:
                failed[b] = f"not run: past the {budget_s:.0f} s budget"
                continue
            try:
                times[b] = round(float(time_one(c, b)), 2)
            except Exception as e:  # noqa: BLE001 - one failed measurement is a recorded failure, not a crash
                failed[b] = repr(e)[:300]
            log(f"{c.name:16} {b:11} " + (f"{times[b]:10.1f} us" if b in times else f"failed: {failed[b]}"))
        rows.append(evidence.Row(device_class=device_class, phase=c.phase, layer_kind=c.layer_kind,
                                 kv_dtype=c.kv_dtype, shape=c.shape, times_us=times, failed=failed,
                                 excluded=EXCLUDED, source=SOURCE))
    return rows


def _fake_time(c: Case, b: str) -> float:
    """--dry-run: deterministic fake timings; fa3 fails, so the failure path is written too."""
    if b == "fa3":
        raise RuntimeError("dry run: no GPU")
    return 100.0 + 10 * CASES.index(c) + (7.0 if b == "flashinfer" else 0.0)


def _versions() -> dict[str, str]:
    out = {}
    for d in DISTS:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = "absent"
    return out


def gpu_builders(device: str = "cuda") -> Callable[[Case, str], Callable[[], None]]:
    """``build(case, backend)`` → the callable to time on this GPU (inputs made once per case)."""
    import functools

    import torch

    import mla_decode as md
    import triton_kernels as tk
    from pipeline.backends.flashinfer.rules import use_tensor_core_decode
    from pipeline.backends.triton import launch

    dev, bf16, page = torch.device(device), torch.bfloat16, tk.PAGE
    ws = torch.empty(tk.WS_BYTES, dtype=torch.uint8, device=device)

    @functools.lru_cache(maxsize=1)
    def paged(name: str):
        torch.cuda.empty_cache()
        b, ctx, h, hkv, d = {"decode-full": (64, 4096, 32, 8, 128), "decode-fp8": (64, 4096, 32, 8, 128),
                             "decode-sinks": (64, 4096, 64, 8, 64), "decode-softcap": (32, 8192, 16, 8, 256)}[name]
        dt = torch.float8_e4m3fn if name == "decode-fp8" else bf16
        pool = tk.Pool((b * ctx // page + 1) * page, device, hkv=hkv, d=d, dtype=dt,
                       scales=tk.FP8_SCALES if name == "decode-fp8" else (1.0, 1.0))
        pg, r2t = pool.pages(b, ctx, seed=7)
        return pool, pg, r2t, torch.randn(b, h, d, dtype=bf16, device=device)

    def softcap(pool, pg, r2t, q, backend: str, window: int = 4096, cap: float = 50.0):
        b, h, d = q.shape
        if backend == "triton":
            cfg = launch.default_decode_config(d, dev)
            splits = launch.decode_max_splits(b, pool.hkv, tk._sms(dev), cfg)
            scratch = torch.empty(launch.decode_scratch_numel(b, h, d, splits), dtype=torch.float32, device=device)
            rows = torch.arange(b, dtype=torch.int64, device=device)
            lens = torch.full((b,), r2t.shape[1], dtype=torch.int32, device=device)
            out = torch.empty_like(q)
            return lambda: launch.decode_attention(q, pool.k, pool.v, r2t, rows, lens, out, sm_scale=d ** -0.5,
                                                   max_splits=splits, scratch=scratch, config=cfg,
                                                   sliding_window=window, logit_softcap=cap)
        import flashinfer

        npg = pg.shape[1]
        indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * npg
        last = torch.full((b,), page, dtype=torch.int32, device=device)
        idx = pg.reshape(-1).contiguous()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=use_tensor_core_decode(h // pool.hkv, b),
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=idx, paged_kv_last_page_len_buffer=last)
        w.plan(indptr, idx, last, h, pool.hkv, d, page, q_data_type=bf16, kv_data_type=bf16, sm_scale=d ** -0.5,
               window_left=window - 1, logits_soft_cap=cap)
        kv = (pool.k.view(-1, page, pool.hkv, d), pool.v.view(-1, page, pool.hkv, d))
        out = torch.empty_like(q)
        return lambda: w.run(q, kv, out=out)

    @functools.lru_cache(maxsize=1)
    def mla():
        torch.cuda.empty_cache()
        cache = md.Cache((64 * 4096 // 64 + 1) * 64, 64, device)
        pg, r2t = cache.pages(64, 4096, seed=3)
        return cache, pg, r2t, torch.randn(64, md.H, md.D, dtype=bf16, device=device)

    @functools.lru_cache(maxsize=1)
    def extend():
        torch.cuda.empty_cache()
        return tk._extend_inputs(device, 8, 512, 3584)

    def fa2_prefill(x):
        import flashinfer

        b, new = x["b"], x["new"]
        qo = torch.arange(b + 1, dtype=torch.int32, device=device) * new
        npg = x["pg"].shape[1]
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * npg
        last = torch.full((b,), page, dtype=torch.int32, device=device)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        w.plan(qo, kv_indptr, x["pg"].reshape(-1).contiguous(), last, tk.H, tk.HKV, tk.D, page, causal=True,
               sm_scale=tk.D ** -0.5, q_data_type=bf16, kv_data_type=bf16)
        kv = (x["k"].view(-1, page, tk.HKV, tk.D), x["v"].view(-1, page, tk.HKV, tk.D))
        out = torch.empty_like(x["q"])
        return lambda: w.run(x["q"], kv, out=out)

    def build(c: Case, backend: str) -> Callable[[], None]:
        if c.name == "decode-mla":
            cache, pg, r2t, q = mla()
            if backend == "flashinfer":
                return md.flashinfer_decode(cache, pg, r2t.shape[1], q, ws)[0]
            return md.ours_decode(cache, r2t, q, md._default_cfg())[0]
        if c.name == "prefill-full":
            x = extend()
            if backend == "fa3":
                return tk.fi_extend(x, ws)[0]
            if backend == "flashinfer":
                return fa2_prefill(x)
            return tk.ours_extend(x, launch.default_extend_config(tk.D, dev))[0]
        pool, pg, r2t, q = paged(c.name)
        b, h, d = q.shape
        if c.name == "decode-softcap":
            return softcap(pool, pg, r2t, q, backend)
        if c.name == "decode-sinks":
            sinks = torch.randn(h, dtype=torch.float32, device=device)
            if backend == "flashinfer":
                return tk.fi_sink_decode(pool, pg, q, sinks, ws, 128)[0]
            return tk.ours_decode(pool, r2t, q, launch.default_decode_config(d, dev), window=128, sinks=sinks)[0]
        if backend == "flashinfer":
            kv = "fp8_e4m3" if c.name == "decode-fp8" else "bfloat16"
            return tk.fi_decode(pool, pg, q, ws, tensor_cores=use_tensor_core_decode(h // pool.hkv, b, kv))[0]
        return tk.ours_decode(pool, r2t, q, launch.default_decode_config(d, dev))[0]

    return build


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default=str(evidence.DATA_PATH), help="where to write the table (default: the shipped one)")
    ap.add_argument("--dry-run", action="store_true", help="fake timings, no GPU: exercises the writer")
    ap.add_argument("--warm", action="store_true", help="build and run every case once, untimed (JIT compiles)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="start no measurement past this many seconds")
    ap.add_argument("--only", default="", help="comma-separated case names (default all: " +
                    ", ".join(c.name for c in CASES) + ")")
    a = ap.parse_args(argv)
    cases = [c for c in CASES if not a.only or c.name in a.only.split(",")]
    if a.dry_run:
        gpu, arch, time_one = "dry run (no GPU)", "none", _fake_time
        cls = "dry-run"
    else:
        import torch
        from triton_kernels import _graph, _us

        from pipeline.core.contracts import DeviceFacts

        cc = torch.cuda.get_device_capability()
        gpu, arch = torch.cuda.get_device_name(), f"sm{cc[0]}{cc[1]}"
        cls = evidence.device_class(DeviceFacts(type="cuda", name=gpu, compute_capability=cc))
        build = gpu_builders()
        if a.warm:
            for c in cases:
                for b in c.backends:
                    try:
                        build(c, b)()
                        torch.cuda.synchronize()
                        print("warm", c.name, b, "ok")
                    except Exception as e:  # noqa: BLE001 - a module that does not build fails in the table too
                        print("warm", c.name, b, "failed:", repr(e)[:300])
            return 0
        time_one = lambda c, b: _us(_graph(build(c, b)))  # noqa: E731
    rows = measure(cases, time_one, cls, a.budget_s)
    table = evidence.Table(date=datetime.date.today().isoformat(), gpu=gpu, device_class=cls, arch=arch,
                           versions=_versions(), rows=rows, source=SOURCE)
    evidence.write(table, a.out)
    print(f"wrote {a.out}: {len(rows)} rows, {sum(len(r.failed) for r in rows)} failed measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
