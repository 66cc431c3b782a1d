"""The FlashInfer compile cache explained, against a fake cache directory.

The module paths below are written out by hand from FlashInfer 0.7.2's layout (jit/env.py: <base>/.cache/
flashinfer/<version>/<arch>/cached_ops/<uri>/<uri>.so; compilation_context.py: sm90 -> "90a"; the URIs of
jit/attention/modules.py: fa2 prefill builds the ``_kv_stride_equal`` module, MLA URIs end in ``_planabi2``), not
produced by the code under test. tests/gpu/test_flashinfer_api.py compares the names with FlashInfer's own JitSpecs.
"""

from __future__ import annotations

import json

import pytest

import pipeline.backends.flashinfer.jit as jc
from conftest import run_main

PLAN = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer-python",
        "--attention-backend", "flashinfer", "--json"]
PREFILL = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128_"
           "head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_kv_stride_equal")
DECODE = ("batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128_"
          "head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setattr(jc, "flashinfer_version", lambda: "0.7.2")
    monkeypatch.setattr(jc, "aot_dir", lambda: None)
    ops = tmp_path / ".cache" / "flashinfer" / "0.7.2" / "90a" / "cached_ops"

    def build(uri):
        (ops / uri).mkdir(parents=True, exist_ok=True)
        (ops / uri / f"{uri}.so").write_bytes(b"\x7fELF")
    return build


def test_cold_cache_is_refused_then_warm_after_the_modules_exist(cache):
    """--require-warm-cache: exit 3 cold_jit_cache naming the variant and the warmup command; once the modules
    the warmup builds exist, exit 0 and nothing is listed."""
    p = run_main(*PLAN, "--require-warm-cache")
    assert p.returncode == 3
    err = json.loads(p.stdout)["error"]
    assert err["code"] == "cold_jit_cache" and err["flags"][1] == {"name": "variant",
                                                                   "value": "prefill-fa2/bf16-bf16/d128/swa0/cap0/sm90"}
    assert "attn-setup warmup --attention-backend flashinfer" in err["remedy"]
    assert "--device-profile" not in err["remedy"] and "--require-warm-cache or" not in err["remedy"].split("run")[1][:40]
    cache(PREFILL)
    cache(DECODE)  # what `attn-setup warmup --attention-backend flashinfer` writes on an H200
    p = run_main(*PLAN, "--require-warm-cache")
    assert p.returncode == 0, p.stdout
    assert json.loads(p.stdout)["jit_cold"] == []


def test_a_miss_names_the_nearest_cached_variant_and_the_fields(cache):
    d64 = DECODE.replace("head_dim_qk_128_head_dim_vo_128", "head_dim_qk_64_head_dim_vo_64")
    cache(d64)
    cold = {c["module"]: c for c in json.loads(run_main(*PLAN).stdout)["jit_cold"]}
    assert cold[DECODE]["variant"] == "decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90"
    assert cold[DECODE]["nearest"] == d64 and cold[DECODE]["differs"] == ["head_dim_qk", "head_dim_vo"]
    assert cold[PREFILL]["nearest"] == d64 and cold[PREFILL]["differs"] == ["kind", "head_dim_qk", "head_dim_vo"]
    cache(PREFILL)  # now one field (the kind) from the missing decode module: the nearest
    cold = {c["module"]: c for c in json.loads(run_main(*PLAN).stdout)["jit_cold"]}
    assert list(cold) == [DECODE] and (cold[DECODE]["nearest"], cold[DECODE]["differs"]) == (PREFILL, ["kind"])


def test_estimate_from_warmup_records(cache):
    """plan's estimate is the seconds warmup recorded beside the cache (the kind's median for other modules)."""
    jc.record_seconds("0.7.2", "sm90", [(PREFILL, 61.5)])
    jc.record_seconds("0.7.2", "sm90", [("batch_decode_with_kv_cache_other", 19.0)])
    cold = {c["module"]: c["estimate_s"] for c in json.loads(run_main(*PLAN).stdout)["jit_cold"]}
    assert cold == {PREFILL: 61.5, DECODE: 19.0}
    text = run_main(*PLAN[:-1]).stdout
    assert "2 variant(s) would compile here (about 80 s from warmup records)" in text


@pytest.mark.parametrize("arch,want", [("sm90", "90a"), ("sm80", "80"), ("sm89", "89"), ("sm100", "100a"),
                                       ("sm120", "120f"), ("sm121", "121a"), ("", "")])
def test_arch_dir(arch, want):
    assert jc.arch_dir(arch) == want


def test_warmup_command_keeps_setup_flags_only():
    from pipeline.cli.warmup import warmup_command

    argv = ["run", "--device", "cuda", "--json", "--log-file", "x.jsonl", "--attention-backend", "fa3",
            "--require-warm-cache", "--num-layers", "3", "--page-size=16", "--metrics-file=m.prom"]
    assert warmup_command(argv) == "attn-setup warmup --device cuda --attention-backend fa3 --page-size=16"


@pytest.mark.parametrize("kind,backend,dims,want", [
    ("prefill", "fa3", (128, 128), "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
                                   "head_dim_qk_128_head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False_"
                                   "f16qk_False_sm90"),
    ("mla", "fa3", (576, 512), "batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
                               "head_dim_ckv_512_head_dim_kpe_64_profiler_False_planabi2_sm90"),
    ("mla", "fa2", (576, 512), "batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
                               "head_dim_ckv_512_head_dim_kpe_64_profiler_False_planabi2"),
    ("sink", "fa2", (64, 64), "attn_setup_prefill_sink_q_bf16_kv_bf16_d64x64_swa_False_fa2"),
])
def test_module_names_of_each_kind(kind, backend, dims, want):
    """fa3 prefill keeps 0.6.13's name; MLA gained ``_planabi2``; a sink variant is named as we build it (our
    complete name, pipeline.backends.flashinfer.jit.sink_uri), not as FlashInfer's sink wrapper would."""
    from pipeline.backends.flashinfer.jit import Variant

    v = Variant(kind=kind, backend=backend, q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=dims[0],
                head_dim_vo=dims[1], arch="sm90")
    assert jc.module_name(v) == want
    assert jc._fields(want)["kind"] == kind and jc._fields(want)["backend"] in (backend, "fa2/cuda_core")
