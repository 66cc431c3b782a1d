"""Startup time device-init → done per mode, with a warm FlashInfer JIT cache, and workspace bytes per mode.

Modes: normal, TBO, PD-mux with N = 1, 4, 8 decode groups; backend ``flashinfer`` on CUDA (or
``--backend``); model: the bundled Llama-3.1-8B (``--model``). Each mode is started ``--runs``
times after one warm-up start (which also warms the JIT cache); the table shows the median
device-init → done time (the ``run_finished`` record's ``duration_ms``), instances built, and the
workspace bytes the pool allocated (PD-mux: one private + one shared, so constant in N).

    python benchmarks/startup.py [--backend flashinfer] [--runs 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from pipeline.core import events as ev
    from pipeline.setup.build import build_attention_backends
    from pipeline.cli import configure_logging
    from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=str(ROOT / "examples" / "configs" / "llama-3.1-8b.json"))
    ap.add_argument("--runs", type=int, default=5)
    ns = ap.parse_args()
    configure_logging(verbose=False)
    model = load_model_spec(ns.model)
    modes = [("normal", {}), ("tbo", dict(enable_two_batch_overlap=True, moe_a2a_backend="deepep"))] + [
        (f"pdmux N={n}", dict(enable_pdmux=True, sm_group_num=n)) for n in (1, 4, 8)]
    rows = []
    for label, flags in modes:
        req = SetupRequest(args=AttentionArgs(attention_backend=ns.backend, page_size=16, **flags), model=model,
                           device=ns.device, pool=PoolFacts(max_reqs=64, max_context_len=4096,
                                                            num_token_slots=16 * 4096, page_size=16))
        times = []
        for i in range(ns.runs + 1):
            with build_attention_backends(req) as out:
                done = [r for r in out.events if isinstance(r, ev.RunFinished)][0]
                ws = out.workspace_pool.total_bytes()
                n_inst = len(out.instances)
            if i:  # the first start warms caches
                times.append(done.duration_ms)
        rows.append((label, statistics.median(times), n_inst, ws))
    print(f"startup device-init → done, backend {ns.backend}, median of {ns.runs} (warm JIT cache)")
    print(f"{'mode':<12} {'ms':>9} {'instances':>10} {'workspace bytes':>16}")
    for label, ms, n, ws in rows:
        print(f"{label:<12} {ms:9.1f} {n:>10} {ws:>16}")


if __name__ == "__main__":
    main()
