"""A value that is another engine's spelling or a typo of an allowed one gets "did you mean" naming it: flag values
(vLLM's ``--kv-cache-dtype fp8``) and model config values (``torch_dtype: "bfloat61"``), and the suggestion works."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS, run_main


@pytest.mark.parametrize("flag, value, near", [("--kv-cache-dtype", "fp8", "fp8_e4m3"),
                                               ("--kv-cache-dtype", "float8_e5m2", "fp8_e5m2"),
                                               ("--dtype", "bfloat61", "bfloat16")])
def test_a_flag_value_gets_did_you_mean(flag, value, near):
    err = json.loads(run_main("plan", flag, value, "--json").stdout)["error"]
    assert err["code"] == "out_of_domain" and f"did you mean {near!r}?" in err["message"]
    assert run_main("plan", flag, near, "--json").returncode == 0


@pytest.mark.parametrize("key, value, near", [("torch_dtype", "bfloat61", "bfloat16"),
                                              ("torch_dtype", "torch.float16", "float16")])
def test_a_model_config_value_gets_did_you_mean(tmp_path, key, value, near):
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    err = json.loads(run_main("plan", "--model", str(path), "--json").stdout)["error"]
    assert err["code"] == "model_config_invalid" and f"did you mean {near!r}?" in err["message"]
    assert near in err["remedy"]
    cfg[key] = near
    path.write_text(json.dumps(cfg))
    assert run_main("plan", "--model", str(path), "--json").returncode == 0
