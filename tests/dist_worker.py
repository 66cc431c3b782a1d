"""One rank of tests/test_distributed.py, launched by torchrun: init once, run several scenarios.

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py S1,S2,... OUTDIR``

The launcher's run id is removed first, so the shared run id must come from rank 0's broadcast.
Scenarios, run in the order given over the same process group: ``agree`` (same flags everywhere),
``page_size`` (rank 1 asks for page_size 16), ``backend`` (rank 1 asks for triton, refused on CPU),
``absent`` (rank 1 never joins the exchange; must be last). Each rank writes
OUTDIR/result.SCENARIO.rank{RANK}.json and its trace under OUTDIR/SCENARIO/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.setup import distributed  # noqa: E402
from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.errors import AttnSetupError  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402

INSTALLED = {"torch": True, "triton": True, "flashinfer-python": False}
CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "llama-3.1-8b.json"


def main(scenarios: list[str], outdir: Path) -> None:
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    os.environ.pop("ATTN_SETUP_RUN_ID", None)
    timeout = float(os.environ.get("EXCHANGE_TIMEOUT_S", "20"))
    g = distributed.init_from_env("cpu", timeout_s=timeout)
    for sc in scenarios:
        result = {"rank": g.rank, "group_run_id": g.run_id, "device": g.device, "pid": os.getpid()}
        if g.rank == 1 and sc == "absent":
            time.sleep(timeout + 1)
            _write(outdir, sc, g.rank, dict(result, skipped=True))
            break
        _write(outdir, sc, g.rank, dict(result, **run_one(g, sc, outdir)))
    os._exit(0)  # skip process-group teardown: a peer may already be gone after a failed exchange


def run_one(g: distributed.RankGroup, sc: str, outdir: Path) -> dict:
    kw = {}
    if g.rank == 1 and sc == "page_size":
        kw["page_size"] = 16
    if g.rank == 1 and sc == "backend":
        kw["attention_backend"] = "triton"
    args = AttentionArgs(**kw)
    req = SetupRequest(args=args, model=load_model_spec(CONFIG), device=g.device, rank=g.rank, world_size=g.world_size,
                       pool=PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=256, page_size=args.page_size))
    t0 = time.monotonic()
    try:
        with build_attention_backends(req, rank_group=g, installed=INSTALLED,
                                      log_file=str(outdir / sc / f"{g.run_id}.rank{g.rank}.jsonl")) as out:
            result = dict(ok=True, run_id=out.run_id, prefill=out.prefill_attention_backend_str)
    except AttnSetupError as e:
        result = dict(ok=False, error=msgspec.to_builtins(e.info), exit_code=e.exit_code, type=type(e).__name__)
    result["seconds"] = time.monotonic() - t0
    return result


def _write(outdir: Path, sc: str, rank: int, result: dict) -> None:
    (outdir / f"result.{sc}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
