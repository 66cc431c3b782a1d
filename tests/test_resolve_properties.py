"""Property tests of resolve: never None, never replaces an explicit choice, auto records its path."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.backends import registry
from pipeline.core.contracts import AttentionArgs, Resolution
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.profiles import PROFILES
from states import resolve

CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.json"))
NAMES = [None, None, *registry.names(), "trtllm_mha"]
PACKAGES = ("torch", "triton", "flashinfer-python")


@lru_cache(maxsize=None)
def _model(name: str):
    return load_model_spec(Path(__file__).resolve().parents[1] / "examples" / "configs" / f"{name}.json")


@st.composite
def requests(draw):
    args = AttentionArgs(
        attention_backend=draw(st.sampled_from(NAMES)),
        prefill_attention_backend=draw(st.sampled_from(NAMES)),
        decode_attention_backend=draw(st.sampled_from(NAMES)),
        speculative_draft_attention_backend=draw(st.sampled_from(NAMES)),
        speculative_algorithm=draw(st.sampled_from([None, "EAGLE"])),
        enable_pdmux=draw(st.booleans()), enable_two_batch_overlap=draw(st.booleans()),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8_e4m3", "float16"])),
        dtype=draw(st.sampled_from(["auto", "bfloat16", "float32"])),
        disable_cuda_graph=draw(st.booleans()))
    return dict(args=args, model=_model(draw(st.sampled_from(CONFIGS))),
                device=PROFILES[draw(st.sampled_from(sorted(PROFILES)))],
                is_draft_worker=draw(st.booleans()),
                installed={p: draw(st.booleans()) for p in PACKAGES})


def _expected_explicit(args: AttentionArgs, half: str, draft: bool):
    """Independent restatement of the precedence: draft override > phase flag > global flag > auto."""
    if draft and args.speculative_draft_attention_backend:
        return "draft_override", args.speculative_draft_attention_backend, "speculative_draft_attention_backend"
    phase = getattr(args, f"{half}_attention_backend")
    if phase:
        return "phase_flag", phase, f"{half}_attention_backend"
    if args.attention_backend:
        return "global_flag", args.attention_backend, "attention_backend"
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_resolve_never_none_and_never_replaces_an_explicit_choice(req):
    """Resolve returns a full pair or raises a typed ConfigError; explicit halves are kept or refused."""
    try:
        res = resolve.decide(req["args"], req["model"], req["device"], is_draft_worker=req["is_draft_worker"],
                             installed=req["installed"])
    except ConfigError as e:
        assert e.exit_code == 3 and e.info.message and e.info.remedy and e.info.state == "resolve"
        return
    assert isinstance(res, Resolution)
    picks = {"prefill": res.pair.prefill, "decode": res.pair.decode}
    for half in ("prefill", "decode"):
        assert isinstance(picks[half], str) and picks[half]
        exp = _expected_explicit(req["args"], half, req["is_draft_worker"])
        if exp is None:
            assert res.rules[half] == "auto"
            cands = resolve.auto_candidates(req["device"], req["model"])
            tried = [r.backend for r in res.rejected.get(half, [])]
            assert tried == cands[: cands.index(picks[half])]
            assert all(r.reasons for r in res.rejected.get(half, []))
        else:
            assert (res.rules[half], picks[half]) == exp[:2]
            assert half not in res.rejected
    assert res.pair.is_draft_override == (res.rules["prefill"] == "draft_override")


@settings(max_examples=150, deadline=None)
@given(requests())
def test_refusal_of_an_explicit_choice_names_its_flag(req):
    """When an explicit half is refused, the error carries that half's flag and value."""
    args, draft = req["args"], req["is_draft_worker"]
    try:
        resolve.decide(args, req["model"], req["device"], is_draft_worker=draft, installed=req["installed"])
    except ConfigError as e:
        flags = {(f.name, f.value) for f in e.info.flags}
        if e.info.code == "conflicting_options" or any(f.name == "enable_pdmux" for f in e.info.flags):
            return  # mode refusals come before any backend is looked at
        exp = [_expected_explicit(args, h, draft) for h in ("prefill", "decode")]
        named = [(flag, name) for x in exp if x for _, name, flag in [x]]
        auto_halves = [h for h, x in zip(("prefill", "decode"), exp) if x is None]
        assert any(n in flags for n in named) or any((f"{h}_attention_backend", None) in flags for h in auto_halves)
