"""Decode CUDA-graph memory: the estimate (pipeline.memory.graphs) against what capture really took, on a GPU.

For each model (Llama-3.1-8B, Qwen3-8B, DeepSeek-V2-Lite MLA; the bundled configs) and each batch-size list
(1,2,4,8 / sglang's default series up to 32 / up to 256), the runner is built as ``attn-setup run --device cuda
--model CONFIG --max-reqs N`` builds it (the CLI's own parser, request and RunnerConfig, in this one process) and
initialised: pools, the attention pipeline, decode-graph capture. Its ``cuda_graph_memory`` event has the estimate by
part (graph pool, replay state, warm-up stream) and what was measured: the graphs' private pool
(``torch.cuda.memory_snapshot()``) and the whole capture step's free-device-memory drop (before the graph runner's
first buffer, after its last capture). The table prints both, with the error of each estimate: the pool estimate
against the pool; the kept estimate (``kept est``: the total less the warm-up's temporaries, which
``torch.cuda.graph``'s ``empty_cache()`` gives back before each capture) against the step's drop. The total is the
step's peak, what pool sizing sets aside (an upper bound of the drop; the sweep below checks it is enough).
``primed``: the process's one-time capture costs (PyTorch's stream pool, lazily loaded graph machinery) that
init-memory-pool paid before reading the budget — the first configuration only, outside the step and its estimate.
Between configurations the runner is closed, PyTorch's cuBLAS workspaces are dropped
(``torch._C._cuda_clearCublasWorkspaces``; the capture stream is the process's one, so without this only the first
configuration would make one) and the cache is emptied.

Then a ``--mem-fraction`` sweep (0.90 … 0.98) of the default model with graphs up to bs 160: each start must end
either ready (the KV pool sized from the fraction minus the graph estimate, graphs captured) or refused before
allocating (exit 3, with its remedy) — never out of memory in capture. The first refusal's remedy (the largest
fraction whose pools and graphs fit 90 % of free memory) is then followed once: the tightest start that is allowed.
Each outcome is printed; the script exits 1 if any ran out of memory.

GPU only. Usage: python3 benchmarks/graph_memory.py [--quick] [--backend NAME] [--json PATH]
(about 1-3 minutes with a warm FlashInfer cache; ``--quick``: Llama only, two lists, two fractions).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
MODELS = [("llama-3.1-8b", "llama-3.1-8b.json"), ("qwen3-8b", "qwen3-8b.json"),
          ("deepseek-v2-lite", "deepseek-v2-lite.json")]
LISTS = [("1,2,4,8", ["--cuda-graph-bs", "1", "2", "4", "8"], 8), ("sglang to 32", [], 32),
         ("sglang to 256", [], 256)]
FRACTIONS = [0.90, 0.92, 0.94, 0.96, 0.98]


def _fresh(torch: Any) -> None:
    """Back to a fresh process's state for graph memory: no cuBLAS workspace, no cached blocks."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def start(argv: list[str], log_file: str, device: str = "cuda") -> tuple[Any, Any]:
    """``attn-setup run --device DEVICE``'s runner for ``argv`` (run's flags), preflighted and initialised as the
    command does; returns (runner, None), or (None, the ConfigError) for a start refused before allocating."""
    from pipeline.cli.flags import build_parser
    from pipeline.cli.flags import request_from
    from pipeline.cli.run import runner_config
    from pipeline.core.errors import ConfigError
    from pipeline.runtime.runner import Runner

    ns = build_parser().parse_args(["run", "--device", device, *argv])
    request = request_from(ns, on_gpu=True)
    runner = Runner(runner_config(ns, request), log_file=log_file)
    pre = runner.preflight()  # as `attn-setup run`: every refusal before anything is allocated
    if pre.refused is not None:
        runner.close()
        return None, pre.refused[1]
    try:
        runner.initialize()
    except ConfigError as e:
        runner.close()
        return None, e
    return runner, None


def measure(name: str, cfg: str, label: str, flags: list[str], max_reqs: int, backend: str) -> dict[str, Any]:
    import torch

    from pipeline.core import events as ev

    _fresh(torch)
    argv = ["--model", str(CONFIGS / cfg), "--max-reqs", str(max_reqs), *flags]
    if backend != "auto":
        argv += ["--attention-backend", backend]
    t0 = time.perf_counter()
    runner, err = start(argv, f"attn-setup-logs/graph_memory.{name}.{max_reqs}.jsonl")
    if runner is None:
        return {"model": name, "list": label, "error": f"{err.info.code}: {err.info.message}"}
    try:
        caps = [r for r in runner.log.records if isinstance(r, ev.CudaGraphCaptured)]
        pool = next(r for r in runner.log.records if isinstance(r, ev.MemoryPoolSized))
        mem = next((r for r in runner.log.records if isinstance(r, ev.CudaGraphMemory)), None)
        if mem is None:
            return {"model": name, "list": label, "error": "no decode graphs captured"}
        pct = lambda e, g: 100.0 * (e - g) / g if g else None  # noqa: E731
        return {"model": name, "list": label, "backend": mem.backend, "sizes": mem.batch_sizes,
                "pool_estimate": mem.pool_estimate, "graph_pool": mem.pool_bytes,
                "pool_error_pct": pct(mem.pool_estimate, mem.pool_bytes),
                "state_estimate": mem.state_estimate, "warmup_estimate": mem.warmup_estimate,
                "total_estimate": mem.total_estimate, "step_device": mem.step_device_bytes,
                "total_error_pct": pct(mem.total_estimate, mem.step_device_bytes),
                "kept_estimate": mem.kept_estimate, "kept_error_pct": pct(mem.kept_estimate, mem.step_device_bytes),
                "prime_device": mem.prime_device_bytes,
                "budget_estimate": pool.graph_bytes_estimate,
                "per_bs": [{"bs": c.bs, "estimate": c.graph_bytes_estimate, "graph_bytes": c.graph_bytes,
                            "device_bytes": c.device_bytes} for c in caps],
                "seconds": time.perf_counter() - t0}
    finally:
        runner.close()


def sweep(fraction: float, backend: str) -> dict[str, Any]:
    """One ``--mem-fraction`` start of the default model with graphs up to bs 160: ready, refused, or OOM."""
    import torch

    from pipeline.core import events as ev

    _fresh(torch)
    argv = ["--mem-fraction", str(fraction), "--max-reqs", "160"]
    if backend != "auto":
        argv += ["--attention-backend", backend]
    try:
        runner, err = start(argv, f"attn-setup-logs/graph_memory.sweep.{fraction}.jsonl")
    except torch.OutOfMemoryError as e:  # the outcome this sweep exists to rule out
        return {"fraction": fraction, "outcome": "OUT OF MEMORY", "detail": str(e).splitlines()[0]}
    if runner is None:
        return {"fraction": fraction, "outcome": f"refused ({err.info.code})", "detail": err.info.remedy}
    try:
        pool = next(r for r in runner.log.records if isinstance(r, ev.MemoryPoolSized))
        caps = [r for r in runner.log.records if isinstance(r, ev.CudaGraphCaptured)]
        free = torch.cuda.mem_get_info()[0]
        mem = next((r for r in runner.log.records if isinstance(r, ev.CudaGraphMemory)), None)
        step = mem.step_device_bytes if mem is not None else 0
        return {"fraction": fraction, "outcome": f"ready ({len(caps)} graphs)",
                "detail": f"KV {pool.kv_bytes / 2**30:.2f} GiB, graph estimate {pool.graph_bytes_estimate / 2**20:.1f} "
                          f"MiB, capture step took {step / 2**20:.1f} MiB, free after {free / 2**30:.2f} GiB"}
    finally:
        runner.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="Llama only, the first two lists, fractions 0.90 and 0.98")
    p.add_argument("--backend", default="auto", help="the attention backend (default: auto, as run picks)")
    p.add_argument("--json", default=None, help="write every row here")
    ns = p.parse_args()
    import logging

    import structlog
    import torch
    from rich.console import Console
    from rich.table import Table

    if not torch.cuda.is_available():
        print("GPU only: torch sees no CUDA device", file=sys.stderr)
        return 1
    # this script is an application: the runner's info events stay in the trace files, warnings reach stderr
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    models, lists, fractions = (MODELS[:1], LISTS[:2], [0.90, 0.98]) if ns.quick else (MODELS, LISTS, FRACTIONS)
    rows = [measure(n, c, label, flags, mr, ns.backend) for n, c in models for label, flags, mr in lists]
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    t = Table(title=f"decode CUDA-graph memory on {torch.cuda.get_device_name()} (MiB)", title_justify="left")
    cols = ("model", "batch sizes", "backend", "n", "pool est", "pool", "pool err %", "state est", "warm-up est",
            "total est", "kept est", "step drop", "kept err %", "primed")
    for col in cols:
        t.add_column(col, justify="left" if col in ("model", "batch sizes", "backend") else "right")
    pct = lambda x: "-" if x is None else f"{x:+.1f}"  # noqa: E731
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], r["list"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:40], "-")
            continue
        t.add_row(r["model"], r["list"], str(r["backend"]), str(len(r["sizes"])), mib(r["pool_estimate"]),
                  mib(r["graph_pool"]), pct(r["pool_error_pct"]), mib(r["state_estimate"]), mib(r["warmup_estimate"]),
                  mib(r["total_estimate"]), mib(r["kept_estimate"]), mib(r["step_device"]), pct(r["kept_error_pct"]),
                  mib(r["prime_device"]))
    c = Console(width=160)
    c.print(t)
    for key, what in (("pool_error_pct", "worst |error| of the graph pool estimate"),
                      ("kept_error_pct", "worst |error| of the kept estimate against the step's drop"),
                      ("total_error_pct", "largest margin of the total (the peak, set aside) over the step's drop")):
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        c.print(f"{what}: {max(errs):.1f} %" if errs else f"{what}: no figure")
    outcomes = [sweep(f, ns.backend) for f in fractions]
    import re

    fix = next((re.search(r"--mem-fraction ([0-9.]+) or less", o["detail"] or "") for o in outcomes
                if o["outcome"].startswith("refused")), None)
    if fix is not None:  # the largest share its remedy names: pools and graphs then fill 90 % of free memory
        follow = sweep(float(fix.group(1)), ns.backend)
        follow["fraction_note"] = "the remedy's"
        outcomes.append(follow)
    s = Table(title="--mem-fraction sweep, llama-3.1-8b, graphs up to bs 160", title_justify="left")
    for col in ("fraction", "outcome", "detail"):
        s.add_column(col)
    for o in outcomes:
        s.add_row(f"{o['fraction']:.2f}" + (" (remedy)" if o.get("fraction_note") else ""), o["outcome"], o["detail"])
    c.print(s)
    oom = [o for o in outcomes if o["outcome"] == "OUT OF MEMORY"]
    c.print(f"out of memory in capture: {len(oom)} of {len(outcomes)}")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rows": rows, "sweep": outcomes}, indent=1))
    return 1 if oom else 0


if __name__ == "__main__":
    sys.exit(main())
