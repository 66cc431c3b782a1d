"""Every input value gets a typed answer: property tests over config keys, contract fields, env vars.

Issue 14 §5: values of an unexpected type or size (a list where a string belongs, a 5000-digit
integer, a lone surrogate) must never reach a lookup, an allocator or the log encoder. Whatever
value hypothesis puts at a key ``load_model_spec`` reads, into a contract field, or into a size
environment variable, the outcome is a valid record or the typed error naming that key.
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CONFIGS, run_json
from pipeline.core import settings as attn_settings
from pipeline.core.contracts import AttentionArgs, ModelSpec, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError, ModelConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.core.validation import MAX_BYTES, check_device, matches

LLAMA = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
DEEPSEEK = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
GEMMA = json.loads((CONFIGS / "gemma-2-9b.json").read_text())

# Every key some reader of load_model_spec looks at (top level; rope blocks are covered below).
KEYS = ["model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
        "q_lora_rank", "query_pre_attn_scalar", "layer_types", "sliding_window", "attn_logit_softcapping",
        "torch_dtype", "dtype", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
        "is_encoder_decoder", "use_sliding_window", "max_window_layers", "sliding_window_pattern", "text_config"]

SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\udcff"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), SURROGATE,
                    st.builds(lambda: 10 ** 5000))  # a just() would repr it
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=8)


def _load(base: dict, key: str, value) -> None:
    cfg = dict(base)
    cfg[key] = value
    try:
        spec = load_model_spec(cfg)
    except ModelConfigError as e:
        assert e.exit_code == 3 and e.info.json_path and e.info.json_path.startswith("$"), e
        msgspec.json.encode(e.info)  # the ErrorInfo always encodes (no surrogate, no 5000-digit int)
        return
    assert isinstance(spec, ModelSpec)
    msgspec.json.encode(spec)  # what a run logs (run_started carries the request) encodes
    kinds = spec.layer_kinds()
    assert sum(len(k.layer_ids) for k in kinds) == spec.num_hidden_layers


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(KEYS), value=VALUES, base=st.sampled_from([LLAMA, DEEPSEEK, GEMMA]))
def test_any_value_at_any_config_key_is_read_or_refused_with_its_path(key, value, base):
    """load_model_spec either returns a spec that encodes and has per-layer kinds, or ModelConfigError with a JSON path."""
    _load(base, key, value)


@settings(max_examples=150, deadline=None)
@given(key=st.sampled_from(["factor", "mscale_all_dim", "rope_theta", "rope_type"]), value=VALUES)
def test_any_value_in_the_rope_block_is_read_or_refused(key, value):
    """Values inside rope_scaling (DeepSeek's YaRN mscale) get the same treatment as top-level keys."""
    _load(DEEPSEEK, "rope_scaling", {**DEEPSEEK["rope_scaling"], key: value})


def test_a_json_file_with_a_5000_digit_integer_in_an_unread_key_still_loads(tmp_path):
    """An integer literal too long for int() only matters where it is read (HF configs carry many keys)."""
    text = json.dumps(LLAMA)[:-1] + ', "some_future_key": ' + "7" * 5000 + "}"
    path = tmp_path / "config.json"
    path.write_text(text)
    assert load_model_spec(path).num_attention_heads == LLAMA["num_attention_heads"]


def test_file_name_with_undecodable_bytes_is_logged_with_escapes(tmp_path):
    """ModelSpec.source keeps the path readable and encodable when the name is not UTF-8."""
    import os

    raw = os.fsencode(str(tmp_path)) + b"/conf\xffig.json"
    with open(raw, "w") as fh:
        json.dump(LLAMA, fh)
    spec = load_model_spec(os.fsdecode(raw))
    assert spec.source.endswith("conf\\xffig.json")
    msgspec.json.encode(spec)


FIELD_VALUES = st.one_of(VALUES, st.lists(st.integers(min_value=-3, max_value=2 ** 70), max_size=3))


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(AttentionArgs.__struct_fields__), value=FIELD_VALUES)
def test_any_attention_args_field_value_is_accepted_typed_or_refused(field, value):
    """AttentionArgs(**{field: value}) from Python either holds a value of the field's type or raises ConfigError naming it."""
    try:
        a = AttentionArgs(**{field: value})
    except ConfigError as e:
        assert field in {f.name for f in e.info.flags}, e
        msgspec.json.encode(e.info)
        return
    hint = msgspec.structs.fields(AttentionArgs)
    tp = next(f.type for f in hint if f.name == field)
    assert matches(getattr(a, field), tp)
    assert msgspec.convert(msgspec.to_builtins(a), AttentionArgs) == a  # what a trace records decodes back


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["model", "draft_model", "args", "pool", "device", "rank", "world_size", "run_id",
                              "secrets", "is_draft_worker"]), value=FIELD_VALUES)
def test_any_setup_request_field_value_is_accepted_typed_or_refused(field, value, llama):
    """SetupRequest(**{field: value}) is built only from values of the right type; else ConfigError naming the field."""
    try:
        SetupRequest(**{"model": llama, field: value})
    except ConfigError as e:
        assert {field, "rank", "device", "draft_model"} & {f.name for f in e.info.flags}, e
        msgspec.json.encode(e.info)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=10), st.builds(lambda h, i: f"{h}:{i}", st.sampled_from(
    ["cuda", "cpu", "npu", "auto", "xpu"]), st.text(max_size=4))))
def test_device_strings_parse_or_are_refused(device):
    """Any device string either parses to (type, int index) or is refused naming device (never a ValueError)."""
    from pipeline.platforms import parse_device

    try:
        check_device(device)
    except ConfigError as e:
        assert e.info.flags[0].name == "device"
        with pytest.raises(ConfigError):
            parse_device(device)
        return
    head, index = parse_device(device)
    assert isinstance(index, int) and index >= 0 and device.startswith(head)


@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(st.integers(min_value=-(10 ** 40), max_value=10 ** 40).map(str), st.text(max_size=12)),
       field=st.sampled_from(["flashinfer_workspace_size", "zbal_local_mem_size"]))
def test_a_size_env_var_and_its_flag_get_one_answer(raw, field):
    """SGLANG_*=v is accepted exactly when the field with the same integer value is (one check for both sources)."""
    env = {attn_settings.ENV_VARS[field]: raw}
    try:
        attn_settings.check_env(env)
        env_ok = True
    except ConfigError as e:
        assert e.info.flags[0].name == attn_settings.ENV_VARS[field]
        env_ok = False
    text = raw.strip()
    try:  # an env var is ASCII digits (Python's int() also takes other scripts' digits, e.g. '੧')
        value = int(text) if text and text.isascii() else (None if not text else "not an int")
    except ValueError:
        value = "not an int"
    if value is None:  # unset or blank: the default applies
        assert env_ok
        return
    try:
        AttentionArgs(**{field: value})
        field_ok = True
    except ConfigError:
        field_ok = False
    assert env_ok == (field_ok and isinstance(value, int))
    if env_ok:
        assert 0 <= value <= MAX_BYTES


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["max_reqs", "max_context_len", "num_token_slots"]),
       value=st.one_of(st.integers(min_value=-5, max_value=2 ** 70), st.floats(), st.text(max_size=3)))
def test_pool_facts_sizes_fit_int32(field, value):
    """PoolFacts sizes are ints in [1, 2**31 - 1] (req_to_token holds int32 token locations) or refused."""
    try:
        p = PoolFacts(**{field: value, **({"page_size": 1} if field == "num_token_slots" else {})})
    except ConfigError as e:
        assert e.info.flags[0].name == f"pool.{field}"
        return
    assert isinstance(getattr(p, field), int) and 1 <= getattr(p, field) <= 2 ** 31 - 1
    assert not (isinstance(value, float) and not math.isfinite(value))


# ------------------------------------------------------------------------------------------------
# Pools larger than the memory there is: refused before allocation, with a remedy that then works
# ------------------------------------------------------------------------------------------------

GiB = 1 << 30


@settings(max_examples=200, deadline=None)
@given(avail=st.integers(min_value=64 << 20, max_value=200 * GiB),
       source=st.sampled_from(["slots", "bytes", "mem_fraction"]),
       scale=st.floats(min_value=1.01, max_value=1e6), ctx=st.sampled_from([64, 4096, 131072]),
       drop=st.floats(min_value=0, max_value=1))
def test_pool_exceeding_memory_names_the_flag_and_a_value_that_fits(llama, avail, source, scale, ctx, drop):
    """check_fits refuses pools above 90% of free memory; the value its remedy names then passes size_pools + check_fits,
    also when free memory has dropped by up to the remedy margin since (free memory moves between runs)."""
    import re

    from pipeline.memory.pools import POOL_MEMORY_SHARE, check_fits, kv_bytes_per_token, remedy_margin, size_pools

    kinds, limit = llama.layer_kinds(), int(avail * POOL_MEMORY_SHARE)
    per_tok = kv_bytes_per_token(kinds, 2, "bfloat16")
    common = dict(page_size=16, max_reqs=8, max_context_len=ctx)
    want = int(limit * scale)
    total = 2 * avail
    if source == "slots":
        s = size_pools(kinds, 2, "bfloat16", num_token_slots=min(max(want // per_tok, 32), 2 ** 31 - 16), **common)
    elif source == "bytes":
        s = size_pools(kinds, 2, "bfloat16", budget_bytes=want, **common)
    else:
        frac = min(want / total, 1.0)
        s = size_pools(kinds, 2, "bfloat16", budget_bytes=int(frac * total), source="mem_fraction",
                       mem_fraction=frac, **common)
    if s.req_to_token_bytes + s.kv_bytes <= limit:
        check_fits(s, avail, device="cpu", total_bytes=total)
        return
    with pytest.raises(ConfigError) as e:
        check_fits(s, avail, device="cpu", total_bytes=total,
                   mem_fraction=None if s.budget_bytes is None else s.budget_bytes / total)
    info = e.value.info
    assert info.code == "pool_exceeds_memory" and ("limit_bytes", limit) in [(f.name, f.value) for f in info.flags]
    flag, value = re.match(r"(?:lower|pass) (--[a-z-]+) (?:\(at most )?([0-9.]+)", info.remedy).groups()
    n = float(value) if "." in value else int(value)
    again = {"--num-token-slots": lambda: size_pools(kinds, 2, "bfloat16", num_token_slots=n, **common),
             "--mem-bytes": lambda: size_pools(kinds, 2, "bfloat16", budget_bytes=n, **common),
             "--mem-fraction": lambda: size_pools(kinds, 2, "bfloat16", budget_bytes=int(n * total),
                                                  source="mem_fraction", mem_fraction=n, **common)}[flag]()
    for now in (avail, avail - int(drop * remedy_margin(avail)), avail - remedy_margin(avail)):
        check_fits(again, now, device="cpu", total_bytes=total)


def test_runner_refuses_a_pool_beyond_the_platforms_memory_before_allocating(llama):
    """Runner.init_memory_pool checks the sized pools against the platform's free memory; nothing allocated."""
    from pipeline.core.contracts import DeviceFacts
    from pipeline.platforms.fake import FakePlatform
    from pipeline.runtime.runner import Runner, RunnerConfig

    small = DeviceFacts(type="cpu", name="tiny", total_memory_bytes=64 << 20)
    req = SetupRequest(model=llama, device="cpu", pool=PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=512))
    runner = Runner(RunnerConfig(request=req, num_layers=2, mem_fraction=0.99), platform=FakePlatform(small))
    with pytest.raises(ConfigError) as e:
        runner.initialize()
    assert e.value.info.code == "pool_exceeds_memory" and e.value.info.state == "init-memory-pool"
    assert runner.pools is None and "--mem-fraction 0.67" in e.value.info.remedy  # 0.9 of 48 MiB: a quarter kept as margin
    runner.close()


# -- 4. rope_theta in a documented range ------------------------------------------------------------------------
def _llama_with(**keys) -> dict:
    import json

    from conftest import ROOT

    return {**json.loads((ROOT / "examples/configs/llama-3.1-8b.json").read_text()), **keys}


@pytest.mark.parametrize("theta", [1e-300, 1e-40, 1e-20, 0.5, 1, 1.0000001e30, 1e300])
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_rope_theta_outside_its_range_is_refused_naming_the_key(theta, where):
    """The finding: 1e-300, 1e-40 and 1e-20 were accepted, then verification failed blaming the backend. Now a
    ModelConfigError at the key's JSON path, with the value, the range and the remedy."""
    from pipeline.core.errors import ModelConfigError
    from pipeline.core.model_spec import load_model_spec

    cfg = _llama_with(rope_theta=theta) if where == "top" else {
        **{k: v for k, v in _llama_with().items() if k not in ("rope_theta", "rope_scaling")},
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(cfg)
    info = e.value.info
    assert info.code == "model_config_invalid" and info.allowed == ["a number in (1, 1e+30]"]
    assert info.json_path == ("$.rope_theta" if where == "top" else "$.rope_parameters.rope_theta")
    assert [(f.name, f.value) for f in info.flags] == [("rope_theta", float(theta))]
    assert "must be in (1, 1e+30] (RoPE's base" in info.message and "config.json" in info.remedy


@pytest.mark.parametrize("theta", [1.0001, 100, 10000, 500000.0, 3580165449.0, 1e30])
def test_published_rope_thetas_are_accepted(theta):
    from pipeline.core.model_spec import load_model_spec

    assert load_model_spec(_llama_with(rope_theta=theta)).rope_theta == float(theta)


def test_run_refuses_a_rope_theta_of_1e_20_before_loading(tmp_path):
    """The CLI: exit 3 ``model_config_invalid`` in state args (it was ``verification_failed``, exit 1)."""
    import json

    model = tmp_path / "m.json"
    model.write_text(json.dumps(_llama_with(rope_theta=1e-20)))
    rc, out = run_json("run", "--model", str(model), "--log-file", str(tmp_path / "l.jsonl"))
    assert rc == 3 and out["error"]["code"] == "model_config_invalid" and out["error"]["state"] == "args", out
    assert out["error"]["json_path"] == "$.rope_theta"
