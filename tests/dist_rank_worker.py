"""One rank of tests/test_rank_agreement.py under torchrun: every digest flip, memory balance, a stall.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_rank_worker.py S1,S2,... OUTDIR``

Scenarios run in order over one process group (one torch start for all); the "odd" rank is the last
one (``WORLD_SIZE - 1``) unless a scenario says otherwise:

- ``agree``: same request everywhere.
- ``flip:<field>``: the odd rank changes exactly what makes digest field / arg ``<field>`` differ
  (:data:`FLIPS`; ``versions.*`` and ``capabilities`` by patching what it reports).
- ``mem_low:<r>``: fake CUDA facts, rank ``r`` reports half the free memory of the others.
- ``mem_even``: fake CUDA facts, equal free memory, then an injected fault at resolve (stop early).
- ``stall``: the odd rank sleeps ``STALL_SLEEP_S`` in resolve (injected); must be last.

Each rank writes OUTDIR/result.<scenario>.rank<R>.json and its trace under OUTDIR/<scenario>/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.core import eventlog
from pipeline.setup import distributed
from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.errors import AttnSetupError  # noqa: E402
from pipeline.core.faults import Faults  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402
from pipeline.core.shard import PARTITION_ENV  # noqa: E402
from pipeline.core.spec import truncate_spec  # noqa: E402
from pipeline.platforms.fake import FakePlatform  # noqa: E402

INSTALLED = {"torch": True, "triton": True, "flashinfer-python": False}
CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
MODEL = load_model_spec(CONFIGS / "llama-3.1-8b.json")
OTHER = load_model_spec(CONFIGS / "qwen3-8b.json")
POOL = dict(max_reqs=4, max_context_len=64, num_token_slots=256)
GIB = 1 << 30

# field -> (AttentionArgs changes, SetupRequest/PoolFacts changes) on the odd rank
FLIPS: dict[str, tuple[dict, dict]] = {
    "args.attention_backend": ({"attention_backend": "triton"}, {}),
    "args.prefill_attention_backend": ({"prefill_attention_backend": "torch_native"}, {}),
    "args.decode_attention_backend": ({"decode_attention_backend": "torch_native"}, {}),
    "args.speculative_draft_attention_backend": ({"speculative_draft_attention_backend": "torch_native"},
                                                 {"is_draft_worker": True}),  # refused on a target worker
    "args.speculative_algorithm": ({"speculative_algorithm": "EAGLE"}, {}),
    "args.speculative_num_steps": ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                                    "speculative_eagle_topk": 1}, {}),
    "args.speculative_eagle_topk": ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                                     "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}, {}),
    "args.speculative_num_draft_tokens": ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                                           "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}, {}),
    "args.enable_pdmux": ({"enable_pdmux": True}, {}),
    "args.sm_group_num": ({"sm_group_num": 4}, {}),
    "args.enable_two_batch_overlap": ({"enable_two_batch_overlap": True, "moe_a2a_backend": "deepep"}, {}),
    "args.attn_dp_size": ({"attn_dp_size": 2}, {}),  # the scenarios run on 2 ranks: a divisor of world_size
    "args.tp_size": ({"tp_size": 2}, {}),  # the others leave it unset (world_size / pp_size): the same 2 ranks
    "args.pp_size": ({"pp_size": 2}, {}),  # 1 tp x 2 stages: a valid launch, another layout
    "shard": ({}, {}),  # every rank pp 2; the odd rank's SGLANG_PP_LAYER_PARTITION moves the stage boundary
    "args.moe_a2a_backend": ({"moe_a2a_backend": "deepep"}, {}),
    "args.kv_cache_dtype": ({"kv_cache_dtype": "float32"}, {}),
    "args.page_size": ({"page_size": 16}, {}),
    "args.disable_cuda_graph": ({"disable_cuda_graph": True}, {}),
    "args.cuda_graph_bs": ({"cuda_graph_bs": [1, 2]}, {}),
    "args.cuda_graph_max_bs": ({"cuda_graph_max_bs": 2}, {}),
    "args.zbal_local_mem_size": ({"zbal_local_mem_size": 0}, {}),
    "args.flashinfer_workspace_size": ({"flashinfer_workspace_size": 1 << 20}, {}),
    "args.dtype": ({"dtype": "float32"}, {}),
    "args.strict": ({"strict": True}, {}),
    "model": ({}, {"model": OTHER}),
    "num_layers": ({}, {"model": truncate_spec(MODEL, 1)}),   # run --num-layers 1 on one rank: not another model
    "draft_model": ({}, {"draft_model": OTHER, "is_draft_worker": True}),
    "is_draft_worker": ({}, {"is_draft_worker": True}),
    "pool.max_reqs": ({}, {"max_reqs": 8}),
    "pool.max_context_len": ({}, {"max_context_len": 128}),
    "pool.num_token_slots": ({}, {"num_token_slots": 512}),
    "dtype.model": ({"dtype": "float16"}, {}),
    "dtype.kv_cache": ({"kv_cache_dtype": "float16"}, {}),
    "cuda_graph_bs": ({"cuda_graph_max_bs": 1}, {}),
}


def request(g: distributed.RankGroup, sc: str, device: str) -> SetupRequest:
    args_kw, req_kw = FLIPS.get(sc.partition(":")[2], ({}, {})) if g.rank == g.world_size - 1 else ({}, {})
    args = AttentionArgs(**args_kw, **({"pp_size": 2} if sc == "flip:shard" else {}))
    pool = PoolFacts(**{**POOL, **{k: v for k, v in req_kw.items() if k in POOL}}, page_size=args.page_size)
    rest = {k: v for k, v in req_kw.items() if k not in POOL}
    return SetupRequest(**{"model": MODEL, **rest}, args=args, device=device, rank=g.rank, world_size=g.world_size,
                        pool=pool)


def patched(g: distributed.RankGroup, sc: str):
    """What the odd rank reports differently for versions.* / capabilities."""
    field = sc.partition(":")[2]
    if g.rank != g.world_size - 1:
        return mock.patch.dict({})
    if field.startswith("versions."):
        real = eventlog.versions
        return mock.patch.object(eventlog, "versions", lambda inst: {**real(inst), field[9:]: "0.0.0-other"})
    if field == "shard":
        return mock.patch.dict(os.environ, {PARTITION_ENV: "20,12"})
    if field == "capabilities":
        return mock.patch.object(distributed, "_capabilities_text", lambda: "sha256:0000000000000000")
    return mock.patch.dict({})


def run_one(g: distributed.RankGroup, sc: str, outdir: Path, stall_s: float) -> dict:
    kw: dict = {}
    if sc.startswith("mem_"):
        low = int(sc.partition(":")[2]) if sc.startswith("mem_low") else -1
        facts = DeviceFacts(type="cuda", index=g.rank, compute_capability=(9, 0), source="test")
        kw["platform"] = FakePlatform(facts, "cpu", free_bytes=(40 if g.rank == low else 80) * GIB)
        g = dataclasses.replace(g, device=f"cuda:{g.rank}")
        if sc == "mem_even":
            kw["faults"] = Faults(at=["state:resolve"])
    if sc == "stall" and g.rank == g.world_size - 1:
        kw["faults"] = Faults(at=["state:resolve"], sleep_s=stall_s)
    t0 = time.monotonic()
    try:
        with patched(g, sc):
            req = request(g, sc, g.device)
            with build_attention_backends(req, rank_group=g, installed=INSTALLED,
                                          log_file=str(outdir / sc / f"{g.run_id}.rank{g.rank}.jsonl"), **kw) as out:
                result = dict(ok=True, run_id=out.run_id)
    except AttnSetupError as e:
        result = dict(ok=False, error=msgspec.to_builtins(e.info), exit_code=e.exit_code, type=type(e).__name__)
    except Exception as e:  # noqa: BLE001 - recorded, so the test shows it instead of a hang
        result = dict(ok=False, type=type(e).__name__, message=str(e)[:500])
    result["seconds"] = time.monotonic() - t0
    return result


def main(scenarios: list[str], outdir: Path) -> None:
    timeout = float(os.environ.get("EXCHANGE_TIMEOUT_S", "20"))
    g = distributed.init_from_env("cpu", timeout_s=timeout)
    for sc in scenarios:
        res = {"rank": g.rank, "world_size": g.world_size, "group_run_id": g.run_id, "timeout_s": timeout,
               **run_one(g, sc, outdir, timeout + 1.5)}
        (outdir / f"result.{sc}.rank{g.rank}.json").write_text(json.dumps(res))
    os._exit(0)  # skip process-group teardown: a peer may already be gone after a failed exchange


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
