"""Our reading of every accepted family, run through our backends, against the model's own code in transformers.

For one published config per ``model_type`` that ``plan`` accepts (the bundled examples and tests/data/model_configs),
:func:`pipeline.runtime.model_oracle.check_model` builds the transformers model with random weights (layers cut to
cover every attention kind, MLP / vocabulary / experts shrunk, attention fields untouched), registers an attention
function through ``transformers.AttentionInterface`` and compares, per layer, the model's eager attention with
torch_native run from our layer kind (heads, dims, scale, window, softcap, sinks; the model's ``scaling`` /
``sliding_window`` / ``softcap`` kwargs are compared exactly). Float32, short prompts: the windows longer than the
prompt are checked through the kwargs, gpt-oss's 128 also through the output. The Triton interpreter runs two
families in bfloat16. A deliberately wrong reading must fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from pipeline.core.model_spec import load_model_spec
from pipeline.runtime.model_oracle import check_model

ROOT = Path(__file__).resolve().parent.parent
PINS = json.loads((ROOT / "tests" / "data" / "model_corpus_outcomes.json").read_text())
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.json")) + [
    ROOT / "tests" / "data" / "model_configs" / name for name, pin in sorted(PINS.items()) if "kinds" in pin]


def _families() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in CONFIGS:
        out.setdefault(load_model_spec(path).model_type, path)
    return out


FAMILIES = _families()
GPT_OSS = ROOT / "examples" / "configs" / "gpt-oss-20b.json"
GEMMA2 = ROOT / "examples" / "configs" / "gemma-2-9b.json"


def _assert_passed(results, spec) -> None:
    bad = [r for r in results if not r.passed]
    assert not bad, bad
    kinds = {(k.kind, k.num_heads, k.num_kv_heads, k.head_dim_qk) for k in spec.layer_kinds()}
    assert len({r.layer_id for r in results}) >= min(len(kinds), len(results)) > 0


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_matches_the_model_code(model_type):
    path = FAMILIES[model_type]
    _assert_passed(check_model(path, max_seq=32), load_model_spec(path))


def test_window_is_applied_as_the_model_applies_it():
    """A prompt past gpt-oss's 128-key window: the output, not only the kwarg, shows the window (and the sinks)."""
    results = check_model(GPT_OSS, seq=136)
    assert {r.kind for r in results} == {"sliding", "full"} and all(r.passed for r in results), results


@pytest.mark.parametrize("path", [GEMMA2, GPT_OSS], ids=["gemma2-softcap", "gpt-oss-sinks"])
def test_triton_interpreter_matches_the_model_code(path):
    results = check_model(path, "triton", seq=16, backend_dtype=torch.bfloat16)
    assert results and all(r.passed for r in results), results


@pytest.mark.parametrize("change, field", [
    ({"has_attention_sinks": False}, "has_sinks"),
    ({"sliding_window": 64}, "sliding_window"),
    ({"scaling": 0.1}, "scaling"),
])
def test_a_wrong_reading_fails(change, field):
    """The oracle is not our reading checked against itself: gpt-oss read without its sinks, with another window or
    another scale fails on the layers concerned, naming the field."""
    spec = msgspec.structs.replace(load_model_spec(GPT_OSS), **change)
    results = check_model(GPT_OSS, seq=136, spec=spec)
    failed = [r for r in results if not r.passed]
    assert failed and all(r.mismatch and r.mismatch.startswith(field) for r in failed), results


def test_a_wrong_window_fails_on_the_output_alone():
    """With the kwarg check out of the way (gpt-oss passes sliding_window), a window off by one still shows in the
    output past the window."""
    import pipeline.runtime.model_oracle as oracle

    spec = msgspec.structs.replace(load_model_spec(GPT_OSS), sliding_window=127)
    keep = oracle._mismatch
    try:
        oracle._mismatch = lambda kind, module, q, k, v, kwargs: keep(kind, module, q, k, v, {})
        results = check_model(GPT_OSS, seq=136, spec=spec)
    finally:
        oracle._mismatch = keep
    sliding = [r for r in results if r.kind == "sliding"]
    assert sliding and all(r.mismatch is None and r.rel_err > r.tol for r in sliding), results


def test_asymmetric_dims_doubled_kv_heads_and_sliding_sinks_match_the_model_code():
    """MiMo-V2-Flash's reading (qk 192 / v 128; sliding layers with twice the kv heads and sinks, as its modeling code
    builds them) against MiMoV2FlashAttention itself, past the 128-key window."""
    base = {k: v for k, v in json.loads(GPT_OSS.with_name("llama-3.1-8b.json").read_text()).items()
            if k not in ("num_key_value_heads", "rope_scaling")}
    cfg = {**base, "model_type": "mimo_v2_flash", "num_hidden_layers": 4, "head_dim": 192, "v_head_dim": 128,
           "num_key_value_heads": 4, "sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"] * 2}
    results = check_model(cfg, seq=136)
    assert {r.kind for r in results} == {"full", "sliding"} and all(r.passed for r in results), results
