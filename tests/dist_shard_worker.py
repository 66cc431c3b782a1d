"""One rank of tests/test_shard_launch.py under torchrun (gloo): build this rank's shard, verify it, world-check.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/dist_shard_worker.py S1,S2,... OUTDIR``

Scenarios ``tp<T>pp<P>`` (T x P must be N) run in order over one process group: each rank builds its shard of a
tiny Llama-shaped model (8 query heads, 2 kv heads, 4 layers) with torch_native through ``build_attention_backends``
(rank agreement included), verifies it against float64 of its own heads and layers (``verify_built``), then joins
the world check (``world_check``). ``<scenario>:swap`` makes the last rank read the other kv head (a wrong shard the
world check must catch). Each rank writes OUTDIR/result.<scenario>.rank<R>.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.core import shard  # noqa: E402
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402
from pipeline.runtime.verify import verify_built  # noqa: E402
from pipeline.runtime.world_check import world_check  # noqa: E402
from pipeline.setup import distributed  # noqa: E402
from pipeline.setup.build import build_attention_backends  # noqa: E402

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}
MODEL = load_model_spec({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
                         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4,
                         "torch_dtype": "bfloat16"}, source="tiny-llama")
MLA = load_model_spec({"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 256,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
                       "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
                       "q_lora_rank": None, "torch_dtype": "bfloat16"}, source="tiny-mla")
POOL = PoolFacts(max_reqs=6, max_context_len=64, num_token_slots=256)


def swapped(layout_fn, rank: int):
    """plan_layout with ``rank``'s kv head moved to the next one (mod the kv heads): a shard of the wrong kv head."""
    def wrong(model, **kw):
        lay = layout_fn(model, **kw)
        if kw["rank"] != rank:
            return lay
        return msgspec.structs.replace(lay, kv_head_start=(lay.kv_head_start + 1) % lay.total_kv_heads)
    return wrong


def run_one(g: distributed.RankGroup, sc: str, outdir: Path) -> dict:
    tp, pp = map(int, re.match(r"(?:mla_)?tp(\d+)pp(\d+)", sc).groups())
    req = SetupRequest(model=MLA if sc.startswith("mla_") else MODEL, args=AttentionArgs(tp_size=tp, pp_size=pp, attention_backend="torch_native"),
                       device=g.device, rank=g.rank, world_size=g.world_size, pool=POOL)
    patch = (mock.patch.object(shard, "plan_layout", swapped(shard.plan_layout, g.world_size - 1))
             if sc.endswith(":swap") else mock.patch.dict({}))
    with patch:
        shard._VIEWS.clear()
        lay = shard.layout_of(req)
        with build_attention_backends(req, rank_group=g, installed=INSTALLED,
                                      log_file=str(outdir / "logs" / f"{sc}.rank{g.rank}.jsonl")) as out:
            own = verify_built(out, req, decode_steps=1)
            world = world_check(out.attn_backend, req, kv_pool=out.pools["kv_pool"],
                                req_to_token_pool=out.pools["req_to_token_pool"], torch_device=out.torch_device,
                                dtype="bfloat16", name="torch_native", group=g.cpu_group)
    return {"layout": msgspec.to_builtins(lay), "own": [msgspec.to_builtins(r) for r in own],
            "world": msgspec.to_builtins(world), "kinds": msgspec.to_builtins(req.served_model.layer_kinds())}


def main(scenarios: list[str], outdir: Path) -> None:
    g = distributed.init_from_env("cpu", timeout_s=float(os.environ.get("EXCHANGE_TIMEOUT_S", "30")))
    for sc in scenarios:
        res = {"rank": g.rank, "world_size": g.world_size, **run_one(g, sc, outdir)}
        (outdir / f"result.{sc}.rank{g.rank}.json").write_text(json.dumps(res))
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
