"""Machine + logging overhead per run: state functions called directly vs through the pipeline.

Both sides do the same work on CPU (device facts, resolve, plan, KV pools, backend construction,
npu-lazy-mem decision, annotate) for the bundled Llama-3.1-8B with small pools; the pipeline side
adds the pytransitions machine, guards, event records and JSON-lines logging to a file. Runs are
interleaved and the medians compared. The overhead is then shown as a share of a whole CPU
``attn-setup run`` (process start, torch import, construction and verification included).

    python benchmarks/pipeline_overhead.py [--runs 300]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.backends.registry import BackendContext, get  # noqa: E402
from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.eventlog import EventLog  # noqa: E402
from pipeline.backends.memory import KVPool, ReqToTokenPool, torch_dtype  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402
from pipeline.platforms.cpu import CpuPlatform  # noqa: E402
from pipeline.backends.workspace import WorkspacePool  # noqa: E402
from pipeline.setup.context import Built  # noqa: E402
from pipeline.setup.instances import build_instances  # noqa: E402
from states.annotate import set_names  # noqa: E402
from states import build_mode, device_init, npu_lazy_mem, resolve  # noqa: E402
from pipeline.core.dtypes import kv_dtype, model_dtype  # noqa: E402

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}


def direct(req: SetupRequest) -> None:
    """The same state functions, called in order with no machine and no logging."""
    plat = CpuPlatform()
    facts = plat.device_facts(0)
    if device_init.decide_blas(facts.type):
        plat.init_blas()
    res = resolve.decide(req.args, req.model, facts, is_draft_worker=False, installed=INSTALLED)
    plan = build_mode.decide(req.args, res.pair, is_draft_worker=False, workspace_bytes=lambda b: 0)
    p, m = req.pool, req.model
    r2t = ReqToTokenPool(p.max_reqs, p.max_context_len, "cpu")
    kv = KVPool.for_layer_kinds(m.layer_kinds(), m.num_hidden_layers, p.num_token_slots, p.page_size,
                                torch_dtype(kv_dtype(req.args, m)), "cpu")
    wsp = WorkspacePool("cpu")
    for w in plan.workspaces:
        wsp.allocate(w)

    def make(inst):
        ctx = BackendContext(name=inst.backend, role=inst.role, device=facts, torch_device="cpu", model=m,
                             layer_kinds=m.layer_kinds(), args=req.args, req_to_token_pool=r2t, kv_pool=kv,
                             workspace=wsp.get(inst.workspace), dtype=model_dtype(req.args, m))
        return get(inst.backend).load_factory()(ctx)

    built = build_instances(plan, make, Built())
    if npu_lazy_mem.decide("cpu", 0, "default", False).run:
        plat.init_lazy_device_memory(0, 0, 1, None)
    set_names(built.attn_backend, res.pair)


def piped(req: SetupRequest, path: str) -> None:
    log = EventLog("bench", 0, path)
    build_attention_backends(req, log=log, installed=INSTALLED).close()
    log.close()


def whole_run_ms(n: int = 3) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "--device", "cpu", "--json",
                        "--log-file", tempfile.mktemp(suffix=".jsonl")], check=True, capture_output=True, cwd=ROOT)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ns = ap.parse_args()
    from pipeline.cli import configure_logging

    configure_logging(verbose=False)  # as the CLI does: warnings and up to stderr
    model = load_model_spec(ROOT / "examples" / "configs" / "llama-3.1-8b.json")
    req = SetupRequest(args=AttentionArgs(), model=model, device="cpu",
                       pool=PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64))
    path = tempfile.mktemp(suffix=".jsonl")
    for _ in range(10):  # warm-up: imports, allocator
        direct(req), piped(req, path)
    d, p = [], []
    for _ in range(ns.runs):
        t = time.perf_counter(); direct(req); d.append((time.perf_counter() - t) * 1e3)  # noqa: E702
        t = time.perf_counter(); piped(req, path); p.append((time.perf_counter() - t) * 1e3)  # noqa: E702
    md, mp = statistics.median(d), statistics.median(p)
    over = statistics.median(b - a for a, b in zip(d, p))  # paired: each pipeline run minus its direct neighbour
    whole = whole_run_ms()
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"pipeline overhead, median of {ns.runs} interleaved runs (CPU, Llama-3.1-8B, tiny pools)")
    for col in ("what", "ms"):
        t.add_column(col)
    t.add_row("state functions called directly", f"{md:.3f}")
    t.add_row("through machine + JSON-lines log to a file", f"{mp:.3f}")
    t.add_row("overhead per run, median of paired differences (target <= 1 ms)", f"{over:.3f}")
    t.add_row("whole `attn-setup run --device cpu` (median of 3 processes)", f"{whole:.1f}")
    t.add_row("overhead as a share of the whole run", f"{over / whole * 100:.3f} %")
    Console().print(t)


if __name__ == "__main__":
    main()
