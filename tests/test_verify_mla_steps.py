"""Model-step verification of an absorbed-MLA stack against two float64 references (pipeline.runtime.model_steps).

The kernel check (``mla-absorbed``: the reference follows the absorbed path and rounds where the stack does) holds
the compute dtype's tolerance; the absorption check (``mla-unabsorbed``: per-head K/V expanded from the latent cache)
holds a tolerance derived from the two absorbed-only roundings on the same batch. A right stack passes both over
long decodes and page sizes; a wrong absorption in the stack fails both; a wrong absorption shared by the stack and
the absorbed reference passes the kernel check and fails the absorption check — the case only that check catches.

A small synthetic DeepSeek-V2-style config (4 heads, kv_lora_rank 64) keeps each test to a few seconds; torch_native
serves MLA at any head dims and page size (its capability record), so these are the page sizes the CPU path takes.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from pipeline.core.errors import BuildError
from pipeline.core.model_spec import load_model_spec
from pipeline.memory.pools import check_needs
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime import model_steps
from pipeline.runtime.model_steps import (REF_MLA_ABSORBED, REF_MLA_UNABSORBED, absorption_tolerance,
                                          verify_model_steps)
from pipeline.runtime.runner import Runner, RunnerConfig

TINY_MLA = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
            "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "rope_theta": 10000, "max_position_embeddings": 4096, "vocab_size": 1000, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "tiny-mla.json"
    p.write_text(json.dumps(TINY_MLA))
    spec = load_model_spec(p)
    assert spec.is_mla
    return spec


def _f64(stack):
    """Fill the references' float64 weight cache from the stack's weights as they are now (right)."""
    stack._f64_weights = [{k: t.detach().to("cpu", torch.float64) for k, t in w.items()} for w in stack.weights]


def _roll_heads(t):
    return torch.roll(t, 1, dims=0)  # head h gets head h-1's matrix: a wrong head slot


def _noisy(t):
    g = torch.Generator().manual_seed(5)
    return t + 0.1 * t.abs().mean() * torch.randn(t.shape, generator=g).to(t.dtype)


def _checks(spec, *, steps=3, page_size=1, stack_wrong=None):
    """verify_model_steps on a 2-layer stack; ``stack_wrong=(key, fn)`` makes the *stack* compute with
    ``fn(weights[key])`` while the references keep the right weights (their float64 cache is filled first)."""
    pool = PoolFacts(max_reqs=4, max_context_len=16 + steps, page_size=page_size,
                     num_token_slots=check_needs(4, page_size, steps).steps_slots + 2 * page_size)
    req = SetupRequest(args=AttentionArgs(page_size=page_size), model=spec, device="cpu", pool=pool)
    facts = DeviceFacts(type="cpu", name="fake cpu", total_memory_bytes=8 << 30, sm_count=2, source="test")
    with Runner(RunnerConfig(request=req, num_layers=2), platform=FakePlatform(facts)) as r:
        r.initialize()
        assert all(L.is_mla for L in r.stack.layers) and r.stack.dtype is torch.bfloat16
        if stack_wrong is not None:
            key, fn = stack_wrong
            _f64(r.stack)
            for w in r.stack.weights:
                w[key] = fn(w[key])
        return verify_model_steps(r, decode_steps=steps)


def _by_ref(checks):
    steps = [c for c in checks if c.step != "kv-cache-write"]
    return ([c for c in steps if c.reference == REF_MLA_ABSORBED],
            [c for c in steps if c.reference == REF_MLA_UNABSORBED])


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("steps", [1, 150])
def test_right_mla_stack_passes_both_references(tiny_mla, steps, page_size):
    """Two checks per step, kernel check first; the kernel check at bf16's 1e-2, the absorption check at its
    derived tolerance (above 1e-2: the absorbed-only roundings move the output), every one passing."""
    checks = _checks(tiny_mla, steps=steps, page_size=page_size)
    kernel, absorption = _by_ref(checks)
    labels = ["extend", "chunked-extend"] + [f"decode#{i}" for i in range(steps)]
    assert [c.step for c in kernel] == labels == [c.step for c in absorption]
    assert [c.reference for c in checks[:2]] == [REF_MLA_ABSORBED, REF_MLA_UNABSORBED]
    assert all(c.tol == 1e-2 for c in kernel) and all(c.tol > 1e-2 for c in absorption)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.parametrize("key,fn", [("uk", _roll_heads), ("uk", _noisy), ("uv", _roll_heads), ("uv", _noisy)],
                         ids=["uk-wrong-head", "uk-perturbed", "uv-wrong-head", "uv-perturbed"])
def test_a_wrong_absorption_in_the_stack_fails_both_checks(tiny_mla, key, fn):
    """W_UK / W_UV of the wrong head, or off by 10 % noise, in the stack's absorbed path: every step's kernel
    check and absorption check fail (the attention kernel itself is right)."""
    kernel, absorption = _by_ref(_checks(tiny_mla, steps=4, stack_wrong=(key, fn)))
    assert kernel and not any(c.passed for c in kernel), kernel
    assert absorption and not any(c.passed for c in absorption), absorption


def test_a_wrong_absorption_shared_with_the_reference_fails_only_the_absorption_check(tiny_mla, monkeypatch):
    """The stack and the absorbed reference both absorb W_UK of the wrong head: the kernel check sees the same
    math on both sides and passes — the un-absorbed reference never uses the absorption, so that check fails.
    This is what a tolerance of ``|ref_absorbed - ref_unabsorbed|`` would have let through."""
    right = model_steps.absorb_query
    monkeypatch.setattr(model_steps, "absorb_query", lambda q, uk: right(q, _roll_heads(uk)))
    kernel, absorption = _by_ref(_checks(tiny_mla, steps=4, stack_wrong=("uk", _roll_heads)))
    assert kernel and all(c.passed for c in kernel), kernel
    assert absorption and not any(c.passed for c in absorption), absorption


def test_absorption_tolerance_is_the_kernel_tolerance_plus_the_rounding_effect():
    """tol * max|ar| / M + max|ar - ax| / M + F64_SLACK with M = max|un|; the absorbed-vs-un-absorbed difference
    itself is never part of it."""
    un = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    ar = torch.tensor([[2.02, -1.0]], dtype=torch.float64)
    ax = torch.tensor([[2.0, -1.01]], dtype=torch.float64)
    want = (1e-2 * 2.02 + 0.02) / 2.0 + model_steps.F64_SLACK
    assert absorption_tolerance(1e-2, ar, ax, un) == pytest.approx(want, rel=1e-12)
    assert absorption_tolerance(1e-2, ar, ax, un + 5.0) < absorption_tolerance(1e-2, ar, ax, un)
    assert absorption_tolerance(1e-2, un, un, un) == pytest.approx(1e-2 + model_steps.F64_SLACK, rel=1e-12)


def test_an_unknown_mla_path_is_a_typed_error(tiny_mla):
    from pipeline.runtime.model import AttentionStack

    st = AttentionStack(tiny_mla, dtype=torch.bfloat16, device="cpu", num_layers=1)
    with pytest.raises(BuildError) as e:
        model_steps.reference_forward_rounded(st, torch.zeros(2, st.hidden), mla_path="absorbd")
    assert e.value.info.code == "reference_input_invalid" and "absorbed" in e.value.info.allowed


def test_the_two_float64_paths_agree_without_the_absorbed_roundings(tiny_mla):
    """The absorption identity in float64: absorbed without r(q_abs), r(o_lat) equals un-absorbed to float64
    noise (far below F64_SLACK), and with them differs by bf16-sized amounts — the effect the derived
    tolerance allows."""
    from pipeline.runtime.model import AttentionStack
    from pipeline.runtime.reference import rel_err

    st = AttentionStack(tiny_mla, dtype=torch.bfloat16, device="cpu", num_layers=2, seed=3)
    x = torch.randn(24, st.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = lambda **kw: model_steps.reference_forward_rounded(st, x, **kw)[0] - x.double()  # noqa: E731
    un, ax, ar = ref(mla_path="unabsorbed"), ref(mla_path="absorbed", absorbed_rounding=False), ref(mla_path="absorbed")
    assert rel_err(ax, un) < 1e-12
    assert 1e-5 < rel_err(ar, un) < 5e-2


def test_run_reports_which_reference_judged_each_step(tmp_path):
    """``run --json``: every model step says its reference (two per step for MLA, ``rounded`` otherwise), the
    trace records it, and the human table gets a reference column only for an MLA stack."""
    from conftest import run_main
    from pipeline.core import events as ev
    from pipeline.core import wire

    cfg = tmp_path / "tiny-mla.json"
    cfg.write_text(json.dumps(TINY_MLA))
    log = tmp_path / "run.jsonl"
    p = run_main("run", "--device", "cpu", "--json", "--model", str(cfg), "--log-file", str(log), "--decode-steps", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    steps = json.loads(p.stdout)["model_steps"]
    assert [(s["step"], s["reference"]) for s in steps] == [
        (label, ref) for label in ("extend", "chunked-extend", "decode#0", "decode#1")
        for ref in (REF_MLA_ABSORBED, REF_MLA_UNABSORBED)]
    recs = [wire.decode_line(line) for line in log.read_bytes().splitlines()]
    assert [r.reference for r in recs if isinstance(r, ev.ModelStepVerified)] == [s["reference"] for s in steps]
    human = run_main("run", "--device", "cpu", "--model", str(cfg), "--log-file", str(log), "--decode-steps", "1")
    assert human.returncode == 0 and "reference" in human.stdout and "mla-unabsorbed" in human.stdout, human.stdout
    plain = run_main("run", "--device", "cpu", "--log-file", str(log), "--decode-steps", "1", "--json")
    assert {s["reference"] for s in json.loads(plain.stdout)["model_steps"]} == {"rounded"}
