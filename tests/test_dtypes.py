"""The --dtype rule over its whole space: model type x checkpoint dtype x flag, against the engines' rules.

The expectations below restate sglang's ``_get_and_verify_dtype`` (float32 checkpoint: bfloat16 for
``model_type.startswith("gemma")``, else float16; other checkpoints kept) and vLLM's
``_FLOAT16_NOT_SUPPORTED_MODELS`` (gemma2, gemma3, gemma3_text, plamo2, glm4: explicit float16 refused,
auto falls back to bfloat16) as a table, written apart from pipeline/dtypes.py.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest

from pipeline.core.contracts import AttentionArgs, ModelSpec
from pipeline.core.dtypes import AUTO_RULES, resolve_dtype
from pipeline.core.errors import EXIT_REFUSED, ConfigError
from pathlib import Path
from pipeline.core.model_spec import load_model_spec
import json

VLLM_NO_FP16 = {"gemma2", "gemma3", "gemma3_text", "plamo2", "glm4"}
MODEL_TYPES = ["gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "plamo2", "glm4", "llama", "qwen3_next",
               "llama4_text", "gpt_oss", "deepseek_v2"]
CHECKPOINTS = ["bfloat16", "float16", "float32"]
# every --dtype spelling AttentionArgs accepts (vLLM's ModelDType: auto, half, float16, bfloat16, float, float32;
# plus bf16, fp16, fp32, which --kv-cache-dtype takes as sglang's does: one alias set for both flags)
FLAGS = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
         "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def _spec(model_type: str, dtype: str) -> ModelSpec:
    return msgspec.convert(dict(model_type=model_type, hidden_size=512, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=128, v_head_dim=128, scaling=128 ** -0.5,
                                layer_types=["full", "full"], dtype=dtype), ModelSpec)


def expected(model_type: str, ckpt: str, flag: str):
    """(value, source) or 'refused', restated from the two engines."""
    want = FLAGS[flag]
    if want is not None:
        return "refused" if want == "float16" and model_type in VLLM_NO_FP16 else (want, "field")
    if ckpt == "float32":
        if model_type.startswith("gemma") or model_type in VLLM_NO_FP16:
            return "bfloat16", "auto:float32_to_bfloat16"
        return "float16", "auto:float32_to_float16"
    if ckpt == "float16" and model_type in VLLM_NO_FP16:
        return "bfloat16", "auto:float16_refused_to_bfloat16"
    return ckpt, "auto:checkpoint"


CASES = list(itertools.product(MODEL_TYPES, CHECKPOINTS, FLAGS))


def test_the_space_is_covered():
    """Every model type x checkpoint x flag spelling (12 x 3 x 9), and every spelling AttentionArgs accepts."""
    from pipeline.core.validation import MODEL_DTYPES

    assert len(CASES) == 324 and set(FLAGS) == set(MODEL_DTYPES)


@pytest.mark.parametrize("model_type,ckpt,flag", CASES)
def test_dtype_rule(model_type, ckpt, flag):
    """resolve_dtype equals the restated rule; a refusal is exit 3 naming dtype, the model type and what works."""
    args, spec = AttentionArgs(dtype=flag), _spec(model_type, ckpt)
    want = expected(model_type, ckpt, flag)
    if want == "refused":
        with pytest.raises(ConfigError) as ei:
            resolve_dtype(args, spec)
        info = ei.value.info
        assert ei.value.exit_code == EXIT_REFUSED and info.code == "dtype_refused" and info.state == "resolve"
        assert [(f.name, f.value) for f in info.flags] == [("dtype", flag), ("model_type", model_type)]
        assert info.allowed == ["bfloat16", "float32", "auto"] and "dtype='bfloat16'" in info.remedy
        # the remedy is true: each dtype it names resolves
        for ok in ("bfloat16", "float32", "auto"):
            assert resolve_dtype(AttentionArgs(dtype=ok), spec).value != "float16"
        return
    got = resolve_dtype(args, spec)
    assert (got.value, got.source) == want
    if got.source.startswith("auto:"):
        assert got.source[5:] in AUTO_RULES
        # auto never picks what an explicit flag would be refused for
        assert not (got.value == "float16" and model_type in VLLM_NO_FP16)


def test_one_alias_set_for_dtype_and_kv_cache_dtype():
    """``--dtype`` and ``--kv-cache-dtype`` take the same spellings of each float dtype (``--dtype bf16`` was refused
    while ``--kv-cache-dtype bf16`` was accepted), and every spelling means its canonical dtype in both: the
    compute dtype it resolves to, the KV dtype it stores, and gemma2's float16 refusal for each float16 spelling."""
    from pipeline.core.dtypes import kv_dtype, model_dtype
    from pipeline.core.validation import DTYPE_SPELLINGS, KV_CACHE_DTYPES, MODEL_DTYPES

    llama, gemma = _spec("llama", "bfloat16"), _spec("gemma2", "bfloat16")
    assert [v for v in MODEL_DTYPES if v != "auto"] == [v for v in KV_CACHE_DTYPES if not v.startswith(("fp8", "auto"))]
    for name, spellings in DTYPE_SPELLINGS.items():
        for s in spellings:
            assert model_dtype(AttentionArgs(dtype=s), llama) == name
            assert kv_dtype(AttentionArgs(kv_cache_dtype=s), llama) == name
            if name == "float16":
                with pytest.raises(ConfigError) as e:
                    resolve_dtype(AttentionArgs(dtype=s), gemma)
                assert e.value.info.code == "dtype_refused"
            else:
                assert resolve_dtype(AttentionArgs(dtype=s), gemma).value == name
    for bad in ("bf32", "fp64", "int8", "BF16"):
        for field in ("dtype", "kv_cache_dtype"):
            with pytest.raises(ConfigError) as e:
                AttentionArgs(**{field: bad})
            assert e.value.info.flags[0].name == field and "bf16" in e.value.info.allowed


CFG = Path(__file__).resolve().parents[1] / "examples" / "configs"


def _without_dtype(name: str) -> dict:
    cfg = json.loads((CFG / name).read_text())
    for key in ("torch_dtype", "dtype"):
        cfg.pop(key, None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop(key, None)
    return cfg


@pytest.mark.parametrize("name,value,rule", [
    ("llama-3.1-8b.json", "float16", "missing_torch_dtype_as_float32_to_float16"),
    ("gemma-2-9b.json", "bfloat16", "missing_torch_dtype_as_float32_to_bfloat16"),      # sglang's Gemma rule
    ("gemma-3-12b-it.json", "bfloat16", "missing_torch_dtype_as_float32_to_bfloat16"),
    ("gpt-oss-20b.json", "float16", "missing_torch_dtype_as_float32_to_float16"),       # published without one
])
def test_missing_torch_dtype_is_float32_as_sglang_reads_it(name, value, rule):
    spec = load_model_spec(_without_dtype(name))
    assert (spec.dtype, spec.dtype_missing) == ("float32", True)
    got = resolve_dtype(AttentionArgs(), spec)
    assert (got.value, got.source) == (value, f"auto:{rule}") and rule in AUTO_RULES
    # an explicit dtype is still the field's, and a float32 written out keeps its own rule
    assert resolve_dtype(AttentionArgs(dtype="bfloat16"), spec).source == "field"
    written = load_model_spec({**_without_dtype(name), "torch_dtype": "float32"})
    plain = "auto:" + rule.removeprefix("missing_torch_dtype_as_")
    assert not written.dtype_missing and resolve_dtype(AttentionArgs(), written).source == plain


def test_plan_names_the_missing_torch_dtype(tmp_path, capsys):
    """The finding's command: ``plan --model tiny.json`` (llama, no torch_dtype) says float16 and why."""
    from pipeline.cli import main

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(_without_dtype("llama-3.1-8b.json")))
    assert main(["plan", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dtype: float16 (auto:missing_torch_dtype_as_float32_to_float16)" in out
    assert main(["plan", "--model", str(path), "--json"]) == 0
    dtype = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resolved"]["dtype"]
    assert dtype == {"value": "float16", "source": "auto:missing_torch_dtype_as_float32_to_float16"}
