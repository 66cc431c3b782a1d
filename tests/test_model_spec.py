"""ModelSpec from Hugging Face config.json: the bundled real configs and the error paths.

The EXPECTED table below was written by hand from the model cards / papers (Llama 3 herd paper,
Qwen2.5 and Qwen3 model cards, Mistral 7B paper, Gemma 2 report, DeepSeek-V2 paper, gpt-oss
model card; Qwen3-Next, Llama-4-Scout and Gemma-3 model cards with the HF configuration classes'
defaults), not by running the loader.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import subprocess
import sys

import msgspec
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.contracts import ModelSpec
from pipeline.core.errors import EXIT_REFUSED, EXIT_USAGE, ConfigError, ModelConfigError, UsageError
from pipeline.core.model_spec import (
    DEFAULT_MODEL_CONFIG, attention_prefix, format_layer_ids, layer_kinds, layers_covering_every_kind,
    load_model_spec,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"

# DeepSeek-V2-Lite: softmax scale 1/sqrt(128 + 64), times the YaRN mscale squared with
# mscale_all_dim = 0.707 and factor 40 (DeepSeek-V2 paper, appendix on YaRN).
_DSV2_MSCALE = 1.0 + 0.1 * 0.707 * math.log(40.0)
_EVEN = lambda n: [i for i in range(n) if i % 2 == 0]  # noqa: E731
_EVERY = lambda n, k: [i for i in range(n) if (i + 1) % k == 0]  # noqa: E731  layers 3, 7, … for k = 4
_NOT_EVERY = lambda n, k: [i for i in range(n) if (i + 1) % k]  # noqa: E731

EXPECTED = {
    # file: (model_type, layers, heads, kv_heads, head_dim, v_dim, scale, sliding ids, window,
    #        softcap, sinks, mla (kv_lora, rope, nope, v, q_lora) or None, dtype, vocab, max_pos, theta)
    "llama-3.1-8b.json": ("llama", 32, 32, 8, 128, 128, 1 / math.sqrt(128), [], None,
                          None, False, None, "bfloat16", 128256, 131072, 500000.0),
    "qwen2.5-7b.json": ("qwen2", 28, 28, 4, 128, 128, 1 / math.sqrt(128), [], None,
                        None, False, None, "bfloat16", 152064, 131072, 1e6),
    "mistral-7b-v0.1.json": ("mistral", 32, 32, 8, 128, 128, 1 / math.sqrt(128), list(range(32)), 4096,
                             None, False, None, "bfloat16", 32000, 32768, 10000.0),
    "gemma-2-9b.json": ("gemma2", 42, 16, 8, 256, 256, 1 / 16, _EVEN(42), 4096,
                        50.0, False, None, "float32", 256000, 8192, 10000.0),
    "qwen3-8b.json": ("qwen3", 36, 32, 8, 128, 128, 1 / math.sqrt(128), [], None,
                      None, False, None, "bfloat16", 151936, 40960, 1e6),
    "deepseek-v2-lite.json": ("deepseek_v2", 27, 16, 16, 192, 128, _DSV2_MSCALE**2 / math.sqrt(192), [], None,
                              None, False, (512, 64, 128, 128, None), "bfloat16", 102400, 163840, 10000.0),
    # V3: YaRN factor 40 with mscale_all_dim 1.0 -> m = 0.1 ln 40 + 1; (128 + 64) ** -0.5 * m * m
    "deepseek-v3.json": ("deepseek_v3", 61, 128, 128, 192, 128, (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), [],
                         None, None, False, (512, 64, 128, 128, 1536), "bfloat16", 129280, 163840, 10000.0),
    "gpt-oss-20b.json": ("gpt_oss", 24, 64, 8, 64, 64, 1 / 8, _EVEN(24), 128,
                         None, True, None, "float32", 201088, 131072, 150000.0),  # no torch_dtype: sglang's float32
    # 48 layers: 3 Gated DeltaNet then 1 gated full attention, x12; 16 q / 2 kv heads of 256 (model card)
    "qwen3-next-80b-a3b-instruct.json": ("qwen3_next", 48, 16, 2, 256, 256, 1 / 16, [], None,
                                         None, False, None, "bfloat16", 151936, 262144, 1e7),
    # text_config: 48 layers, 40 q / 8 kv heads of 128, chunked (8192) except every 4th layer (NoPE, global)
    "llama-4-scout-17b-16e-instruct.json": ("llama4_text", 48, 40, 8, 128, 128, 1 / math.sqrt(128), [], None,
                                            None, False, None, "bfloat16", 202048, 10485760, 500000.0),
    # sparse text_config: head_dim 256 and query_pre_attn_scalar 256 are Gemma3TextConfig defaults (3840 / 16
    # would give 240); 5 local (window 1024) : 1 global; vocab / positions / theta are class defaults too
    "gemma-3-12b-it.json": ("gemma3_text", 48, 16, 8, 256, 256, 1 / 16, _NOT_EVERY(48, 6), 1024,
                            None, False, None, "bfloat16", 262208, 131072, 1e6),
}


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_config_fields(name):
    """Each bundled config reads to the hand-written table's values."""
    (mt, layers, heads, kv, hd, vd, scale, sliding, window, cap, sinks, mla, dtype, vocab, max_pos,
     theta) = EXPECTED[name]
    s = load_model_spec(CONFIGS / name)
    assert (s.model_type, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads) == (mt, layers, heads, kv)
    assert (s.head_dim, s.v_head_dim) == (hd, vd)
    assert abs(s.scaling - scale) / scale < 1e-12
    assert [i for i, t in enumerate(s.layer_types) if t == "sliding"] == sliding
    assert len(s.layer_types) == layers and s.sliding_window == window
    assert s.logit_softcap == cap and s.has_attention_sinks is sinks
    got_mla = None if s.mla is None else (s.mla.kv_lora_rank, s.mla.qk_rope_head_dim, s.mla.qk_nope_head_dim,
                                          s.mla.v_head_dim, s.mla.q_lora_rank)
    assert got_mla == mla
    assert (s.dtype, s.vocab_size, s.max_position_embeddings, s.rope_theta) == (dtype, vocab, max_pos, theta)
    assert s.is_encoder_decoder is False and s.source == str(CONFIGS / name)


# file -> [(kind, num_kv_heads, head_dim_qk, head_dim_v, window, is_mla, number of layers)]
EXPECTED_KINDS = {
    "llama-3.1-8b.json": [("full", 8, 128, 128, None, False, 32)],
    "qwen2.5-7b.json": [("full", 4, 128, 128, None, False, 28)],
    "mistral-7b-v0.1.json": [("sliding", 8, 128, 128, 4096, False, 32)],
    "gemma-2-9b.json": [("sliding", 8, 256, 256, 4096, False, 21), ("full", 8, 256, 256, None, False, 21)],
    "qwen3-8b.json": [("full", 8, 128, 128, None, False, 36)],
    "deepseek-v2-lite.json": [("full", 1, 576, 512, None, True, 27)],
    "deepseek-v3.json": [("full", 1, 576, 512, None, True, 61)],
    "gpt-oss-20b.json": [("sliding", 8, 64, 64, 128, False, 12), ("full", 8, 64, 64, None, False, 12)],
    "qwen3-next-80b-a3b-instruct.json": [("full", 2, 256, 256, None, False, 12)],
    "llama-4-scout-17b-16e-instruct.json": [("chunked", 8, 128, 128, None, False, 36),
                                            ("full", 8, 128, 128, None, False, 12)],
    "gemma-3-12b-it.json": [("sliding", 8, 256, 256, 1024, False, 40), ("full", 8, 256, 256, None, False, 8)],
}
# file -> (attention_chunk_size of the chunked kind, [(not-attention kind, ids)])
EXPECTED_OTHER = {
    "qwen3-next-80b-a3b-instruct.json": (None, [("linear_attention", _NOT_EVERY(48, 4))]),
    "llama-4-scout-17b-16e-instruct.json": (8192, []),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_layer_kinds_counts(name):
    """layer_kinds groups layers by kind (MLA in absorbed form); with the not-attention groups they cover
    every layer once; chunked kinds carry the chunk, the others none."""
    s = load_model_spec(CONFIGS / name)
    kinds = s.layer_kinds()
    got = [(k.kind, k.num_kv_heads, k.head_dim_qk, k.head_dim_v, k.sliding_window, k.is_mla, len(k.layer_ids))
           for k in kinds]
    assert got == EXPECTED_KINDS[name]
    chunk, others = EXPECTED_OTHER.get(name, (None, []))
    assert [(g.kind, g.layer_ids) for g in s.not_attention()] == others
    assert [k.attention_chunk_size for k in kinds] == [chunk if k.kind == "chunked" else None for k in kinds]
    assert s.attention_chunk_size == chunk
    ids = [i for k in kinds for i in k.layer_ids] + [i for g in s.not_attention() for i in g.layer_ids]
    assert sorted(ids) == list(range(s.num_hidden_layers))
    assert all(k.num_heads == EXPECTED[name][2] and k.has_sinks == EXPECTED[name][10] for k in kinds)
    assert all(k.logit_softcap == EXPECTED[name][9] and k.scaling == s.scaling for k in kinds)


def test_bundled_default_is_byte_identical_copy():
    """The package's default config is the example Llama-3.1-8B file, byte for byte."""
    assert DEFAULT_MODEL_CONFIG.read_bytes() == (CONFIGS / "llama-3.1-8b.json").read_bytes()
    assert load_model_spec(DEFAULT_MODEL_CONFIG).num_key_value_heads == 8


def test_every_example_config_is_in_the_table():
    """No example config ships without a row in the hand-written table."""
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(EXPECTED)


def test_spec_round_trips_through_msgspec():
    """A loaded spec encodes to JSON and decodes back to an equal frozen Struct."""
    s = load_model_spec(CONFIGS / "deepseek-v2-lite.json", source="deepseek-ai/DeepSeek-V2-Lite")
    assert s.source == "deepseek-ai/DeepSeek-V2-Lite"
    assert msgspec.json.decode(msgspec.json.encode(s), type=ModelSpec) == s


# ------------------------------------------------------------------------------------------
# The implicit rules
# ------------------------------------------------------------------------------------------


def test_qwen2_sliding_starts_at_max_window_layers():
    """Qwen2 with use_sliding_window: layers >= max_window_layers slide, earlier ones are full."""
    c = _cfg("qwen2.5-7b.json") | {"use_sliding_window": True, "max_window_layers": 20, "sliding_window": 32768}
    s = load_model_spec(c)
    assert [i for i, t in enumerate(s.layer_types) if t == "sliding"] == list(range(20, 28))
    assert s.sliding_window == 32768 and s.source == "dict"


def test_explicit_layer_types_win_over_rules():
    """An explicit layer_types list overrides Gemma-2's alternating rule."""
    c = _cfg("gemma-2-9b.json") | {"layer_types": ["full_attention"] * 41 + ["sliding_attention"]}
    s = load_model_spec(c)
    assert s.layer_types == ["full"] * 41 + ["sliding"] and s.sliding_window == 4096


def test_gpt_oss_without_layer_types_alternates_and_keeps_sinks():
    """gpt-oss falls back to sliding-first alternation; sinks stay on."""
    c = _cfg("gpt-oss-20b.json")
    del c["layer_types"]
    s = load_model_spec(c)
    assert s.layer_types == ["sliding", "full"] * 12 and s.has_attention_sinks


def test_text_config_nesting_and_defaults():
    """A multimodal wrapper is read through text_config; kv heads default to heads; extras ignored."""
    inner = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
             "rope_parameters": {"rope_theta": 250000.0, "rope_type": "default"}, "some_new_key": [1, 2]}
    s = load_model_spec({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                         "dtype": "float16", "text_config": inner})
    assert (s.model_type, s.num_key_value_heads, s.head_dim, s.scaling) == ("llama", 8, 128, 128**-0.5)
    assert (s.rope_theta, s.dtype, s.architectures) == (250000.0, "float16", ["LlavaForConditionalGeneration"])


def test_query_pre_attn_scalar_sets_scale():
    """Gemma-2-27B style: query_pre_attn_scalar=144 (not head_dim=128) gives scale 1/12."""
    c = _cfg("gemma-2-9b.json") | {"head_dim": 128, "query_pre_attn_scalar": 144}
    assert abs(load_model_spec(c).scaling - 1 / 12) < 1e-15


def test_mla_without_rope_scaling_has_plain_scale():
    """Without YaRN mscale the MLA scale is 1/sqrt(qk_nope + qk_rope)."""
    c = _cfg("deepseek-v2-lite.json")
    c["rope_scaling"] = None
    assert load_model_spec(c).scaling == 192**-0.5


def test_own_rules_cite_every_entry():
    """Each family rule kept beside transformers carries a citation of the code it mirrors."""
    from pipeline.core.layer_rules import OWN_FAMILIES

    assert {"baichuan", "internlm2", "mimo", "nemotron-nas"} <= set(OWN_FAMILIES)
    assert all(r.cite for r in OWN_FAMILIES.values())


def test_module_does_not_import_torch():
    """pipeline.core.model_spec imports without torch."""
    code = "import sys, pipeline.core.model_spec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------

_LLAMA = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())


def _with(**changes) -> dict:
    c = copy.deepcopy(_LLAMA)
    for k, v in changes.items():
        if v is ...:
            del c[k]
        else:
            c[k] = v
    return c


BAD_DICTS = [
    # (id, config, json_path, flag name, flag value)
    ("missing_model_type", _with(model_type=...), "$.model_type", "model_type", None),
    ("layers_as_string", _with(num_hidden_layers="32"), "$.num_hidden_layers", "num_hidden_layers", "32"),
    ("kv_heads_bool", _with(num_key_value_heads=True), "$.num_key_value_heads", "num_key_value_heads", True),
    ("zero_layers", _with(num_hidden_layers=0), "$.num_hidden_layers", "num_hidden_layers", 0),
    ("negative_head_dim", _with(head_dim=-128), "$.head_dim", "head_dim", -128),
    ("heads_not_divisible", _with(num_key_value_heads=5), "$.num_key_value_heads", "num_key_value_heads", 5),
    ("hidden_not_divisible", _with(hidden_size=4100), "$.hidden_size", "hidden_size", 4100),
    ("negative_softcap", _with(attn_logit_softcapping=-50.0), "$.attn_logit_softcapping",
     "attn_logit_softcapping", -50.0),
    ("bad_dtype", _with(torch_dtype="int8"), "$.torch_dtype", "torch_dtype", "int8"),
    ("layer_types_short", _with(layer_types=["full_attention"] * 3), "$.layer_types", "layer_types",
     ["full_attention"] * 3),
    ("layer_type_not_string", _with(layer_types=["full_attention"] * 31 + [1]), "$.layer_types[31]",
     "layer_types[31]", 1),
    ("attn_offset_not_below_period", _with(model_type="jamba", attn_layer_period=4, attn_layer_offset=4),
     "$.attn_layer_offset", "attn_layer_offset", 4),
    ("full_attention_interval_zero", _with(model_type="qwen3_next", full_attention_interval=0),
     "$.full_attention_interval", "full_attention_interval", 0),
    ("attn_type_list_bad", _with(attn_type_list=[1] * 31 + [2]), "$.attn_type_list", "attn_type_list",
     [1] * 31 + [2]),
    ("no_rope_layers_short", {"model_type": "llama4", "text_config": _with(model_type="llama4_text",
                                                                          no_rope_layers=[1, 0])},
     "$.text_config.no_rope_layers", "no_rope_layers", [1, 0]),
    ("chunk_size_zero", {"model_type": "llama4", "text_config": _with(model_type="llama4_text",
                                                                     attention_chunk_size=0)},
     "$.text_config.attention_chunk_size", "attention_chunk_size", 0),
    ("text_config_not_object", {"model_type": "llava", "text_config": [1]}, "$.text_config", "text_config", [1]),
    ("nan_rope_theta", _with(rope_theta=float("nan")), "$.rope_theta", "rope_theta", None),
]


@pytest.mark.parametrize("case", BAD_DICTS, ids=[c[0] for c in BAD_DICTS])
def test_bad_config_raises_typed_error(case):
    """Each bad config raises ModelConfigError naming the JSON path, the key and its value."""
    _, cfg, path, flag, value = case
    with pytest.raises(ModelConfigError) as ei:
        load_model_spec(cfg)
    info = ei.value.info
    assert info.json_path == path and ei.value.exit_code == EXIT_REFUSED
    assert info.flags[0].name == flag
    if flag == "rope_theta":  # NaN is never equal to itself; check it is reported as NaN
        assert math.isnan(info.flags[0].value)
    else:
        assert info.flags[0].value == value
    assert info.allowed and info.remedy
    assert info.code == ("unknown_architecture" if path == "$.model_type" else "model_config_invalid")


@pytest.mark.parametrize("text, line", [
    ('{"model_type": "llama", "hidden_size": 4096,\n}', 2),            # trailing comma
    ((CONFIGS / "llama-3.1-8b.json").read_text()[:300], None),        # truncated file
    ("", 1),                                                          # empty file
])
def test_malformed_json_file(tmp_path, text, line):
    """Malformed or truncated JSON raises ModelConfigError at $ naming the file and line."""
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(ModelConfigError) as ei:
        load_model_spec(p)
    info = ei.value.info
    assert info.json_path == "$" and info.code == "model_config_malformed"
    flags = {f.name: f.value for f in info.flags}
    assert flags["path"] == str(p)
    assert flags["line"] == (line if line is not None else text.count("\n") + 1)


def test_top_level_must_be_object(tmp_path):
    """A JSON list at the top level is refused at $."""
    p = tmp_path / "config.json"
    p.write_text("[1, 2]")
    with pytest.raises(ModelConfigError) as ei:
        load_model_spec(p)
    assert ei.value.info.json_path == "$" and ei.value.info.flags[0].value == "list"


@pytest.mark.parametrize("kind,code", [("missing", "config_unreadable"), ("directory", "not_a_regular_file")])
def test_unreadable_path_is_usage_error(tmp_path, kind, code):
    """An unreadable path (or one that is not a regular file) raises UsageError (exit code 2) naming the path."""
    p = tmp_path / "nope.json" if kind == "missing" else tmp_path
    with pytest.raises(UsageError) as ei:
        load_model_spec(str(p))
    assert ei.value.exit_code == EXIT_USAGE and ei.value.info.code == code
    assert ei.value.info.flags[0].name == "path" and ei.value.info.flags[0].value == str(p)


def test_layer_kinds_rejects_inconsistent_spec():
    """layer_kinds refuses a hand-built spec whose layer_types do not match the layer count."""
    s = msgspec.structs.replace(load_model_spec(CONFIGS / "llama-3.1-8b.json"), layer_types=["full"])
    with pytest.raises(ModelConfigError) as ei:
        layer_kinds(s)
    assert ei.value.info.json_path == "$.layer_types" and ei.value.info.flags[0].value == 1


# ------------------------------------------------------------------------------------------
# Layers that are not softmax attention over the whole context
# ------------------------------------------------------------------------------------------
_QWEN3_NEXT = _cfg("qwen3-next-80b-a3b-instruct.json")
_SCOUT = _cfg("llama-4-scout-17b-16e-instruct.json")
_GEMMA3 = _cfg("gemma-3-12b-it.json")


def test_qwen3_next_interval_and_explicit_layer_types_agree():
    """full_attention_interval 4 (the published file has no layer_types) and the explicit list HF would write
    read to the same types; interval 2 and the HF default (4) when the key is absent."""
    explicit = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    a = load_model_spec(_QWEN3_NEXT)
    b = load_model_spec(_QWEN3_NEXT | {"layer_types": explicit})
    assert a.layer_types == b.layer_types == ["full" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    two = load_model_spec(_QWEN3_NEXT | {"full_attention_interval": 2})
    assert [i for i, t in enumerate(two.layer_types) if t == "full"] == list(range(1, 48, 2))
    default = {k: v for k, v in _QWEN3_NEXT.items() if k != "full_attention_interval"}
    assert load_model_spec(default).layer_types == a.layer_types


def test_linear_attention_in_layer_types_of_any_model_type_is_read_not_refused():
    """A config listing linear_attention (e.g. a Qwen3.5 text config) is valid: those layers are not attention."""
    c = _with(model_type="qwen3_5_text", layer_types=["linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention"] * 8)
    s = load_model_spec(c)
    assert [k.layer_ids for k in s.layer_kinds()] == [list(range(2, 32, 4))]
    assert [(g.kind, len(g.layer_ids)) for g in s.not_attention()] == [("linear_attention", 24)]


def test_class_defaults_and_refused_layer_types():
    """What a file leaves out is transformers' class default (LlamaConfig's 32 heads, DeepseekV2Config's
    qk_rope_head_dim 64), as the model's own code reads it; a layer type attn-setup does not compute is refused
    naming it (``unsupported_attention_feature``); chunked layers without a chunk size are causal (full)."""
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.llama.configuration_llama import LlamaConfig

    assert load_model_spec(_with(num_attention_heads=...)).num_attention_heads == LlamaConfig().num_attention_heads
    mla = {k: v for k, v in _cfg("deepseek-v2-lite.json").items() if k != "qk_rope_head_dim"}
    assert load_model_spec(mla).mla.qk_rope_head_dim == DeepseekV2Config().qk_rope_head_dim
    for key, names in (("layer_types", ["full_attention"] * 31 + ["indexed_attention"]),
                       ("layers_block_type", ["attention"] * 31 + ["hybrid"])):
        with pytest.raises(ModelConfigError) as e:
            load_model_spec(_with(model_type="jamba" if key == "layers_block_type" else "llama", **{key: names}))
        assert e.value.info.code in ("unsupported_attention_feature", "model_config_malformed"), e.value.info
    for mt in ("some_new_hybrid", "other"):
        with pytest.raises(ModelConfigError) as e:
            load_model_spec(_with(model_type=mt, full_attention_interval=4, attn_layer_period=2))
        assert e.value.info.code == "unknown_architecture"


def test_minimax_attn_type_list():
    """attn_type_list: 1 = softmax attention, 0 = linear (lightning) attention."""
    s = load_model_spec(_with(model_type="minimax", attn_type_list=[0] * 7 + [1] + [0] * 7 + [1] + [1] * 16))
    assert [i for i, t in enumerate(s.layer_types) if t == "linear_attention"] == list(range(7)) + list(range(8, 15))


def test_llama4_chunked_layers_from_no_rope_layers_and_defaults():
    """Scout: no_rope_layers 1 = chunked (RoPE), 0 = full (NoPE); absent no_rope_layers → HF's interval 4;
    absent attention_chunk_size → 8192 (HF default); null → nothing chunked; explicit layer_types win."""
    s = load_model_spec(_SCOUT)
    assert s.layer_types == ["full" if (i + 1) % 4 == 0 else "chunked" for i in range(48)]
    tc = dict(_SCOUT["text_config"])
    del tc["no_rope_layers"], tc["attention_chunk_size"]
    d = load_model_spec(_SCOUT | {"text_config": tc | {"no_rope_layer_interval": 3}})
    assert d.layer_types == ["full" if (i + 1) % 3 == 0 else "chunked" for i in range(48)]
    assert d.attention_chunk_size == 8192
    off = load_model_spec(_SCOUT | {"text_config": dict(_SCOUT["text_config"], attention_chunk_size=None)})
    assert off.layer_types == ["full"] * 48 and off.attention_chunk_size is None
    # MobileLLM-R1 style: layer_types all full_attention win over no_rope_layers all 1
    mob = load_model_spec(_SCOUT | {"text_config": dict(_SCOUT["text_config"], layer_types=["full_attention"] * 48)})
    assert mob.layer_types == ["full"] * 48 and mob.attention_chunk_size is None


def test_gemma3_sparse_text_config_takes_class_defaults():
    """Gemma-3's published text_config leaves head_dim / query_pre_attn_scalar out: 256 each (HF defaults),
    not hidden/heads = 240; a text_config without model_type is read through the gemma3 wrapper's type."""
    s = load_model_spec(_GEMMA3)
    assert (s.head_dim, s.scaling, s.sliding_window) == (256, 1 / 16, 1024)
    tc = {k: v for k, v in _GEMMA3["text_config"].items() if k != "model_type"}
    w = load_model_spec(_GEMMA3 | {"text_config": tc})
    assert (w.model_type, w.layer_types, w.head_dim) == ("gemma3", s.layer_types, 256)
    p4 = load_model_spec(_GEMMA3 | {"text_config": dict(_GEMMA3["text_config"], sliding_window_pattern=4)})
    assert [i for i, t in enumerate(p4.layer_types) if t == "full"] == _EVERY(48, 4)


def test_attention_prefix_and_default_layer_count():
    """--num-layers N counts attention layers: N=2 of Qwen3-Next spans 8 layers; the default covers every kind."""
    names = ("qwen3-next-80b-a3b-instruct.json", "llama-4-scout-17b-16e-instruct.json", "gemma-3-12b-it.json")
    q, scout, g3 = (load_model_spec(CONFIGS / n) for n in names)
    assert (attention_prefix(q, 1), attention_prefix(q, 2), attention_prefix(q, 12)) == (4, 8, 48)
    llama = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    assert attention_prefix(llama, 2) == 2 and layers_covering_every_kind(llama) == 2
    assert [layers_covering_every_kind(m) for m in (q, scout, g3)] == [2, 4, 6]
    with pytest.raises(ConfigError) as ei:
        attention_prefix(q, 13)
    assert ei.value.info.flags[0].name == "num_layers" and ei.value.info.allowed == ["1..12"]


def test_format_layer_ids_is_exact():
    """Runs, progressions and short lists: every id can be read back."""
    assert format_layer_ids([4]) == "4"
    assert format_layer_ids(list(range(32))) == "0..31 (32)"
    assert format_layer_ids(_EVERY(48, 4)) == "3, 7, .., 47 (12, every 4th)"
    assert format_layer_ids(_EVEN(42)) == "0, 2, .., 40 (21, every 2nd)"
    assert format_layer_ids([0, 1, 2, 4, 5, 9]) == "0..2, 4..5, 9 (6)"


_TYPE_NAMES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
               "attention": "full", "linear_attention": "linear_attention",
               "mamba": "linear_attention"}  # transformers 5 spells mamba layers linear_attention


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(sorted(_TYPE_NAMES)), min_size=1, max_size=40), st.sampled_from(["llama", "mistral"]))
def test_any_layer_type_list_reads_to_a_partition(names, model_type):
    """Any per-layer list: each name maps to its type; attention kinds and not-attention groups partition the
    layers in first-layer order; windows / chunks sit only on their kinds."""
    c = _with(model_type=model_type, num_hidden_layers=len(names), layer_types=names, sliding_window=5,
              attention_chunk_size=6)
    try:
        s = load_model_spec(c)
    except ModelConfigError as e:  # transformers' own class refuses a layer type its model does not build
        assert e.value.info.code == "model_config_malformed" if hasattr(e, "value") else e.info.code == \
            "model_config_malformed"
        return
    assert s.layer_types == [_TYPE_NAMES[n] for n in names]
    kinds, others = s.layer_kinds(), s.not_attention()
    ids = sorted([i for k in kinds for i in k.layer_ids] + [i for g in others for i in g.layer_ids])
    assert ids == list(range(len(names)))
    for k in kinds:
        assert all(s.layer_types[i] == k.kind for i in k.layer_ids)
        assert k.sliding_window == (5 if k.kind == "sliding" else None)
        assert k.attention_chunk_size == (6 if k.kind == "chunked" else None)
    firsts = [k.layer_ids[0] for k in kinds]
    assert firsts == sorted(firsts)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 9))
def test_qwen3_next_interval_property(n, interval):
    """Any layer count and interval: full iff (i + 1) % interval == 0, the rest linear attention."""
    s = load_model_spec(_QWEN3_NEXT | {"num_hidden_layers": n, "full_attention_interval": interval})
    full = [i for i in range(n) if (i + 1) % interval == 0]
    assert [i for i, t in enumerate(s.layer_types) if t == "full"] == full
    assert [i for g in s.not_attention() for i in g.layer_ids] == [i for i in range(n) if i not in full]
    assert [i for k in s.layer_kinds() for i in k.layer_ids] == full


@settings(max_examples=300, deadline=None)
@given(hidden=st.integers(1, 1 << 14), heads=st.integers(1, 128), nested=st.booleans())
def test_computed_head_dim_names_the_keys_it_came_from(hidden, heads, nested):
    """Without ``head_dim``, the head dim is ``hidden_size / num_attention_heads``: an even integer is taken, anything
    else is refused naming those two keys (JSON path ``hidden_size``'s, inside ``text_config`` when nested) and the
    quotient — never the absent ``head_dim`` key (4000 / 32 said "$.head_dim must be even"); a quotient above
    the largest head dim accepted (1024) is refused as an explicit one is."""
    cfg = _cfg("llama-3.1-8b.json")
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=1)
    if nested:
        cfg = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": cfg}
    q, r = divmod(hidden, heads)
    if r == 0 and q % 2 == 0 and q <= 1024:
        assert load_model_spec(cfg).head_dim == q
        return
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(cfg)
    info = e.value.info
    prefix = "$.text_config" if nested else "$"
    assert info.json_path == f"{prefix}.hidden_size" and "head_dim" not in info.json_path
    assert [(f.name, f.value) for f in info.flags] == [("hidden_size", hidden), ("num_attention_heads", heads)]
    assert f"{hidden} / {heads} = {hidden / heads:g}" in info.message and "no head_dim" in info.message
    fixed = copy.deepcopy(cfg)  # the remedy: add the model's head_dim
    head_dim = min(1024, 2 * max(1, q // 2))
    (fixed["text_config"] if nested else fixed)["head_dim"] = head_dim
    if r == 0:  # transformers' classes refuse a hidden_size that is no multiple of the heads whatever head_dim says
        assert load_model_spec(fixed).head_dim == head_dim


def test_an_unknown_model_type_is_refused_naming_its_attention_fields():
    """A model_type neither transformers nor our rules know is refused (``unknown_architecture``, exit 3) naming the
    model_type and the attention-relevant fields present; it was read as all-full ("foobar") with a warning."""
    base = {**_cfg("llama-3.1-8b.json"), "model_type": "foobar", "num_hidden_layers": 4, "sliding_window": 128}
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(base)
    info = e.value.info
    assert info.code == "unknown_architecture" and e.value.exit_code == 3
    assert ("model_type", "foobar") in [(f.name, f.value) for f in info.flags]
    assert "sliding_window" in info.message and "config.json" not in info.remedy
    with pytest.raises(ModelConfigError, match="foobar"):
        load_model_spec({"model_type": "llava", "text_config": {**base, "model_type": "foobar"}})
    assert load_model_spec({**base, "model_type": "mistral"}).layer_types == ["sliding"] * 4


@pytest.mark.parametrize("version", ["4.57.6", "6.0.0", None])
def test_transformers_outside_the_supported_range_is_refused(monkeypatch, version):
    """The configuration classes of a transformers outside TRANSFORMERS_SPEC (or none) are not read: the model is
    refused ``package_version_unsupported`` (exit 3) with the pip command that installs a supported one."""
    from packaging.specifiers import SpecifierSet

    from pipeline.core import hf_config

    assert "5.19.0" in SpecifierSet(hf_config.TRANSFORMERS_SPEC)
    monkeypatch.setattr(hf_config, "transformers_version", lambda: version)
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(_cfg("llama-3.1-8b.json"))
    info = e.value.info
    assert info.code == "package_version_unsupported" and e.value.exit_code == EXIT_REFUSED
    assert info.flags[0].value == version and f"transformers{hf_config.TRANSFORMERS_SPEC}" in info.remedy


def test_plan_reads_the_model_without_importing_torch():
    """Reading a published config through transformers' class imports neither torch nor transformers' model
    registry (only configuration_auto and the family's configuration module)."""
    code = ("import sys; from pipeline.core.model_spec import load_model_spec; "
            f"s = load_model_spec({str(CONFIGS / 'gemma-3-12b-it.json')!r}); "
            "assert s.layer_types.count('full') == 8, s.layer_types; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers.models.llama.modeling_llama' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("tp", [2, 4])
def test_heterogeneous_layers_shard_per_kind(tp):
    """A rank's view of Gemma-4 (sliding 32 heads / 16 kv of 256, full 32 / 4 kv of 512, K = V) splits each kind's
    heads and kv heads by tp (kv heads replicated below tp), dims, scale and K = V kept."""
    from pipeline.core.shard import plan_layout, shard_spec

    whole = load_model_spec(ROOT / "tests" / "data" / "model_configs" / "google-gemma-4-31b-it.json")
    view = shard_spec(whole, plan_layout(whole, tp_size=tp, pp_size=1, rank=tp - 1))
    for w, v in zip(whole.layer_kinds(), view.layer_kinds()):
        assert (v.num_heads, v.num_kv_heads) == (w.num_heads // tp, max(1, w.num_kv_heads // tp))
        assert (v.head_dim_qk, v.scaling, v.k_eq_v, v.layer_ids) == (w.head_dim_qk, w.scaling, w.k_eq_v, w.layer_ids)


def test_a_cached_reading_reads_the_same(tmp_path, monkeypatch):
    """transformers' reading of a file is cached by content and transformers version: a second read (no transformers
    import) gives the same spec; a corrupt cache entry is read afresh; ATTN_SETUP_CACHE_DIR=off caches nothing."""
    from pipeline.core import hf_config

    monkeypatch.setenv("ATTN_SETUP_CACHE_DIR", str(tmp_path))
    path = ROOT / "tests" / "data" / "model_configs" / "google-gemma-4-31b-it.json"
    first = load_model_spec(path)
    files = list((tmp_path / "hf-readings").glob("*.json"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr(hf_config, "text_config", lambda *a: calls.append(a))
    assert load_model_spec(path) == first and calls == []
    files[0].write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("ATTN_SETUP_CACHE_DIR", str(tmp_path))
    assert load_model_spec(path) == first
    monkeypatch.setenv("ATTN_SETUP_CACHE_DIR", "off")
    assert hf_config._cache_path({"model_type": "llama"}, "llama") is None


def test_families_the_issue_named_read_as_their_code_says():
    """NAS block_configs (no-op / linear blocks, kv heads = heads / n_heads_in_group per block), Baichuan (7B RoPE
    served, 13B ALiBi refused by name), Cohere2 (every 4th layer full: transformers' Cohere2Config), MiMo-V2-Flash
    (qk 192 / v 128; sliding layers with twice the kv heads and sinks, MiMoV2FlashAttention)."""
    base = {k: v for k, v in _cfg("llama-3.1-8b.json").items() if k != "num_key_value_heads"}
    rope = copy.deepcopy(base["rope_scaling"])
    blocks = [{"attention": {"n_heads_in_group": 8}}, {"attention": {"no_op": True}},
              {"attention": {"n_heads_in_group": 4}}, {"attention": {"replace_with_linear": True}}]
    nas = load_model_spec({**base, "model_type": "nemotron-nas", "num_hidden_layers": 4, "block_configs": blocks})
    assert [(k.num_kv_heads, k.layer_ids) for k in nas.layer_kinds()] == [(32 // 8, [0]), (32 // 4, [2])]
    assert [(g.kind, g.layer_ids) for g in nas.not_attention()] == [("no_op", [1]), ("linear", [3])]
    assert load_model_spec({**base, "model_type": "baichuan"}).layer_types == ["full"] * 32
    with pytest.raises(ModelConfigError) as e:
        load_model_spec({**base, "model_type": "baichuan", "hidden_size": 5120, "num_attention_heads": 40})
    assert e.value.info.code == "unsupported_attention_feature" and "ALiBi" in e.value.info.message
    cohere = load_model_spec({**base, "model_type": "cohere2", "num_hidden_layers": 8, "sliding_window": 4096,
                              "sliding_window_pattern": 4})
    assert [i for i, t in enumerate(cohere.layer_types) if t == "full"] == [3, 7]
    assert base["rope_scaling"] == rope  # transformers' classes standardize a copy, never the caller's dict
    base.pop("rope_scaling")  # MiMoV2FlashConfig takes rope_theta inside a llama3 rope block only
    mimo = load_model_spec({**base, "model_type": "mimo_v2_flash", "num_hidden_layers": 4, "head_dim": 192,
                            "v_head_dim": 128, "num_key_value_heads": 4, "sliding_window": 128,
                            "layer_types": ["full_attention", "sliding_attention"] * 2})
    kinds = {k.kind: k for k in mimo.layer_kinds()}
    assert (kinds["full"].head_dim_qk, kinds["full"].head_dim_v, kinds["full"].num_kv_heads) == (192, 128, 4)
    assert (kinds["sliding"].num_kv_heads, kinds["sliding"].has_sinks, kinds["full"].has_sinks) == (8, True, False)


def test_a_reading_leaves_no_partial_transformers_behind():
    """A reading imports transformers' configuration modules without torch and without the package init; that
    partial package must not stay in ``sys.modules`` after it (a later ``from transformers import AddedToken``, by an
    engine or a library's optional integration, found it and failed on the GPU machine). A second reading reuses the
    modules; the whole library then imports as usual."""
    import subprocess
    import sys

    code = ("import os, sys; os.environ['ATTN_SETUP_CACHE_DIR'] = 'off'\n"
            "from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec\n"
            "a = load_model_spec(DEFAULT_MODEL_CONFIG)\n"
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
            "assert load_model_spec(DEFAULT_MODEL_CONFIG) == a and 'transformers' not in sys.modules\n"
            "from transformers import AddedToken, LlamaConfig\n"
            "print(LlamaConfig.__module__)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0 and "configuration_llama" in p.stdout, p.stderr[-2000:]


_CORPUS = ROOT / "tests" / "data" / "model_configs"


@pytest.mark.parametrize("value", [20.0, "20", 35, 36, -1, float("nan"), [20], True, 0.0, {"n": 20}])
def test_kv_sharing_that_cannot_be_read_is_refused_not_served_as_absent(value):
    """Gemma-4 E2B's text_config.num_kv_shared_layers (35 layers): 20 is refused as a feature; any value other than
    absent / 0 / null that is not an integer in [1, 34] is model_config_invalid at its JSON path, never read as 0."""
    data = json.loads((_CORPUS / "google-gemma-4-e2b-it.json").read_text())
    data["text_config"]["num_kv_shared_layers"] = 20
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(data)
    assert e.value.info.code == "unsupported_attention_feature" and "15..34" in e.value.info.message
    data["text_config"]["num_kv_shared_layers"] = value
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(data)
    assert (e.value.info.code, e.value.info.json_path) == ("model_config_invalid", "$.text_config.num_kv_shared_layers")
    assert "[0, 34]" in e.value.info.allowed[0]
    for unset in (0, None):
        data["text_config"]["num_kv_shared_layers"] = unset
        assert load_model_spec(data).num_hidden_layers == 35


@pytest.mark.parametrize("key, refused, bad, unset", [
    ("index_topk", 2048, ["2048", 2048.0, -1, [2048]], [None, 0]),
    ("use_alibi", True, ["true", 1, 1.0, [True]], [None, False, 0]),
    ("alibi", True, ["yes", 2, {}], [None, False]),
    ("position_embedding_type", "ALiBi", [1, ["alibi"]], [None, "rope"]),
    ("use_bidirectional_attention", True, ["ALL", 1, [True]], [None, False]),
    ("sliding_window", 4096, [0.0, [], "", "4096", -1], [None, 0]),  # no layer_types: which layers slide is unsaid
])
def test_every_refused_when_set_field_treats_set_alike(key, refused, bad, unset):
    """Each attention field refused when set: its set value is a feature refusal, an unreadable one
    model_config_invalid at its JSON path, only absent / null / 0 (a flag: false) read as unset."""
    base = _cfg("llama-3.1-8b.json")
    with pytest.raises(ModelConfigError) as e:
        load_model_spec({**base, key: refused})
    assert (e.value.info.code, e.value.info.json_path) == ("unsupported_attention_feature", f"$.{key}")
    for v in bad:
        with pytest.raises(ModelConfigError) as e:
            load_model_spec({**base, key: v})
        assert (e.value.info.code, e.value.info.json_path) == ("model_config_invalid", f"$.{key}"), v
    for v in unset:
        assert load_model_spec({**base, key: v}).num_hidden_layers == 32


@pytest.mark.parametrize("value", [10**9, 4097, 0, -1, 48.0, "48", None, True, 5])
def test_per_layer_heads_are_checked_as_the_global_ones(value):
    """Laguna's num_attention_heads_per_layer (48 / 64 heads, 8 kv heads): an entry outside [1, 4096] (the bound of
    num_attention_heads), not an integer, or not a multiple of the kv heads is model_config_invalid naming
    $.num_attention_heads_per_layer[0] and the value, before anything is sized from it."""
    data = json.loads((_CORPUS / "poolside-laguna-xs.2-fp8.json").read_text())
    kinds = {(k.num_heads, k.num_kv_heads) for k in load_model_spec(data).layer_kinds()}
    assert kinds == {(48, 8), (64, 8)}
    data["num_attention_heads_per_layer"][0] = value
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(data)
    info = e.value.info
    assert (info.code, info.json_path) == ("model_config_invalid", "$.num_attention_heads_per_layer[0]")
    assert json.dumps(value) in info.message
    data["num_attention_heads_per_layer"] = data["num_attention_heads_per_layer"][1:]
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(data)
    assert (e.value.info.code, e.value.info.json_path) == ("model_config_invalid", "$.num_attention_heads_per_layer")


@pytest.mark.parametrize("key, value", [("global_head_dim", 10**9), ("global_head_dim", 513),
                                        ("num_global_key_value_heads", 5000), ("num_global_key_value_heads", 3)])
def test_per_layer_config_values_are_checked_at_their_source_field(key, value):
    """Gemma-4 31B's full layers take global_head_dim / num_global_key_value_heads through transformers' per-layer
    config: out of range, odd or not dividing the 32 heads is model_config_invalid at that field's JSON path."""
    data = json.loads((_CORPUS / "google-gemma-4-31b-it.json").read_text())
    data["text_config"][key] = value
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(data)
    assert (e.value.info.code, e.value.info.json_path) == ("model_config_invalid", f"$.text_config.{key}")
    assert str(value) in e.value.info.message
