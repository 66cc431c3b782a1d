"""Benchmark: our Triton decode/extend kernels against FlashInfer, in one process, on one GPU (issues 7, 16 §2, 19).

Every row times both sides as CUDA-graph replays (median of ``triton.testing.do_bench``) on scrambled pages of
one paged pool, bf16 q, page 16. Rows (``rows()`` returns them as dicts; ``python benchmarks/triton_kernels.py``
prints the table and the issue-19 / issue-16 targets):

- ``copy``: device copy bandwidth (read + write bytes over time), the memory ceiling;
- ``decode``: B in {1, 8, 64, 256} x ctx in {512, 4096, 32768}, 32 q / 8 kv heads, D 128: FlashInfer
  ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` vs ours; GB/s counts the K/V bytes read;
  ratio = FlashInfer time / ours (> 1: ours faster). Target: ratio >= 0.97 everywhere, and >= 93 %
  of the copy ceiling wherever FlashInfer is above it;
- ``fp8``: B=64 ctx 4096, K/V stored as fp8 e4m3 / e5m2 with k_scale 0.5, v_scale 0.25 (q bf16): ours vs
  FlashInfer's fp8 decode, tensor-core and CUDA-core wrappers (``run(k_scale=, v_scale=)``); ratio against the
  faster FlashInfer path (target >= 0.90) and time against our bf16 decode of the same shape
  (half the bytes: ideally ~0.5);
- ``window``: decode at ctx 32768 with a 4096-token sliding window, B in {1, 8, 64, 256}: ours, FlashInfer
  with ``window_left=4095`` over the whole page table, and FlashInfer given only the window's pages (what
  sglang's FlashInfer backend plans for SWA layers); ``vs_full`` = time / the same side's full decode at
  ctx 4096 (target <= 1.10: pages outside the window are never read);
- ``extend``: 64 x 512 new on a 3584 prefix, 8 x 4096 new on no prefix, 256 x 64 new on a 2048 prefix (causal):
  FlashInfer ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` vs ours; TFLOP/s counts the visible
  (query, key) pairs, ``4 * D`` flop each (target ratio >= 0.80);
- ``extend-window``: 8 x 512 new on a 32256 prefix with a 4096 window vs the same side's 8 x 512 on a 3584
  prefix without one (``vs_full`` <= 1.10); FlashInfer fa3 with ``window_left``;
- ``sinks``: gpt-oss style decode (64 q / 8 kv heads, D 64, window 128, per-head sinks), B=64 ctx 4096:
  ours vs FlashInfer's ``BatchAttentionWithAttentionSinkWrapper`` (fa2); reported, no target.

Flags: ``--runs N`` runs the whole table N times in one process (a target counts as met only if it is met in
every run); ``--sweep`` also times config candidates (decode at B=256 and B=8 ctx 32768, extend) once;
``--warm NAME`` only JIT-compiles one FlashInfer module (``--warm list`` prints the names; run them in
parallel processes before the table); ``--fi-ok DIR``: only FlashInfer variants whose warm-up left
``DIR/NAME.ok`` are timed (a missing one is a row with an error instead of a long JIT compile in the timed
process); ``--precompile N`` compiles our kernel variants in N processes first; ``--json PATH`` / ``--out DIR``
write the rows (``DIR/triton_kernels.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.platforms.cuda import capture_graph

H, HKV, D, PAGE = 32, 8, 128, 16
DECODE_B = (1, 8, 64, 256)
DECODE_CTX = (512, 4096, 32768)
EXTEND_SHAPES = ((64, 512, 3584), (8, 4096, 0), (256, 64, 2048))       # (B, new tokens, prefix)
EXT_B, EXT_NEW, EXT_PREFIX = EXTEND_SHAPES[0]                          # the issue-7 row (kept for callers)
WINDOW, WINDOW_CTX = 4096, 32768
EXT_WINDOW = (8, 512, 32256, 3584)                                     # B, new, prefix with window, prefix without
FP8_SHAPE, FP8_SCALES = (64, 4096), (0.5, 0.25)
SINK = dict(h=64, hkv=8, d=64, b=64, ctx=4096, window=128)
SWEEP_DECODE_SHAPES = ((256, 32768), (256, 4096), (256, 512), (8, 32768), (1, 512))   # where the decode defaults are weakest
WS_BYTES = 512 << 20
COPY_BYTES = 1 << 31
DEVICE = "cuda"   # the device whose arch picks the kernel configs (tests run the table on CPU under the interpreter)
TARGET_DECODE, TARGET_COPY, TARGET_EXTEND, TARGET_WINDOW, TARGET_FP8 = 0.97, 0.93, 0.80, 1.10, 0.90
FI_WARM = ("decode", "decode-window", "decode-fp8-tc-e4m3", "decode-fp8-tc-e5m2", "decode-fp8-cc-e4m3",
           "decode-fp8-cc-e5m2", "prefill", "prefill-window", "sink")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _us(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def _graph(fn: Callable[[], None]) -> Callable[[], None]:
    """Capture ``fn`` (pipeline.platforms.cuda.capture_graph: warm-up on a side stream first) and return the replay."""
    return capture_graph(fn)[0].replay


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def copy_bandwidth(device: str) -> dict:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    x = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = _us(lambda: y.copy_(x))
    return dict(kind="copy", shape="2 GiB", impl="torch copy_", time_us=t, gbps=2 * x.numel() / t / 1e3)


class Pool:
    """One K/V pool ([slots, hkv, d], ``dtype``) of random data; fp8 pools hold ``round(real / scale)``."""

    def __init__(self, slots: int, device: str, hkv: Optional[int] = None, d: Optional[int] = None,
                 dtype: torch.dtype = torch.bfloat16, scales: tuple[float, float] = (1.0, 1.0)) -> None:
        hkv, d = hkv or HKV, d or D
        self.k = torch.empty(slots, hkv, d, dtype=torch.bfloat16, device=device).normal_()
        self.v = torch.empty(slots, hkv, d, dtype=torch.bfloat16, device=device).normal_()
        if dtype != torch.bfloat16:   # real K/V ~ N(0, 1), stored = round_to_fp8(real / scale)
            self.k = (self.k.float() / scales[0]).to(dtype)
            self.v = (self.v.float() / scales[1]).to(dtype)
        self.num_pages, self.device, self.hkv, self.d, self.scales = slots // PAGE, device, hkv, d, scales

    def pages(self, b: int, ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scrambled pages for b requests of ctx tokens: (page ids [b, ctx/PAGE], req_to_token [b, ctx])."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        n = b * ctx // PAGE
        pg = (torch.randperm(self.num_pages - 1, generator=g, device=self.device)[:n] + 1).to(torch.int32)
        pg = pg.view(b, ctx // PAGE)
        r2t = (pg[:, :, None] * PAGE + torch.arange(PAGE, device=self.device, dtype=torch.int32)).view(b, ctx)
        return pg, r2t.contiguous()


# ------------------------------------------------------------------------------------------------ FlashInfer
_FI_OK: Optional[set] = None   # warm-up names allowed to run (None: all)


class FlashInferMissing(RuntimeError):
    """A FlashInfer module whose warm-up did not finish: timing it would JIT-compile in the timed process."""


def _need(name: str) -> None:
    if _FI_OK is not None and name not in _FI_OK:
        raise FlashInferMissing(f"flashinfer module '{name}' not warmed up (compile failed or timed out)")


def fi_decode(pool: Pool, pg: torch.Tensor, q: torch.Tensor, ws: torch.Tensor, *, tensor_cores: bool = True,
              window_left: int = -1, last_pages: Optional[int] = None) -> tuple[Callable, torch.Tensor]:
    """FlashInfer paged decode in CUDA-graph mode over ``pg`` (or only its last ``last_pages`` pages)."""
    name = ("decode-window" if window_left >= 0 else "decode") if pool.k.dtype == torch.bfloat16 else \
        f"decode-fp8-{'tc' if tensor_cores else 'cc'}-{'e4m3' if pool.k.dtype == torch.float8_e4m3fn else 'e5m2'}"
    _need(name)
    import flashinfer

    if last_pages is not None:
        pg = pg[:, -last_pages:]
    b, npg = pg.shape
    dev = q.device
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * npg
    last = torch.full((b,), PAGE, dtype=torch.int32, device=dev)
    idx = pg.reshape(-1).contiguous()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                                                      paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=idx,
                                                      paged_kv_last_page_len_buffer=last)
    h, d = q.shape[1], q.shape[2]
    w.plan(indptr, idx, last, h, pool.hkv, d, PAGE, q_data_type=q.dtype, kv_data_type=pool.k.dtype,
           sm_scale=d ** -0.5, window_left=window_left)
    kv = (pool.k.view(-1, PAGE, pool.hkv, d), pool.v.view(-1, PAGE, pool.hkv, d))
    out = torch.empty_like(q)
    if pool.k.dtype == torch.bfloat16:
        return (lambda: w.run(q, kv, out=out)), out
    ks, vs = pool.scales
    return (lambda: w.run(q, kv, out=out, k_scale=ks, v_scale=vs)), out


def fi_sink_decode(pool: Pool, pg: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor, ws: torch.Tensor,
                   window: int) -> tuple[Callable, torch.Tensor]:
    """FlashInfer's attention-sink wrapper (fa2) as decode: one query row per request, CUDA-graph mode."""
    _need("sink")
    import flashinfer

    b, npg = pg.shape
    dev = q.device
    h, d = q.shape[1], q.shape[2]
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * npg
    last = torch.full((b,), PAGE, dtype=torch.int32, device=dev)
    idx = pg.reshape(-1).contiguous()
    w = flashinfer.BatchAttentionWithAttentionSinkWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo.clone(), paged_kv_indptr_buf=indptr.clone(),
        paged_kv_indices_buf=idx.clone(), paged_kv_last_page_len_buf=last.clone(), backend="fa2",
        q_data_type=q.dtype, kv_data_type=pool.k.dtype, head_dim_qk=d, head_dim_vo=d, window_left=window - 1)
    w.plan(qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=idx, paged_kv_last_page_len=last, num_qo_heads=h,
           num_kv_heads=pool.hkv, head_dim_qk=d, head_dim_vo=d, page_size=PAGE, causal=False, window_left=window - 1,
           sm_scale=d ** -0.5, q_data_type=q.dtype, kv_data_type=pool.k.dtype)
    kv = (pool.k.view(-1, PAGE, pool.hkv, d), pool.v.view(-1, PAGE, pool.hkv, d))
    holder = {}

    def run() -> None:
        holder["out"] = w.run(q, kv, sinks, d ** -0.5)
    run()
    return run, holder


def fi_extend(x: dict, ws: torch.Tensor, window_left: int = -1) -> tuple[Callable, torch.Tensor]:
    """FlashInfer fa3 paged prefill (causal) over prefix + new tokens, as sglang's extend with a prefix."""
    _need("prefill-window" if window_left >= 0 else "prefill")
    import flashinfer

    dev = x["q"].device
    b, new = x["b"], x["new"]
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev) * new
    npg = x["pg"].shape[1]
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * npg
    last = torch.full((b,), PAGE, dtype=torch.int32, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo, kv_indptr, x["pg"].reshape(-1).contiguous(), last, H, HKV, D, PAGE, causal=True,
           sm_scale=D ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, window_left=window_left)
    kv = (x["k"].view(-1, PAGE, HKV, D), x["v"].view(-1, PAGE, HKV, D))
    out = torch.empty_like(x["q"])
    return (lambda: w.run(x["q"], kv, out=out)), out


# ------------------------------------------------------------------------------------------------ ours
def ours_decode(pool: Pool, r2t: torch.Tensor, q: torch.Tensor, cfg, *, window: Optional[int] = None,
                sinks: Optional[torch.Tensor] = None) -> tuple[Callable, torch.Tensor]:
    from pipeline.backends.triton import launch

    b, ctx = r2t.shape
    h, d = q.shape[1], q.shape[2]
    splits = launch.decode_max_splits(b, pool.hkv, _sms(q.device), cfg)
    scratch = torch.empty(launch.decode_scratch_numel(b, h, d, splits), dtype=torch.float32, device=q.device)
    rows = torch.arange(b, dtype=torch.int64, device=q.device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    ks, vs = pool.scales

    def run() -> None:
        launch.decode_attention(q, pool.k, pool.v, r2t, rows, lens, out, sm_scale=d ** -0.5, max_splits=splits,
                                scratch=scratch, config=cfg, sliding_window=window, sinks=sinks, k_scale=ks,
                                v_scale=vs)
    return run, out


def _extend_inputs(device: str, b: int, new: int, prefix: int, seed: int = 1) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    total = prefix + new
    slots = (b * total // PAGE + 1) * PAGE
    k = torch.empty(slots, HKV, D, dtype=torch.bfloat16, device=device).normal_(generator=g)
    v = torch.empty_like(k).normal_(generator=g)
    pg = (torch.randperm(slots // PAGE - 1, generator=g, device=device)[: b * total // PAGE] + 1).int()
    pg = pg.view(b, total // PAGE)
    r2t = (pg[:, :, None] * PAGE + torch.arange(PAGE, device=device, dtype=torch.int32)).view(b, total)
    new_slots = r2t[:, prefix:].reshape(-1).long()
    q = torch.randn(b * new, H, D, dtype=torch.bfloat16, device=device, generator=g)
    return dict(k=k, v=v, pg=pg, r2t=r2t.contiguous(), q=q, k_new=k[new_slots].contiguous(),
                v_new=v[new_slots].contiguous(), b=b, new=new, prefix=prefix)


def ours_extend(x: dict, cfg, window: Optional[int] = None) -> tuple[Callable, torch.Tensor]:
    from pipeline.backends.triton import launch

    dev = x["q"].device
    b, new, prefix = x["b"], x["new"], x["prefix"]
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev) * new
    pre = torch.full((b,), prefix, dtype=torch.int32, device=dev)
    rows = torch.arange(b, dtype=torch.int64, device=dev)
    out = torch.empty_like(x["q"])

    def run() -> None:
        launch.extend_attention(x["q"], x["k_new"], x["v_new"], x["k"], x["v"], x["r2t"], rows, qo, pre, out,
                                max_extend_len=new, sm_scale=D ** -0.5, config=cfg, sliding_window=window)
    return run, out


def extend_flops(b: int, new: int, prefix: int, window: Optional[int] = None) -> float:
    """``4 * D`` flop per visible (query, key) pair, per q head (causal, optional window)."""
    pairs = 0
    for i in range(new):
        seen = prefix + i + 1
        pairs += min(seen, window) if window else seen
    return b * H * 4 * D * pairs


# ------------------------------------------------------------------------------------------------ rows
def _row(kind: str, shape: str, impl: str, fn: Callable[[], Callable], *, nbytes: float = 0, flops: float = 0,
         graph: bool = True) -> dict:
    """Time ``fn()`` (which builds the callable) as a graph replay; an exception becomes an error row."""
    try:
        run = fn()
        t = _us(_graph(run) if graph else run)
    except Exception as e:  # noqa: BLE001 - a config or module that does not run is a row, not a crash
        return dict(kind=kind, shape=shape, impl=impl, error=repr(e)[:300])
    r = dict(kind=kind, shape=shape, impl=impl, time_us=t)
    if nbytes:
        r["gbps"] = nbytes / t / 1e3
    if flops:
        r["tflops"] = flops / t / 1e6
    return r


def _vs(ours: dict, ref: dict, key: str = "ratio") -> None:
    """ours[key] = ref time / ours time (FlashInfer over ours: > 1 means ours is faster)."""
    if "time_us" in ours and "time_us" in ref:
        ours[key] = ref["time_us"] / ours["time_us"]


def _err(a: torch.Tensor, b) -> float:
    from pipeline.runtime.reference import rel_err

    b = b["out"] if isinstance(b, dict) else b
    return float(rel_err(a, b))


def decode_rows(pool: Pool, ws: torch.Tensor, shapes, configs, kind: str = "decode") -> list[dict]:
    """FlashInfer (tensor cores) and our decode (each config) per shape, all as CUDA-graph replays."""
    out = []
    for b, ctx in shapes:
        pg, r2t = pool.pages(b, ctx, seed=b * 7 + ctx)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device=pool.device)
        nbytes = 2 * b * ctx * HKV * D * pool.k.element_size()
        shape = f"B={b} ctx={ctx}"
        fi = {}
        fi_row = _row(kind, shape, "flashinfer-tc", lambda: fi.setdefault("r", fi_decode(pool, pg, q, ws))[0],
                      nbytes=nbytes)
        out.append(fi_row)
        for name, cfg in configs:
            mine = {}
            r = _row(kind, shape, f"triton{name}", lambda: mine.setdefault("r", ours_decode(pool, r2t, q, cfg))[0],
                     nbytes=nbytes)
            _vs(r, fi_row)
            if "r" in fi and "r" in mine and "time_us" in r:
                r["err_vs_fi"] = _err(mine["r"][1], fi["r"][1])
            out.append(r)
    return out


def _fp8_sweep_configs() -> list:
    """fp8 tiles are half the bytes of bf16 ones: candidates with twice the keys per tile."""
    from pipeline.backends.triton.launch import DecodeConfig, default_decode_config

    d0 = default_decode_config(D, torch.device(DEVICE))
    var = [dict(block_n=128), dict(block_n=128, num_stages=4), dict(num_stages=4)]
    return [("[" + " ".join(f"{k}={x}" for k, x in v.items()) + "]", DecodeConfig(**{**d0.__dict__, **v}))
            for v in var]


def fp8_rows(device: str, ws: torch.Tensor, bf16_rows: list[dict], configs: Optional[list] = None,
             formats: Optional[tuple] = None, kind: str = "fp8") -> list[dict]:
    """fp8 e4m3 / e5m2 decode at FP8_SHAPE: ours vs FlashInfer tensor-core and CUDA-core, and vs our bf16.
    ``configs`` [(name, DecodeConfig)]: ours with each (default: the default config)."""
    b, ctx = FP8_SHAPE
    shape = f"B={b} ctx={ctx}"
    ours_bf16 = next((r for r in bf16_rows if r.get("shape") == shape and r["impl"] == "triton"
                      and "time_us" in r), None)
    out = []
    from pipeline.backends.triton.launch import default_decode_config
    configs = configs or [("", default_decode_config(D, torch.device(device)))]
    for fmt, dt in FP8.items():
        if formats and fmt not in formats:
            continue
        pool = Pool((b * ctx // PAGE + 1) * PAGE, device, dtype=dt, scales=FP8_SCALES)
        pg, r2t = pool.pages(b, ctx, seed=3)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device=device)
        nbytes = 2 * b * ctx * HKV * D * 1
        fis, res = [], {}
        for tc in (True, False):
            impl = f"flashinfer-{'tc' if tc else 'cc'}-{fmt}"
            r = _row(kind, shape, impl, lambda: res.setdefault(impl, fi_decode(pool, pg, q, ws, tensor_cores=tc))[0],
                     nbytes=nbytes)
            out.append(r)
            fis.append(r)
        for name, cfg in configs:
            mine = {}
            r = _row(kind, shape, f"triton-{fmt}{name}",
                     lambda: mine.setdefault("r", ours_decode(pool, r2t, q, cfg))[0], nbytes=nbytes)
            timed = [f for f in fis if "time_us" in f]
            if timed:
                best = min(timed, key=lambda f: f["time_us"])
                _vs(r, best)
                r["vs_impl"] = best["impl"]
                key = best["impl"]
                if "r" in mine and key in res and "time_us" in r:
                    r["err_vs_fi"] = _err(mine["r"][1], res[key][1])
            if ours_bf16 is not None and "time_us" in r:
                r["vs_bf16"] = r["time_us"] / ours_bf16["time_us"]
            out.append(r)
    return out


def window_rows(pool: Pool, ws: torch.Tensor, full_rows: list[dict], cfg) -> list[dict]:
    """Decode at ctx WINDOW_CTX with a WINDOW-token window vs the same side's full decode at ctx WINDOW."""
    out = []
    for b in DECODE_B:
        pg, r2t = pool.pages(b, WINDOW_CTX, seed=b * 11)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device=pool.device)
        nbytes = 2 * b * WINDOW * HKV * D * 2
        shape = f"B={b} ctx={WINDOW_CTX} window={WINDOW}"
        full = {r["impl"]: r for r in full_rows if r.get("shape") == f"B={b} ctx={WINDOW}" and "time_us" in r}
        res = {}
        rows = [
            _row("window", shape, "flashinfer-tc", lambda: res.setdefault("fi", fi_decode(
                pool, pg, q, ws, window_left=WINDOW - 1))[0], nbytes=nbytes),
            _row("window", shape, "flashinfer-tc-window-pages", lambda: res.setdefault("fiw", fi_decode(
                pool, pg, q, ws, window_left=WINDOW - 1, last_pages=WINDOW // PAGE))[0], nbytes=nbytes),
            _row("window", shape, "triton", lambda: res.setdefault("ours", ours_decode(
                pool, r2t, q, cfg, window=WINDOW))[0], nbytes=nbytes),
        ]
        for r, base in zip(rows, ("flashinfer-tc", "flashinfer-tc", "triton")):
            if base in full and "time_us" in r:
                r["vs_full"] = r["time_us"] / full[base]["time_us"]
        _vs(rows[2], rows[0])
        if "ours" in res and "fi" in res:
            rows[2]["err_vs_fi"] = _err(res["ours"][1], res["fi"][1])
        out += rows
    return out


def sink_rows(device: str, ws: torch.Tensor) -> list[dict]:
    """gpt-oss style decode: 64/8 heads, D 64, window 128, sinks; ours vs FlashInfer's sink wrapper."""
    s = SINK
    pool = Pool((s["b"] * s["ctx"] // PAGE + 1) * PAGE, device, hkv=s["hkv"], d=s["d"])
    pg, r2t = pool.pages(s["b"], s["ctx"], seed=5)
    q = torch.randn(s["b"], s["h"], s["d"], dtype=torch.bfloat16, device=device)
    sinks = torch.randn(s["h"], dtype=torch.float32, device=device)
    shape = f"B={s['b']} ctx={s['ctx']} window={s['window']} sinks H={s['h']}/{s['hkv']} D={s['d']}"
    nbytes = 2 * s["b"] * s["window"] * s["hkv"] * s["d"] * 2
    from pipeline.backends.triton.launch import default_decode_config
    cfg = default_decode_config(s["d"], torch.device(device))
    res = {}
    fi = _row("sinks", shape, "flashinfer-sink-fa2", lambda: res.setdefault("fi", fi_sink_decode(
        pool, pg, q, sinks, ws, s["window"]))[0], nbytes=nbytes)
    mine = _row("sinks", shape, "triton", lambda: res.setdefault("ours", ours_decode(
        pool, r2t, q, cfg, window=s["window"], sinks=sinks))[0], nbytes=nbytes)
    _vs(mine, fi)
    if "ours" in res and "fi" in res and "out" in res["fi"][1]:
        mine["err_vs_fi"] = _err(res["ours"][1], res["fi"][1])
    return [fi, mine]


def extend_rows(ws: torch.Tensor, configs, device: str, shapes=None) -> list[dict]:
    """fa3 prefill and our extend (each config) per (B, new, prefix) shape (default EXTEND_SHAPES)."""
    out = []
    for b, new, prefix in shapes or EXTEND_SHAPES:
        x = _extend_inputs(device, b, new, prefix)
        flops = extend_flops(b, new, prefix)
        shape = f"B={b} new={new} prefix={prefix}"
        res = {}
        fi = _row("extend", shape, "flashinfer-fa3", lambda: res.setdefault("fi", fi_extend(x, ws))[0], flops=flops)
        out.append(fi)
        for name, cfg in configs:
            key = f"triton{name}"
            r = _row("extend", shape, key, lambda: res.setdefault(key, ours_extend(x, cfg))[0], flops=flops)
            _vs(r, fi)
            if key in res and "fi" in res and "time_us" in r:
                r["err_vs_fi"] = _err(res[key][1], res["fi"][1])
            out.append(r)
        torch.cuda.empty_cache()
    return out


def extend_window_rows(ws: torch.Tensor, cfg, device: str) -> list[dict]:
    """Extend with a WINDOW window on a long prefix vs the same side's extend on a short prefix, no window."""
    b, new, prefix, short = EXT_WINDOW
    out = []
    res = {}
    xs = _extend_inputs(device, b, new, short, seed=2)
    base = [_row("extend-window", f"B={b} new={new} prefix={short}", "flashinfer-fa3",
                 lambda: res.setdefault("fi0", fi_extend(xs, ws))[0], flops=extend_flops(b, new, short)),
            _row("extend-window", f"B={b} new={new} prefix={short}", "triton",
                 lambda: res.setdefault("t0", ours_extend(xs, cfg))[0], flops=extend_flops(b, new, short))]
    xl = _extend_inputs(device, b, new, prefix, seed=3)
    shape = f"B={b} new={new} prefix={prefix} window={WINDOW}"
    fl = extend_flops(b, new, prefix, WINDOW)
    win = [_row("extend-window", shape, "flashinfer-fa3", lambda: res.setdefault("fi1", fi_extend(
               xl, ws, window_left=WINDOW - 1))[0], flops=fl),
           _row("extend-window", shape, "triton", lambda: res.setdefault("t1", ours_extend(xl, cfg, WINDOW))[0],
                flops=fl)]
    for w, b0 in zip(win, base):
        if "time_us" in w and "time_us" in b0:
            w["vs_full"] = w["time_us"] / b0["time_us"]
    _vs(win[1], win[0])
    if "t1" in res and "fi1" in res:
        win[1]["err_vs_fi"] = _err(res["t1"][1], res["fi1"][1])
    out += base + win
    torch.cuda.empty_cache()
    return out


def _decode_configs(sweep: bool) -> list:
    from pipeline.backends.triton.launch import DecodeConfig, default_decode_config

    d0 = default_decode_config(D, torch.device(DEVICE))
    base = [("", d0)]
    if not sweep:
        return base
    # B=256 runs one split per (request, kv head): 64-key tiles x 3 stages (~96 KB) let 2 programs share an SM,
    # 128-key tiles x 3 stages hold ~192 KB (1 program/SM); 4 stages keeps more gathers in flight.
    var = [dict(block_n_single=128), dict(num_stages=4), dict(block_n_single=128, num_stages=4),
           dict(programs_per_sm=4)]
    return base + [("[" + " ".join(f"{k}={x}" for k, x in v.items()) + "]", DecodeConfig(**{**d0.__dict__, **v}))
                   for v in var]


def _extend_configs(sweep: bool) -> list:
    from pipeline.backends.triton.launch import ExtendConfig, default_extend_config

    base = [("", default_extend_config(D, torch.device(DEVICE)))]
    if not sweep:
        return base
    # 128x128x8x3 spills 104 B on an offline sm90 compile (triton 3.9); 128x64 does not (216 registers).
    var = [(128, 64, 8, 3, None), (128, 64, 8, 4, None), (128, 128, 8, 3, True), (128, 128, 8, 3, False),
           (64, 128, 4, 3, None)]
    return base + [(f"[m{m} n{n} w{w} s{s}{'' if p is None else ' pack' if p else ' nopack'}]",
                    ExtendConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, pack_gqa=p))
                   for m, n, w, s, p in var]


def one_run(device: str, ws: torch.Tensor, run: int) -> list[dict]:
    """One full table (decode grid, fp8, window, sinks, extend, extend-window) tagged with ``run``."""
    from pipeline.backends.triton.launch import default_decode_config, default_extend_config

    out = []
    pool = Pool((max(DECODE_B) * max(DECODE_CTX + (WINDOW_CTX,)) // PAGE + 1) * PAGE, device)
    shapes = [(b, c) for c in DECODE_CTX for b in DECODE_B]
    dec = decode_rows(pool, ws, shapes, _decode_configs(False))
    out += dec
    out += window_rows(pool, ws, dec, default_decode_config(D, torch.device(device)))
    del pool
    torch.cuda.empty_cache()
    out += fp8_rows(device, ws, dec)
    out += sink_rows(device, ws)
    out += extend_rows(ws, _extend_configs(False), device)
    out += extend_window_rows(ws, default_extend_config(D, torch.device(device)), device)
    for r in out:
        r["run"] = run
    return out


def sweep_rows(device: str, ws: torch.Tensor) -> list[dict]:
    """Config candidates once: decode where the defaults are weakest, extend on every extend shape."""
    pool = Pool((max(b * c for b, c in SWEEP_DECODE_SHAPES) // PAGE + 1) * PAGE, device)
    out = [dict(r, kind="decode-sweep") for r in decode_rows(pool, ws, SWEEP_DECODE_SHAPES, _decode_configs(True))]
    del pool
    torch.cuda.empty_cache()
    out += [dict(r, kind="extend-sweep") for r in extend_rows(ws, _extend_configs(True), device)]
    out += fp8_rows(device, ws, [], configs=_fp8_sweep_configs(), formats=("e4m3",), kind="fp8-sweep")
    return out


def rows(device: str = "cuda", sweep: bool = False, runs: int = 1,
         progress: Optional[Callable[[list[dict], list[dict]], None]] = None) -> list[dict]:
    """All benchmark rows as dicts (kind, shape, impl, time_us, gbps/tflops, ratio, vs_full, vs_bf16, run).
    ``progress(new_rows, all_rows)`` is called after the copy row, each run and the sweep."""
    torch.manual_seed(0)
    out = [copy_bandwidth(device)]
    report = progress or (lambda new, every: None)
    report(out, out)
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=device)
    for i in range(runs):
        new = one_run(device, ws, i + 1)
        out += new
        report(new, out)
    if sweep:
        new = sweep_rows(device, ws)
        out += new
        report(new, out)
    return out


# ------------------------------------------------------------------------------------------------ targets
def targets(rs: list[dict]) -> list[dict]:
    """Each issue-19 / issue-16 target per run: value, limit, met; a target is met only if met in every run."""
    copy = next((r["gbps"] for r in rs if r["kind"] == "copy"), None)
    runs = sorted({r["run"] for r in rs if "run" in r})
    out = []

    def add(name, run, value, limit, higher):
        ok = None if value is None else (value >= limit if higher else value <= limit)
        out.append(dict(target=name, run=run, value=value, limit=limit, met=ok))

    for run in runs:
        rr = [r for r in rs if r.get("run") == run]
        for r in rr:
            if r["kind"] == "decode" and r["impl"] == "triton":
                add(f"decode {r['shape']} vs flashinfer-tc", run, r.get("ratio"), TARGET_DECODE, True)
                fi = next((f for f in rr if f["kind"] == "decode" and f["shape"] == r["shape"]
                           and f["impl"] == "flashinfer-tc" and "gbps" in f), None)
                if copy and fi and fi["gbps"] >= TARGET_COPY * copy:
                    add(f"decode {r['shape']} GB/s vs copy", run, r.get("gbps", 0) / copy, TARGET_COPY, True)
            if r["kind"] == "extend" and r["impl"] == "triton":
                add(f"extend {r['shape']} vs fa3", run, r.get("ratio"), TARGET_EXTEND, True)
            if r["kind"] in ("window", "extend-window") and "window=" in r["shape"]:
                add(f"{r['kind']} {r['shape']} {r['impl']} vs its full", run, r.get("vs_full"), TARGET_WINDOW, False)
            if r["kind"] == "fp8" and r["impl"].startswith("triton"):
                add(f"fp8 {r['impl']} {r['shape']} vs {r.get('vs_impl', 'flashinfer')}", run, r.get("ratio"),
                    TARGET_FP8, True)
    return out


def summary(ts: list[dict]) -> list[tuple[str, str]]:
    """(target, 'met' / 'NOT met' / 'no data') over all runs."""
    names = list(dict.fromkeys(t["target"] for t in ts))
    res = []
    for n in names:
        vals = [t for t in ts if t["target"] == n]
        if any(t["met"] is None for t in vals):
            res.append((n, "no data"))
        else:
            res.append((n, "met" if all(t["met"] for t in vals) else "NOT met"))
    return res


def print_table(rs: list[dict]) -> None:
    print(f"{'run':>3} {'kind':13} {'shape':46} {'impl':34} {'time_us':>9} {'GB/s|TF/s':>9} {'ratio':>6} "
          f"{'vs_full':>7} {'vs_bf16':>7} {'err':>8}")
    nan = float("nan")
    for r in rs:
        run = r.get("run", "")
        if "error" in r:
            print(f"{run!s:>3} {r['kind']:13} {r['shape']:46} {r['impl']:34} error: {r['error'][:70]}")
            continue
        rate = r.get("gbps", r.get("tflops", nan))
        print(f"{run!s:>3} {r['kind']:13} {r['shape']:46} {r['impl']:34} {r['time_us']:9.1f} {rate:9.1f} "
              f"{r.get('ratio', nan):6.3f} {r.get('vs_full', nan):7.3f} {r.get('vs_bf16', nan):7.3f} "
              f"{r.get('err_vs_fi', nan):8.1e}")


def print_targets(rs: list[dict]) -> list[tuple[str, str]]:
    ts = targets(rs)
    res = summary(ts)
    print("\ntargets (met only if met in every run):")
    for n, status in res:
        vals = " ".join("-" if t["value"] is None else f"{t['value']:.3f}" for t in ts if t["target"] == n)
        lim = next(t for t in ts if t["target"] == n)
        print(f"  {status:8} {n:80} runs: {vals}  (limit {'>=' if 'full' not in n else '<='} {lim['limit']})")
    return res


# ------------------------------------------------------------------------------------------------ warm-up
def warm(what: str, device: str = "cuda") -> None:
    """JIT-compile (or load) one FlashInfer module on a tiny problem (see FI_WARM)."""
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=device)
    if what.startswith("decode"):
        fp8 = "fp8" in what
        dt = FP8[what.rsplit("-", 1)[1]] if fp8 else torch.bfloat16
        pool = Pool(64 * PAGE, device, dtype=dt, scales=FP8_SCALES if fp8 else (1.0, 1.0))
        pg, _ = pool.pages(2, 4 * PAGE, seed=0)
        run, _ = fi_decode(pool, pg, torch.randn(2, H, D, dtype=torch.bfloat16, device=device), ws,
                           tensor_cores="-cc-" not in what, window_left=WINDOW - 1 if what == "decode-window" else -1)
    elif what.startswith("prefill"):
        run, _ = fi_extend(_extend_inputs(device, 2, 16, 32), ws, window_left=WINDOW - 1 if "window" in what else -1)
    elif what == "sink":
        s = SINK
        pool = Pool(64 * PAGE, device, hkv=s["hkv"], d=s["d"])
        pg, _ = pool.pages(2, 4 * PAGE, seed=0)
        run, _ = fi_sink_decode(pool, pg, torch.randn(2, s["h"], s["d"], dtype=torch.bfloat16, device=device),
                                torch.zeros(s["h"], device=device), ws, s["window"])
    else:
        raise SystemExit(f"unknown --warm {what!r}; one of {', '.join(FI_WARM)}")
    run()
    torch.cuda.synchronize()
    print("warm", what, "ok")


def _precompile_job(job: str) -> str:
    """Run one of our kernel variants on a tiny problem with the constexprs and specialisations of the real rows
    (same batch sizes, hence split caps; same features), so the timed process loads them from Triton's cache."""
    kind, arg = job.split(":", 1)
    dev = DEVICE
    try:
        from pipeline.backends.triton.launch import ExtendConfig, DecodeConfig, default_decode_config
        if kind == "decode":
            b, fmt, window, sinks, hkv, d, h, cfg_s = arg.split("|")
            b, hkv, d, h = int(b), int(hkv), int(d), int(h)
            cfg = DecodeConfig(**json.loads(cfg_s)) if cfg_s else default_decode_config(d, torch.device(dev))
            dt = FP8.get(fmt, torch.bfloat16)
            pool = Pool(4 * 64 * b + PAGE, dev, hkv=hkv, d=d, dtype=dt, scales=FP8_SCALES if fmt in FP8 else (1., 1.))
            _, r2t = pool.pages(b, 64, seed=0)
            q = torch.randn(b, h, d, dtype=torch.bfloat16, device=dev)
            sk = torch.zeros(h, device=dev) if sinks == "1" else None
            run, _ = ours_decode(pool, r2t, q, cfg, window=int(window) or None, sinks=sk)
        else:
            new, prefix, window, cfg_s = arg.split("|")
            new, prefix = int(new), int(prefix)
            cfg = ExtendConfig(**json.loads(cfg_s))
            # block_m new tokens at most: the same GQA-packing decision (a constexpr) as the real row
            x = _extend_inputs(dev, 2, min(new, cfg.block_m), 16 if prefix else 0)
            run, _ = ours_extend(x, cfg, int(window) or None)
        run()
        if torch.device(dev).type == "cuda":
            torch.cuda.synchronize()
        return f"ok {job}"
    except Exception as e:  # noqa: BLE001 - the timed run reports it as a row
        return f"error {job}: {repr(e)[:200]}"


def precompile_jobs(sweep: bool) -> list[str]:
    """One job string per kernel variant the table (and sweep) launches (see :func:`_precompile_job`)."""
    from pipeline.backends.triton.launch import default_extend_config

    jobs = []
    dcfgs = [("", None)] + ([(n, c) for n, c in _decode_configs(True)[1:]] if sweep else [])
    for _, c in dcfgs:
        cs = json.dumps(dataclasses.asdict(c)) if c is not None else ""
        for b in DECODE_B:
            jobs.append(f"decode:{b}|bf16|0|0|{HKV}|{D}|{H}|{cs}")
            if c is None:
                jobs.append(f"decode:{b}|bf16|{WINDOW}|0|{HKV}|{D}|{H}|")
    for fmt in FP8:
        jobs.append(f"decode:{FP8_SHAPE[0]}|{fmt}|0|0|{HKV}|{D}|{H}|")
    if sweep:
        for _, c in _fp8_sweep_configs():
            jobs.append(f"decode:{FP8_SHAPE[0]}|e4m3|0|0|{HKV}|{D}|{H}|{json.dumps(dataclasses.asdict(c))}")
    jobs.append(f"decode:{SINK['b']}|bf16|{SINK['window']}|1|{SINK['hkv']}|{SINK['d']}|{SINK['h']}|")
    ecfgs = [default_extend_config(D, torch.device(DEVICE))] + ([c for _, c in _extend_configs(True)[1:]] if sweep
                                                                 else [])
    for c in ecfgs:
        cs = json.dumps(dataclasses.asdict(c))
        for b, new, prefix in EXTEND_SHAPES:
            jobs.append(f"extend:{new}|{prefix}|0|{cs}")
    jobs.append(f"extend:{EXT_WINDOW[1]}|1|{WINDOW}|{json.dumps(dataclasses.asdict(ecfgs[0]))}")
    return list(dict.fromkeys(jobs))


def precompile(workers: int, sweep: bool) -> None:
    """Compile the kernel variants of the table (and sweep) in ``workers`` processes sharing Triton's cache."""
    import concurrent.futures
    import multiprocessing

    jobs = precompile_jobs(sweep)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        for msg in ex.map(_precompile_job, jobs):
            if not msg.startswith("ok"):
                print("precompile", msg)
    print(f"precompiled {len(jobs)} kernel variants")


def main() -> None:
    global _FI_OK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--warm", help="one FlashInfer module to compile (or 'list')")
    ap.add_argument("--fi-ok", help="directory of NAME.ok files left by successful --warm NAME runs")
    ap.add_argument("--precompile", type=int, default=0, metavar="N")
    ap.add_argument("--precompile-only", action="store_true", help="with --precompile: compile, then exit")
    ap.add_argument("--json")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.warm == "list":
        print(" ".join(FI_WARM))
        return
    if a.warm:
        warm(a.warm)
        if a.fi_ok:
            Path(a.fi_ok).mkdir(parents=True, exist_ok=True)
            (Path(a.fi_ok) / f"{a.warm}.ok").write_text("ok\n")
        return
    if a.fi_ok:
        d = Path(a.fi_ok)
        _FI_OK = {p.stem for p in d.glob("*.ok")} if d.is_dir() else set()
        print("flashinfer modules warmed:", " ".join(sorted(_FI_OK)) or "none")
    if a.precompile:
        precompile(a.precompile, a.sweep)
        if a.precompile_only:
            return
    try:
        fi_version = __import__("flashinfer").__version__
    except Exception:  # noqa: BLE001 - reported, not needed
        fi_version = "not importable"
    print(f"device {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}; flashinfer {fi_version}", flush=True)
    path = a.json or (os.path.join(a.out, "triton_kernels.json") if a.out else None)

    def progress(new: list[dict], every: list[dict]) -> None:   # a timeout still leaves the finished runs
        print_table(new)
        if path:
            with open(path, "w") as f:
                json.dump(dict(rows=every, targets=targets(every), summary=summary(targets(every))), f, indent=1)
        sys.stdout.flush()

    rs = rows("cuda", sweep=a.sweep, runs=a.runs, progress=progress)
    print_targets(rs)
    if path:
        print("wrote", path)


if __name__ == "__main__":
    main()
