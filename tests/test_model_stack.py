"""The attention stack (pipeline.runtime.model) against hand-derived values and its float64 dense reference.

Independent yardsticks: a one-token step has a softmax over one key, so attention returns that
token's V exactly (times exp(s)/(exp(s)+exp(sink)) with a sink) — no RoPE or scores involved;
RoPE's relative-position property; and the dense float64 reference (complex RoPE, MLA un-absorbed)
against the paged torch_native run in float32 (tolerance 1e-5).
"""

from __future__ import annotations


import msgspec
import pytest
import torch

from conftest import CONFIGS
from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import ConfigError
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.runtime.model import AttentionStack, _rope_complex, reference_forward, rope_neox
from pipeline.core.spec import truncate_spec
from pipeline.core.model_spec import load_model_spec
from pipeline.runtime.reference import rel_err


def _spec(name, **over):
    s = load_model_spec(CONFIGS / name)
    return msgspec.structs.replace(s, **over) if over else s


def test_truncate_spec():
    s = _spec("gemma-2-9b.json")
    t = truncate_spec(s, 3)
    assert (t.num_hidden_layers, t.layer_types) == (3, s.layer_types[:3]) and truncate_spec(s, None) is s
    for bad in (0, s.num_hidden_layers + 1):
        with pytest.raises(ConfigError) as e:
            truncate_spec(s, bad)
        assert e.value.info.flags[0].name == "num_layers"


def test_rope_matches_complex_rotation_and_is_relative():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    got, want = rope_neox(x.float(), pos, 10000.0), _rope_complex(x, pos, 10000.0)
    assert rel_err(got[:4], want[:4]) < 1e-5
    assert rel_err(got[4:], want[4:]) < 1e-3   # fp32 angle at position 4095: ~2e-4 absolute
    q, k = torch.randn(1, 1, 64, dtype=torch.float64), torch.randn(1, 1, 64, dtype=torch.float64)
    dots = [(_rope_complex(q, torch.tensor([m + 5]), 1e4) * _rope_complex(k, torch.tensor([m]), 1e4)).sum()
            for m in (0, 17, 300)]
    assert max(abs(float(d - dots[0])) for d in dots) < 1e-9   # depends only on m - n


def test_weights_are_seeded():
    s = _spec("qwen3-8b.json")
    a, b = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=1, seed=1), \
        AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=1, seed=1)
    c = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=1, seed=2)
    assert torch.equal(a.weights[0]["qkv"], b.weights[0]["qkv"]) and not torch.equal(a.weights[0]["qkv"],
                                                                                      c.weights[0]["qkv"])
    h, hkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
    assert a.param_bytes() == 4 * ((h + 2 * hkv) * d * s.hidden_size + s.hidden_size * h * d)


@pytest.mark.parametrize("config", ["llama-3.1-8b.json", "gpt-oss-20b.json"])
def test_one_token_attention_is_its_value(config):
    """Position 0 sees only itself: the layer adds (expand_gqa(V) · w) @ Wo, w = 1 or the sink share."""
    s = _spec(config)
    st = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=1, seed=4)
    x = torch.randn(1, s.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    L, w = st.layers[0], {k: t.double() for k, t in st.weights[0].items()}
    xn = x / torch.sqrt(x.pow(2).mean() + 1e-6)
    v = (xn @ w["qkv"].T)[:, (L.num_heads + L.num_kv_heads) * L.head_dim:].reshape(L.num_kv_heads, L.head_dim)
    heads = v.repeat_interleave(L.num_heads // L.num_kv_heads, dim=0)          # [H, D]
    if L.sinks is not None:
        # softmax over {score s, sink}: weight of the key = 1 / (1 + exp(sink - s)); s = q·k·scale,
        # and RoPE at position 0 is the identity
        qk = (xn @ w["qkv"].T)
        q = qk[0, : L.num_heads * L.head_dim].reshape(L.num_heads, L.head_dim)
        k = qk[0, L.num_heads * L.head_dim:(L.num_heads + L.num_kv_heads) * L.head_dim].reshape(L.num_kv_heads, -1)
        s_h = (q * k.repeat_interleave(L.num_heads // L.num_kv_heads, 0)).sum(-1) * L.scaling
        share = 1.0 / (1.0 + torch.exp(L.sinks.double() - s_h))
        heads = heads * share[:, None]
    want = x + heads.reshape(1, -1) @ w["o"].T
    got, _ = reference_forward(st, x)
    assert rel_err(got - x, want - x) < 1e-6


SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, v_head_dim=64,
             scaling=0.125)  # the hybrid / chunked layouts at a size the CPU reference handles quickly
CASES = [("llama-3.1-8b.json", {}, 1), ("gemma-2-9b.json", {"sliding_window": 3}, 2),
         ("gpt-oss-20b.json", {"sliding_window": 4}, 2), ("deepseek-v2-lite.json", {}, 1),
         ("qwen2.5-7b.json", {}, 1),
         ("llama-4-scout-17b-16e-instruct.json", {"attention_chunk_size": 3, **SMALL}, 4),  # chunked x3 + full
         ("qwen3-next-80b-a3b-instruct.json", SMALL, 2)]  # attention layers 3 and 7 of 8


@pytest.mark.parametrize("config,over,layers", CASES, ids=[c[0] for c in CASES])
def test_paged_stack_equals_dense_reference(config, over, layers):
    """extend, chunked extend and decode through torch_native (paged, fp32) == dense float64 reference.

    Windows and chunks are shrunk (3-4 keys) so they bite within the 12-token sequences; pages of 4
    slots are handed out scrambled. A hybrid's linear-attention layers are skipped (no KV buffer).
    """
    s = _spec(config, **over)
    st = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=layers, seed=7)
    assert len(st.layers) == layers
    rp = ReqToTokenPool(3, 64, "cpu")
    kv = KVPool.for_layer_kinds(st.spec.layer_kinds(), st.num_layers, 256, 4, torch.float32, "cpu")
    alloc, be = PageAllocator(rp, 256, 4, seed=3), TorchNativeBackend(torch_device="cpu")
    g = torch.Generator().manual_seed(11)
    rows, hist, outs = [0, 1, 2], {0: [], 1: [], 2: []}, {0: [], 1: [], 2: []}
    for mode, new in [(ForwardMode.EXTEND, [5, 1, 7]), (ForwardMode.EXTEND, [2, 3, 1]),
                      (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.DECODE, [1, 1, 1])]:
        fb = make_forward_batch(mode, rows, new, alloc, kv)
        x = torch.randn(sum(new), s.hidden_size, generator=g)
        be.init_forward_metadata(fb)
        out, _ = st.forward(x, fb, be)
        assert out.dtype is torch.float32 and out.shape == x.shape
        for r, piece_x, piece_o in zip(rows, x.split(new), out.split(new)):
            hist[r].append(piece_x)
            outs[r].append(piece_o)
    for r in rows:
        xs = torch.cat(hist[r]).double()
        ref, _ = reference_forward(st, xs)
        assert rel_err(torch.cat(outs[r]).double() - xs, ref - xs) < 1e-5, r


def test_aux_hidden_states_are_layer_inputs():
    s = _spec("qwen3-8b.json")
    st = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=3, seed=0)
    with pytest.raises(ConfigError) as e:
        st.set_aux_hidden_state_layers([0, 3])
    assert e.value.info.flags[0].name == "aux_hidden_state_layers"
    x = torch.randn(4, s.hidden_size, dtype=torch.float64)
    full, _ = reference_forward(st, x)
    st.set_aux_hidden_state_layers([0, 2])
    out, aux = reference_forward(st, x)
    one = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=2, seed=0)
    two, _ = reference_forward(one, x)       # the input of layer 2 = the output of a 2-layer stack
    assert torch.equal(out, full) and torch.equal(aux[0], x) and rel_err(aux[1], two) < 1e-12


def test_non_mla_model_with_distinct_v_dim_is_refused():
    s = _spec("llama-3.1-8b.json", v_head_dim=64)
    with pytest.raises(ConfigError) as e:
        AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=1)
    assert {f.name for f in e.value.info.flags} == {"head_dim", "v_head_dim"}


def test_hybrid_stack_builds_only_attention_layers():
    """Qwen3-Next: --num-layers 2 builds attention layers 3 and 7 (of 8 spanned); their KV buffers exist, the
    linear-attention layers' are empty; aux hidden states only on built layers."""
    s = _spec("qwen3-next-80b-a3b-instruct.json", **SMALL)
    st = AttentionStack(s, dtype=torch.float32, device="cpu", num_layers=2, seed=0)
    assert st.num_layers == 8 and [L.layer_id for L in st.layers] == [3, 7]
    kv = KVPool.for_layer_kinds(st.spec.layer_kinds(), st.num_layers, 16, 4, torch.float32, "cpu")
    assert [tuple(b.shape[1:]) for b in kv.k_buffer] == [(0, 0)] * 3 + [(2, 64)] + [(0, 0)] * 3 + [(2, 64)]
    with pytest.raises(ConfigError):
        st.set_aux_hidden_state_layers([2])
    st.set_aux_hidden_state_layers([7])
    _, aux = reference_forward(st, torch.randn(3, s.hidden_size, dtype=torch.float64))
    assert len(aux) == 1


def test_chunked_layers_carry_the_chunk():
    """Llama-4's chunked layers get attention_chunk_size, its full (NoPE) layers none."""
    st = AttentionStack(_spec("llama-4-scout-17b-16e-instruct.json", **SMALL), dtype=torch.float32, device="cpu",
                        num_layers=4, seed=0)
    assert [(L.layer_id, L.attention_chunk_size) for L in st.layers] == [(0, 8192), (1, 8192), (2, 8192), (3, None)]


def _bf16_runner(**spec):
    """A ready CPU runner (torch_native) over a one-layer bf16 model (hidden 256)."""
    from pipeline.core.contracts import AttentionArgs, ModelSpec, PoolFacts, SetupRequest
    from pipeline.runtime.runner import Runner, RunnerConfig

    m = msgspec.convert(dict(model_type="probe", hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=64, v_head_dim=64, scaling=0.125, layer_types=["full"],
                             dtype="bfloat16", **spec), ModelSpec)
    req = SetupRequest(args=AttentionArgs(page_size=16), model=m, device="cpu",
                       pool=PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=256, page_size=16))
    return Runner(RunnerConfig(request=req)).initialize()


def test_model_steps_compare_with_what_a_bf16_stack_stores():
    """The reference rounds what the bf16 stack stores (store_dtype), so the reference backend's steps sit well
    inside the 1e-2 tolerance; against unrounded float64 this model's bf16 storage alone came to 1.04e-2."""
    from pipeline.runtime.model_steps import verify_model_steps

    with _bf16_runner(has_attention_sinks=True) as r:
        checks = verify_model_steps(r, decode_steps=2)
    assert all(c.tol == 1e-2 for c in checks)
    assert max(c.max_rel_err for c in checks) <= 0.6e-2, checks


def test_model_steps_still_catch_wrong_attention(monkeypatch):
    """Rounding the reference does not blunt the check: decode answered with zeros fails every decode step."""
    from pipeline.runtime.model_steps import verify_model_steps

    with _bf16_runner() as r:
        monkeypatch.setattr(TorchNativeBackend, "forward_decode", lambda self, q, *a, **k: torch.zeros_like(q))
        checks = verify_model_steps(r, decode_steps=2)
    assert [c.passed for c in checks] == [True, True, False, False, False], checks
    assert checks[-1].step == "kv-cache-write"  # it wrote no K/V for the decode tokens either
    assert min(c.max_rel_err for c in checks if c.mode == "decode") > 0.1


def test_reference_store_dtype_rounds_only_when_asked():
    """store_dtype=None is the exact float64 model; bfloat16 moves it by bf16 rounding, i.e. by less than 2^-6."""
    from pipeline.runtime.model import AttentionStack

    st = AttentionStack(_spec("llama-3.1-8b.json", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, v_head_dim=64, scaling=0.125),
                        dtype=torch.bfloat16, device="cpu", num_layers=1)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    exact, _ = reference_forward(st, x)
    again, _ = reference_forward(st, x, store_dtype=None)
    rounded, _ = reference_forward(st, x, store_dtype=torch.bfloat16)
    assert torch.equal(exact, again)
    err = rel_err(rounded - x, exact - x)
    assert 0 < err < 2 ** -6
