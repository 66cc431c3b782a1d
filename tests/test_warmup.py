"""`attn-setup warmup`: the variant list per configuration (pure) and the CPU no-op path."""

from __future__ import annotations

import json

from conftest import CONFIGS, cuda_facts
from pipeline.core.contracts import AttentionArgs, ResolvedAttentionBackendStr, SetupRequest
from pipeline.cli.warmup import variants_for_request
from pipeline.core.model_spec import load_model_spec


def _names(config, pair, **args):
    req = SetupRequest(args=AttentionArgs(**args), model=load_model_spec(CONFIGS / config), device="cuda")
    return sorted(v.name for v in variants_for_request(req, cuda_facts(), ResolvedAttentionBackendStr(**pair)))


def test_llama_flashinfer_needs_one_prefill_and_one_decode_variant():
    """Llama (one full-attention kind, bf16): fa2 prefill + CUDA-core decode at head dim 128 on sm90."""
    assert _names("llama-3.1-8b.json", dict(prefill="flashinfer", decode="flashinfer")) == [
        "decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90", "prefill-fa2/bf16-bf16/d128/swa0/cap0/sm90"]


def test_gemma2_has_window_and_softcap_variants():
    """Gemma-2: full and sliding kinds, both softcapped, head dim 256 → four variants with fa2."""
    names = _names("gemma-2-9b.json", dict(prefill="flashinfer", decode="flashinfer"), dtype="bfloat16")
    assert len(names) == 4 and all("d256" in n and "cap1" in n for n in names)
    assert sum("swa1" in n for n in names) == 2


def test_gpt_oss_sinks_use_the_sink_variant_only():
    """gpt-oss: layers with sinks compile the attention-sink kernel, no separate decode kernel."""
    names = _names("gpt-oss-20b.json", dict(prefill="fa3", decode="fa3"))
    assert names and all(n.startswith("sink-fa3/") for n in names)


def test_hybrid_with_torch_native_lists_only_the_flashinfer_half():
    """prefill flashinfer + decode torch_native: only the flashinfer variants."""
    names = _names("llama-3.1-8b.json", dict(prefill="flashinfer", decode="torch_native"))
    assert len(names) == 2


def test_cpu_warmup_is_a_successful_no_op():
    """On CPU (torch_native) there is nothing to compile: exit 0 and an explanatory note."""
    from conftest import run_main

    p = run_main("warmup", "--device", "cpu", "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["variants"] == [] and out["resolved"]["prefill"] == "torch_native"
