"""Benchmark: our Triton decode/extend kernels against FlashInfer, in one process, on one GPU.

Rows (``rows()`` returns them as dicts; ``python benchmarks/triton_kernels.py`` prints the table):

- device copy bandwidth (read + write bytes over time): the memory ceiling;
- decode, B in {1, 8, 64, 256} x ctx in {512, 4096, 32768}, 32 q / 8 kv heads, D 128, bf16,
  page 16 over scrambled pages: FlashInfer ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``
  and ours, both captured in a CUDA graph and timed as replays (median of ``do_bench``); GB/s counts
  the K/V bytes each must read; ratio = FlashInfer time / our time (> 1: ours faster);
- extend: 64 requests x 512 new tokens on a 3584-token prefix, causal, same heads: FlashInfer
  ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` vs ours; TFLOP/s counts
  ``4 * D * (new * prefix + new * (new + 1) / 2)`` per (request, q head) for both.

Flags: ``--sweep`` also times several kernel configs on a few shapes; ``--warm decode|prefill``
only JIT-compiles the FlashInfer modules (run in parallel with other work); ``--json PATH`` saves rows.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

H, HKV, D, PAGE = 32, 8, 128, 16
DECODE_B = (1, 8, 64, 256)
DECODE_CTX = (512, 4096, 32768)
EXT_B, EXT_NEW, EXT_PREFIX = 64, 512, 3584
WS_BYTES = 512 << 20


def _us(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def _graph(fn: Callable[[], None]) -> Callable[[], None]:
    """Capture ``fn`` (after a warm-up on a side stream) and return the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth(device: str) -> dict:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    x = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = _us(lambda: y.copy_(x))
    return dict(kind="copy", shape="2 GiB", impl="torch copy_", time_us=t, gbps=2 * x.numel() / t / 1e3)


class Pool:
    """One K/V pool (bf16, [slots, HKV, D]) big enough for the largest decode shape, random data."""

    def __init__(self, slots: int, device: str) -> None:
        self.k = torch.empty(slots, HKV, D, dtype=torch.bfloat16, device=device).normal_()
        self.v = torch.empty(slots, HKV, D, dtype=torch.bfloat16, device=device).normal_()
        self.num_pages = slots // PAGE
        self.device = device

    def pages(self, b: int, ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scrambled pages for b requests of ctx tokens: (page ids [b, ctx/PAGE], req_to_token [b, ctx])."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        n = b * ctx // PAGE
        pg = (torch.randperm(self.num_pages - 1, generator=g, device=self.device)[:n] + 1).to(torch.int32)
        pg = pg.view(b, ctx // PAGE)
        r2t = (pg[:, :, None] * PAGE + torch.arange(PAGE, device=self.device, dtype=torch.int32)).view(b, ctx)
        return pg, r2t.contiguous()


def _flashinfer_decode(pool: Pool, pg: torch.Tensor, q: torch.Tensor, ws: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    import flashinfer

    b, npg = pg.shape
    dev = q.device
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * npg
    last = torch.full((b,), PAGE, dtype=torch.int32, device=dev)
    idx = pg.reshape(-1).contiguous()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                      paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=idx,
                                                      paged_kv_last_page_len_buffer=last)
    w.plan(indptr, idx, last, H, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
           sm_scale=D ** -0.5)
    kv = (pool.k.view(-1, PAGE, HKV, D), pool.v.view(-1, PAGE, HKV, D))
    out = torch.empty_like(q)
    return (lambda: w.run(q, kv, out=out)), out


def _ours_decode(pool: Pool, r2t: torch.Tensor, q: torch.Tensor, cfg) -> tuple[Callable, torch.Tensor]:
    from pipeline.backends.triton import launch

    b, ctx = r2t.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = launch.decode_max_splits(b, HKV, sms, cfg)
    scratch = torch.empty(launch.decode_scratch_numel(b, H, D, splits), dtype=torch.float32, device=q.device)
    rows = torch.arange(b, dtype=torch.int64, device=q.device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)

    def run() -> None:
        launch.decode_attention(q, pool.k, pool.v, r2t, rows, lens, out, sm_scale=D ** -0.5, max_splits=splits,
                                scratch=scratch, config=cfg)
    return run, out


def decode_rows(pool: Pool, ws: torch.Tensor, shapes, configs) -> list[dict]:
    """FlashInfer and our decode (each config) per shape, all as CUDA-graph replays."""
    from pipeline.runtime.reference import rel_err

    rows = []
    for b, ctx in shapes:
        pg, r2t = pool.pages(b, ctx, seed=b * 7 + ctx)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device=pool.device)
        nbytes = 2 * b * ctx * HKV * D * 2
        fi_run, fi_out = _flashinfer_decode(pool, pg, q, ws)
        t_fi = _us(_graph(fi_run))
        shape = f"B={b} ctx={ctx}"
        rows.append(dict(kind="decode", shape=shape, impl="flashinfer-tc", time_us=t_fi, gbps=nbytes / t_fi / 1e3))
        for name, cfg in configs:
            try:
                run, out = _ours_decode(pool, r2t, q, cfg)
                t = _us(_graph(run))
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a row, not a crash
                rows.append(dict(kind="decode", shape=shape, impl=f"triton{name}", error=repr(e)[:200]))
                continue
            rows.append(dict(kind="decode", shape=shape, impl=f"triton{name}", time_us=t, gbps=nbytes / t / 1e3,
                             ratio=t_fi / t, err_vs_fi=rel_err(out, fi_out)))
        del pg, r2t, q, fi_out
    return rows


def _extend_inputs(device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    total = EXT_PREFIX + EXT_NEW
    slots = (EXT_B * total // PAGE + 1) * PAGE
    k = torch.empty(slots, HKV, D, dtype=torch.bfloat16, device=device).normal_(generator=g)
    v = torch.empty_like(k).normal_(generator=g)
    pg = (torch.randperm(slots // PAGE - 1, generator=g, device=device)[: EXT_B * total // PAGE] + 1).int()
    pg = pg.view(EXT_B, total // PAGE)
    r2t = (pg[:, :, None] * PAGE + torch.arange(PAGE, device=device, dtype=torch.int32)).view(EXT_B, total)
    new_slots = r2t[:, EXT_PREFIX:].reshape(-1).long()
    q = torch.randn(EXT_B * EXT_NEW, H, D, dtype=torch.bfloat16, device=device, generator=g)
    return dict(k=k, v=v, pg=pg, r2t=r2t.contiguous(), q=q, k_new=k[new_slots].contiguous(),
                v_new=v[new_slots].contiguous())


def _flashinfer_extend(x: dict, ws: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    import flashinfer

    dev = x["q"].device
    qo = torch.arange(EXT_B + 1, dtype=torch.int32, device=dev) * EXT_NEW
    npg = x["pg"].shape[1]
    kv_indptr = torch.arange(EXT_B + 1, dtype=torch.int32, device=dev) * npg
    last = torch.full((EXT_B,), PAGE, dtype=torch.int32, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo, kv_indptr, x["pg"].reshape(-1).contiguous(), last, H, HKV, D, PAGE, causal=True,
           sm_scale=D ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    kv = (x["k"].view(-1, PAGE, HKV, D), x["v"].view(-1, PAGE, HKV, D))
    out = torch.empty_like(x["q"])
    return (lambda: w.run(x["q"], kv, out=out)), out


def _ours_extend(x: dict, cfg) -> tuple[Callable, torch.Tensor]:
    from pipeline.backends.triton import launch

    dev = x["q"].device
    qo = torch.arange(EXT_B + 1, dtype=torch.int32, device=dev) * EXT_NEW
    prefix = torch.full((EXT_B,), EXT_PREFIX, dtype=torch.int32, device=dev)
    rows = torch.arange(EXT_B, dtype=torch.int64, device=dev)
    out = torch.empty_like(x["q"])

    def run() -> None:
        launch.extend_attention(x["q"], x["k_new"], x["v_new"], x["k"], x["v"], x["r2t"], rows, qo, prefix, out,
                                max_extend_len=EXT_NEW, sm_scale=D ** -0.5, config=cfg)
    return run, out


def extend_rows(ws: torch.Tensor, configs, device: str) -> list[dict]:
    """fa3 prefill and our extend (each config) on the 64 x 512 on 3584 shape."""
    from pipeline.runtime.reference import rel_err

    x = _extend_inputs(device)
    flops = EXT_B * H * 4 * D * (EXT_NEW * EXT_PREFIX + EXT_NEW * (EXT_NEW + 1) / 2)
    shape = f"B={EXT_B} new={EXT_NEW} prefix={EXT_PREFIX}"
    fi_run, fi_out = _flashinfer_extend(x, ws)
    t_fi = _us(fi_run)
    rows = [dict(kind="extend", shape=shape, impl="flashinfer-fa3", time_us=t_fi, tflops=flops / t_fi / 1e6)]
    for name, cfg in configs:
        try:
            run, out = _ours_extend(x, cfg)
            t = _us(run)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a row, not a crash
            rows.append(dict(kind="extend", shape=shape, impl=f"triton{name}", error=repr(e)[:200]))
            continue
        rows.append(dict(kind="extend", shape=shape, impl=f"triton{name}", time_us=t, tflops=flops / t / 1e6,
                         ratio=t_fi / t, err_vs_fi=rel_err(out, fi_out)))
    return rows


def _decode_configs(sweep: bool) -> list:
    from pipeline.backends.triton.launch import DecodeConfig, default_decode_config

    base = [("", default_decode_config(D, torch.device("cuda")))]
    if not sweep:
        return base
    # run 1 and run 2 sweeps are recorded in benchmarks/NOTES.md; this one checks the split rule.
    var = [dict(programs_per_sm=4), dict(programs_per_sm=16), dict(num_stages=2)]
    d0 = default_decode_config(D, torch.device("cuda"))
    out = base
    for v in var:
        fields = {**d0.__dict__, **v}
        out.append(("[" + " ".join(f"{k}={x}" for k, x in v.items()) + "]", DecodeConfig(**fields)))
    return out


def _extend_configs(sweep: bool) -> list:
    from pipeline.backends.triton.launch import ExtendConfig, default_extend_config

    base = [("", default_extend_config(D, torch.device("cuda")))]
    if not sweep:
        return base
    var = [(128, 64, 8, 4)]  # runs 1-2 swept 13 configs (NOTES.md); 128x128x8 warps x3 stages won
    return base + [(f"[m{m} n{n} w{w} s{s}]", ExtendConfig(block_m=m, block_n=n, num_warps=w, num_stages=s))
                   for m, n, w, s in var]


def rows(device: str = "cuda", sweep: bool = False) -> list[dict]:
    """All benchmark rows (copy, decode grid, extend) as dicts: kind, shape, impl, time_us, gbps/tflops, ratio."""
    torch.manual_seed(0)
    out = [copy_bandwidth(device)]
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=device)
    pool = Pool((max(DECODE_B) * max(DECODE_CTX) // PAGE + 1) * PAGE, device)
    shapes = [(b, c) for c in DECODE_CTX for b in DECODE_B]
    out += decode_rows(pool, ws, shapes, _decode_configs(False))
    if sweep:
        sw = [(8, 32768), (64, 4096), (8, 4096), (1, 512)]
        out += [dict(r, kind="decode-sweep") for r in decode_rows(pool, ws, sw, _decode_configs(True)[1:])]
    del pool
    torch.cuda.empty_cache()
    out += extend_rows(ws, _extend_configs(sweep), device)
    return out


def warm(what: str, device: str = "cuda") -> None:
    """JIT-compile FlashInfer's decode (tensor cores) or fa3 prefill module on a tiny problem."""
    ws = torch.empty(WS_BYTES, dtype=torch.uint8, device=device)
    pool = Pool(64 * PAGE, device)
    if what == "decode":
        pg, _ = pool.pages(2, 4 * PAGE, seed=0)
        run, _ = _flashinfer_decode(pool, pg, torch.randn(2, H, D, dtype=torch.bfloat16, device=device), ws)
    else:
        global EXT_B, EXT_NEW, EXT_PREFIX
        EXT_B, EXT_NEW, EXT_PREFIX = 2, 16, 32
        run, _ = _flashinfer_extend(_extend_inputs(device), ws)
    run()
    torch.cuda.synchronize()
    print("warm", what, "ok")


def print_table(rs: list[dict]) -> None:
    print(f"{'kind':13} {'shape':34} {'impl':40} {'time_us':>10} {'GB/s|TFLOP/s':>13} {'ratio':>7} {'err':>9}")
    for r in rs:
        if "error" in r:
            print(f"{r['kind']:13} {r['shape']:34} {r['impl']:40} error: {r['error'][:60]}")
            continue
        rate = r.get("gbps", r.get("tflops", float("nan")))
        print(f"{r['kind']:13} {r['shape']:34} {r['impl']:40} {r['time_us']:10.1f} {rate:13.1f} "
              f"{r.get('ratio', float('nan')):7.3f} {r.get('err_vs_fi', float('nan')):9.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--warm", choices=["decode", "prefill"])
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.warm:
        warm(a.warm)
        return
    rs = rows("cuda", sweep=a.sweep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rs, f, indent=1)
    print_table(rs)


if __name__ == "__main__":
    main()
