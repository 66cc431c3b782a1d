"""A config without ``torch_dtype`` / ``dtype`` under ``--dtype auto`` (trial 13, finding 1).

sglang's ``_get_and_verify_dtype`` (``python/sglang/srt/configs/model_config.py``) reads a missing
``torch_dtype`` as float32 (``config_dtype = torch.float32`` when it is None) and then downcasts it:
bfloat16 for ``model_type.startswith("gemma")``, float16 otherwise. We read it as bfloat16 and called it
``auto:checkpoint``, a rule that had seen no checkpoint dtype. The source now says the dtype was missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.contracts import AttentionArgs
from pipeline.core.dtypes import AUTO_RULES, resolve_dtype
from pipeline.core.model_spec import load_model_spec

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
