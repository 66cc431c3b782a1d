"""Issue 13 §6: nothing refused late — graph sizes and the FlashInfer workspace are checked before allocation.

``plan`` and ``run``'s preflight (every device) refuse CUDA-graph batch sizes above ``max_reqs`` and a
FlashInfer workspace smaller than the largest batch it will plan, naming both numbers, with remedies
that work when applied. The workspace bytes expected here are written out from FlashInfer 0.7.2's
scheduler formulas (docs/internals.md, ``pipeline.backends.flashinfer.rules``), not taken from the code.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from pipeline.core import events as ev
from pipeline.setup.build import build_attention_backends
from pipeline.cli import main
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.eventlog import EventLog
from pipeline.platforms.fake import FakePlatform
from pipeline.platforms.profiles import PROFILES

FI = ["--installed", "torch,triton,flashinfer-python"]


def _plan(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _fa2_eager_bytes(h: int, hkv: int, dv: int, sms: int) -> int:
    """FA2 eager split-KV scratch: 2 CTAs/SM over kv heads, 128 packed rows per tile (Dv < 256), one partial row per
    query row (packed rows / group), float32 v + lse, 2×16 B."""
    rows = -(-(2 * sms // hkv) * 128 // (h // hkv))
    return h * rows * dv * 4 + h * rows * 4 + 32


@pytest.mark.parametrize("profile", list(PROFILES))
def test_graph_sizes_above_max_reqs_are_refused_by_plan_on_every_device(profile, capsys):
    """--cuda-graph-bs 1 2 113 --max-reqs 4: exit 3 on every profile (CPU too), naming 113 and 4, state build-mode."""
    code, out = _plan(capsys, "--device-profile", profile, *FI, "--cuda-graph-bs", "1", "2", "113", "--max-reqs", "4")
    err = out["error"]
    assert code == 3 and err["code"] == "invalid_value" and err["state"] == "build-mode"
    assert {f["name"]: f["value"] for f in err["flags"]} == {"--cuda-graph-bs": [1, 2, 113], "--max-reqs": 4}
    assert "113" in err["message"] and "--max-reqs 4" in err["message"] and "[" not in err["message"]
    assert err["remedy"] == "drop 113 from --cuda-graph-bs (keeping 1, 2), or raise --max-reqs to at least 113"


@pytest.mark.parametrize("fix", [["--cuda-graph-bs", "1", "2", "--max-reqs", "4"],
                                 ["--cuda-graph-bs", "1", "2", "113", "--max-reqs", "113"]])
@pytest.mark.parametrize("profile", ["cpu", "h200"])
def test_both_graph_size_remedies_work(fix, profile, capsys):
    """Each alternative of that remedy, applied, plans."""
    code, out = _plan(capsys, "--device-profile", profile, *FI, *fix)
    assert code == 0, out


def test_run_refuses_graph_sizes_before_the_model_loads(tmp_path, capsys):
    """run --device cpu: exit 3 in preflight; the trace has device-init → resolve → build-mode failed and no model,
    pool or backend record (nothing allocated)."""
    log = tmp_path / "g.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), "--cuda-graph-bs", "1", "2", "113",
                 "--max-reqs", "4"])
    out = json.loads(capsys.readouterr().out)
    assert code == 3 and out["error"]["code"] == "invalid_value" and out["runner_states"] == []
    names = {json.loads(line)["event"] for line in log.read_text().splitlines()}
    assert not names & {"model_loaded", "memory_pool_sized", "backend_built", "runner_started"}
    assert [s["state"] for s in out["states"]] == ["device-init", "resolve", "build-mode", "failed"]


def test_library_refuses_graph_sizes_in_build_mode_before_pools(llama):
    """build_attention_backends: cuda_graph_bs above pool.max_reqs is refused before pools or backends exist."""
    req = SetupRequest(args=AttentionArgs(cuda_graph_bs=[1, 16]), model=llama,
                       pool=PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=64), device="cpu")
    log = EventLog("g")
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, installed={"torch": True}, log=log)
    assert ei.value.info.state == "build-mode" and "16" in ei.value.info.message
    assert not any(isinstance(r, ev.BackendBuilt) for r in log.records)
    assert not [r for r in log.records if isinstance(r, ev.ResourcesReleased) and any(
        x.startswith("pool:") for x in r.released)]


def test_plan_refuses_a_workspace_build_mode_would_refuse(capsys):
    """plan --flashinfer-workspace-size 1048576 on an H200 (Llama: H 32, Hkv 8, Dv 128; 132 SMs): exit 3
    workspace_too_small naming the bytes the FA2 eager plan needs; that size (not one byte less) then plans."""
    need = _fa2_eager_bytes(32, 8, 128, 132)
    base = ["--device-profile", "h200", *FI]
    code, out = _plan(capsys, *base, "--flashinfer-workspace-size", "1048576")
    err = out["error"]
    assert code == 3 and err["code"] == "workspace_too_small" and err["state"] == "build-mode"
    assert {f["name"]: f["value"] for f in err["flags"]} == {"--flashinfer-workspace-size": 1048576, "needed_bytes": need}
    assert err["remedy"] == f"set --flashinfer-workspace-size to at least {need}"  # the flag wins: not the variable
    assert _plan(capsys, *base, "--flashinfer-workspace-size", str(need))[0] == 0
    assert _plan(capsys, *base, "--flashinfer-workspace-size", str(need - 1))[0] == 3


def _graph_decode_bytes(bs: int, h: int = 32, hkv: int = 8, dv: int = 128, sms: int = 132) -> int:
    """Tensor-core decode plan captured at ``bs``: tiles of 16 packed rows for group 4 (packed length 4 <= 16),
    max(2*SMs/Hkv, ceil(bs*G/16) + bs - 1) tiles, tiles * 16 / G query rows."""
    tiles = max(2 * sms // hkv, -(-bs * (h // hkv) // 16) + bs - 1)
    rows = -(-tiles * 16 // (h // hkv))
    return h * rows * dv * 4 + h * rows * 4 + 32


def test_workspace_remedy_names_the_largest_graph_size_that_fits(capsys):
    """18 MB with --max-reqs 256: the graph term needs more; the remedy names the largest captured batch that
    fits (from the formula), it plans, and one more does not."""
    fits = max(bs for bs in range(1, 257) if max(_graph_decode_bytes(bs), _fa2_eager_bytes(32, 8, 128, 132),
                                                  32 * (16 * 132 // 8) * 129 * 4 + 32) <= 18_000_000)
    assert 8 < fits < 250
    base = ["--device-profile", "h200", *FI, "--flashinfer-workspace-size", "18000000", "--max-reqs", "256"]
    code, out = _plan(capsys, *base)
    assert code == 3 and out["error"]["remedy"].endswith(f"or set --cuda-graph-max-bs {fits}")
    assert out["error"]["flags"][1] == {"name": "needed_bytes", "value": _graph_decode_bytes(256)}
    # the default series under max bs K captures K's largest member <= K; K = fits plans, an explicit list above does not
    assert _plan(capsys, *base, "--cuda-graph-max-bs", str(fits))[0] == 0
    assert _plan(capsys, *base, "--cuda-graph-bs", str(fits + 1))[0] == 3
    code, out = _plan(capsys, *base, "--cuda-graph-bs", "8", "250")
    assert code == 3 and out["error"]["remedy"].endswith(f"or use only sizes up to {fits} in --cuda-graph-bs")
    assert _plan(capsys, *base, "--cuda-graph-bs", "8", str(fits))[0] == 0


def test_workspace_bound_counts_only_the_sizes_actually_captured(capsys):
    """With torch_native decoding (no graphs) the graph term is 0: only the eager plan's bytes are needed."""
    need = _fa2_eager_bytes(32, 8, 128, 132)
    base = ["--device-profile", "h200", *FI, "--flashinfer-workspace-size", str(need), "--max-reqs", "256"]
    assert _plan(capsys, *base)[0] == 3  # flashinfer decodes: the 256-request graph needs more
    code, out = _plan(capsys, *base, "--prefill-attention-backend", "flashinfer", "--decode-attention-backend",
                      "torch_native")
    assert code == 0 and out["plan"]["hybrid"]
    assert _plan(capsys, *base, "--disable-cuda-graph")[0] == 0


def test_library_refuses_a_small_workspace_before_pools(llama):
    """build_attention_backends on a (faked) H200 with flashinfer and a 1 MiB workspace: workspace_too_small in
    build-mode, before any pool, workspace or backend exists (the same check plan runs)."""
    facts = msgspec.structs.replace(PROFILES["h200"], source="test")
    req = SetupRequest(args=AttentionArgs(attention_backend="flashinfer", flashinfer_workspace_size=1 << 20),
                       model=llama, pool=PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=64),
                       device="cuda:0")
    log = EventLog("w")
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, platform=FakePlatform(facts, "cpu"), log=log,
                                 installed={"torch": True, "triton": True, "flashinfer-python": True})
    assert ei.value.info.code == "workspace_too_small" and ei.value.info.state == "build-mode"
    assert not any(isinstance(r, (ev.BackendBuilt, ev.ResourcesReleased)) for r in log.records)


def test_cpu_plan_ignores_the_flashinfer_workspace(capsys):
    """On CPU no FlashInfer backend is planned, so a tiny --flashinfer-workspace-size is not refused."""
    assert _plan(capsys, "--device-profile", "cpu", *FI, "--flashinfer-workspace-size", "1048576")[0] == 0
