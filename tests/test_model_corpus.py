"""Every published config.json of tests/data/model_configs has a pinned outcome: accepted with its layer-kind summary
(kind, heads, kv heads, qk / v dims, scale, window, sinks, K = V, layer count) and its not-attention groups, or refused
with the exact error code and field — through the reader and through ``plan --json`` in-process (same exit code and
error code). The accepted readings are checked against the model's own code by tests/test_model_oracle.py; no refusal
of a published file tells the user to fix it. ``run --device cpu`` builds and verifies a few of them (a heterogeneous
Gemma-4 with K = V full layers, a Qwen3.5 hybrid, an own-rule family).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_json
from pipeline.core.errors import AttnSetupError
from pipeline.core.model_spec import load_model_spec

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "model_configs"
PINS = json.loads((ROOT / "tests" / "data" / "model_corpus_outcomes.json").read_text())
FILES = sorted(p for p in CORPUS.glob("*.json") if p.name != "SOURCES.json")


def outcome(path: Path) -> dict:
    try:
        s = load_model_spec(path)
    except AttnSetupError as e:
        return {"code": e.info.code, "field": e.info.flags[0].name if e.info.flags else None,
                "blames_file": "fix" in (e.info.remedy or "").lower()}
    return {"kinds": [[k.kind, k.num_heads, k.num_kv_heads, k.head_dim_qk, k.head_dim_v, round(k.scaling, 6),
                       k.sliding_window, k.has_sinks, k.k_eq_v, len(k.layer_ids)] for k in s.layer_kinds()],
            "other": [[g.kind, len(g.layer_ids)] for g in s.not_attention()]}


def test_every_corpus_file_is_pinned():
    assert len(FILES) >= 40 and sorted(PINS) == sorted(p.name for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_corpus_outcome(path):
    got = outcome(path)
    assert got == PINS[path.name]
    assert not got.get("blames_file")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_plan_agrees(path):
    code, out = run_json("plan", "--device-profile", "h200", "--model", str(path))
    pin = PINS[path.name]
    if "code" in pin:
        assert code == 3 and out["error"]["code"] == pin["code"], out
        assert "fix" not in out["error"]["remedy"].lower()
    else:
        assert code == 0 and out["ok"], out


@pytest.mark.parametrize("name", [
    pytest.param("google-gemma-4-31b-it.json", marks=pytest.mark.slow),  # 6 layers of hidden 5376: ~40 s on 2 cores
    "qwen-qwen3.5-9b.json", "xiaomimimo-mimo-7b-base.json"])
def test_run_on_cpu_verifies(name):
    """Every attention kind built (the default --num-layers covers them) and verified against float64."""
    code, out = run_json("run", "--model", str(CORPUS / name), "--decode-steps", "0")
    assert code == 0 and out["ok"], out.get("error")
    assert out["verified"] and all(v["passed"] for v in out["verified"]), out["verified"]
