"""Capability honesty: every claim of a record runs a real case; every non-claim is refused by resolve.

Real cases build through :func:`pipeline.setup.build.build_attention_backends` (or drive a backend
directly) and compare every request's output with :func:`pipeline.runtime.reference.reference_attention`
(float64) by ``max|out - ref| / max|ref|``: fp32 <= 1e-4, bf16/fp16 <= 1e-2. ``torch_native``'s
cases run on CPU; CUDA cases (every GPU record's claims, torch_native's pdmux/cuda) are marked
``gpu``; torch_native's other device claims run where torch has that device, else skip with why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from conftest import gpu_backends
from pipeline.backends import registry
from pipeline.backends.base import AttentionLayer
from pipeline.backends.records import TORCH_NATIVE
from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, ForwardMode, ModelSpec, PoolFacts, SetupRequest
from pipeline.core.errors import CapabilityMismatch
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.profiles import PROFILES
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.verify import verify_backend
from states import resolve
from pipeline.core.dtypes import model_dtype

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ALL = {"torch": True, "triton": True, "flashinfer-python": True}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def spec(**kw: Any) -> ModelSpec:
    """A small ModelSpec (3 layers, 4 heads, 2 kv heads, head dim 128 — every GPU record's common dim —, bf16)."""
    base = dict(model_type="probe", hidden_size=512, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, v_head_dim=128, scaling=128 ** -0.5, layer_types=["full"] * 3,
                dtype="bfloat16", source="probe")
    base.update(kw)
    return msgspec.convert(base, ModelSpec)


# DeepSeek-V2/V3's MLA dims (absorbed 576/512, the pair the GPU records claim), 16 heads as in V2-Lite
MLA = dict(mla=dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128), head_dim=192,
           v_head_dim=128, num_attention_heads=16, num_key_value_heads=16, scaling=192 ** -0.5)
FEATURE_MODELS = {
    "mha": spec(), "mla": spec(**MLA),
    "sliding_window": spec(layer_types=["sliding", "full", "sliding"], sliding_window=6),
    "logit_softcap": spec(logit_softcap=3.0), "attention_sinks": spec(has_attention_sinks=True),
    "chunked_local_attention": spec(layer_types=["chunked", "full", "chunked"], attention_chunk_size=5),
    "encoder_decoder": spec(is_encoder_decoder=True),
}
TREE = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=4,
            speculative_num_draft_tokens=8)
FEATURE_ARGS = {"speculative": dict(speculative_algorithm="EAGLE"), "speculative_tree": TREE,
                "speculative_tree_paged": dict(TREE, page_size=16),
                "tbo": dict(enable_two_batch_overlap=True, moe_a2a_backend="deepep"),
                "pdmux": dict(enable_pdmux=True, sm_group_num=2)}


def build_and_verify(model: ModelSpec, device: str, installed: dict, page_size: int = 4, **args: Any) -> list:
    """Build through the pipeline, verify every instance and the top wrapper (with speculative decoding: its
    target-verify step, on the shape resolve settled); returns VerifyResults."""
    page_size = args.pop("page_size", page_size)
    a = AttentionArgs(page_size=page_size, **args)
    req = SetupRequest(args=a, model=model, device=device,
                       pool=PoolFacts(max_reqs=8, max_context_len=128, num_token_slots=96 * page_size,
                                      page_size=page_size))
    with build_attention_backends(req, installed=installed) as out:
        targets = [(i.role, i.backend, out.instances[i.role]) for i in out.plan.instances]
        if out.attn_backend is not out.instances.get(out.plan.instances[0].role):
            targets.append(("wrapper", "wrapper", out.attn_backend))
        dtype = model_dtype(a, model)  # the same rule the pipeline used (auto: sglang's downcast of float32)
        return [verify_backend(b, role=r, name=n, model=model, req_to_token_pool=out.pools["req_to_token_pool"],
                               kv_pool=out.pools["kv_pool"], torch_device=out.torch_device, dtype=dtype,
                               decode_steps=2, spec=out.resolution.speculative) for r, n, b in targets]


def assert_passed(results: list) -> None:
    assert results, "nothing verified"
    for r in results:
        assert r.passed and r.max_rel_err <= r.tol, (r.role, r.max_rel_err, r.detail)


def drive(backend: Any, layer: AttentionLayer, steps: list, *, device: str = "cpu", page_size: int = 4,
          kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, seed: int = 0) -> list[float]:
    """Run ``steps`` = [(mode, rows, new)] through ``backend``; every request's rel. error vs the reference."""
    r2t = ReqToTokenPool(8, 128, device)
    kv = KVPool(96 * page_size, page_size, [(layer.num_kv_heads, layer.head_dim, layer.v_head_dim)], kv_dtype,
                device)
    alloc = PageAllocator(r2t, 96 * page_size, page_size, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    hist: dict[int, tuple[list, list]] = {}
    errs = []
    for mode, rows, new in steps:
        fb = make_forward_batch(mode, rows, new, alloc, kv)
        backend.init_forward_metadata(fb)
        t = sum(new)
        q, k, v = (torch.randn(t, n, d, generator=gen).to(q_dtype).to(device) for n, d in (
            (layer.num_heads, layer.head_dim), (layer.num_kv_heads, layer.head_dim),
            (layer.num_kv_heads, layer.v_head_dim)))
        out = backend.forward(q, k, v, layer, fb).reshape(t, layer.num_heads, layer.v_head_dim)
        start = 0
        for r, n in zip(rows, new):
            sl = slice(start, start + n)
            ks, vs = hist.setdefault(r, ([], []))
            ks.append(k[sl].to(kv_dtype).double().cpu())
            vs.append(v[sl].to(kv_dtype).double().cpu())
            kk, vv = torch.cat(ks), torch.cat(vs)
            ref = reference_attention(q[sl].cpu(), kk, vv, q_positions=torch.arange(len(kk) - n, len(kk)),
                                      scale=layer.scaling, window=layer.sliding_window, softcap=layer.logit_softcap)
            errs.append(rel_err(out[sl].cpu(), ref))
            start += n
    return errs


TN_CPU = {"torch": True, "triton": False, "flashinfer-python": False}

# ---------------------------------------------------------------------------------------------
# torch_native: one real CPU case per claim
# ---------------------------------------------------------------------------------------------
TESTED_FEATURES = {"mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
                   "speculative", "speculative_tree", "speculative_tree_paged", "tbo", "pdmux"}
TESTED_Q = {"bfloat16", "float16", "float32"}
TESTED_KV = {"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}
TESTED_DEVICES = {"cpu", "cuda", "musa", "npu", "xpu"}


def test_every_torch_native_claim_has_a_case():
    """The case lists below cover exactly the record's features, dtypes and devices."""
    assert set(TORCH_NATIVE.features) == TESTED_FEATURES
    assert set(TORCH_NATIVE.q_dtypes) == TESTED_Q and set(TORCH_NATIVE.kv_dtypes) == TESTED_KV
    assert set(TORCH_NATIVE.devices) == TESTED_DEVICES
    assert TORCH_NATIVE.head_dims_qk is None and TORCH_NATIVE.page_sizes is None


@pytest.mark.parametrize("feature", ["mha", "mla", "sliding_window", "logit_softcap", "attention_sinks",
                                     "chunked_local_attention"])
def test_torch_native_model_features_run(feature):
    """Each claimed model feature: built on CPU, every layer kind verified against the reference."""
    assert_passed(build_and_verify(FEATURE_MODELS[feature], "cpu", TN_CPU, attention_backend="torch_native"))


def test_torch_native_tbo_runs():
    """TBO: primary + two children and the wrapper verified."""
    res = build_and_verify(spec(), "cpu", TN_CPU, attention_backend="torch_native", enable_two_batch_overlap=True,
                           moe_a2a_backend="deepep")
    assert {r.role for r in res} == {"tbo.primary", "tbo.child0", "tbo.child1", "wrapper"}
    assert_passed(res)


def test_torch_native_speculative_runs():
    """Speculative: draft decode steps, then a target verify extend of 4 tokens per request."""
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125)
    rows = [0, 1, 2]
    steps = [(ForwardMode.EXTEND, rows, [5, 9, 2])] + [(ForwardMode.DECODE, rows, [1, 1, 1])] * 3
    steps += [(ForwardMode.EXTEND, rows, [4, 4, 4]), (ForwardMode.DECODE, rows, [1, 1, 1])]
    errs = drive(TorchNativeBackend(), layer, steps)
    assert max(errs) <= 1e-2, errs
    res = resolve.decide(AttentionArgs(attention_backend="torch_native", speculative_algorithm="EAGLE"), spec(),
                         PROFILES["cpu"], is_draft_worker=True, installed=TN_CPU)
    assert res.pair.prefill == "torch_native"


@pytest.mark.parametrize("dtype", sorted(TESTED_Q))
def test_torch_native_q_dtypes_run(dtype):
    """Each claimed q dtype (given as --dtype), KV in the same dtype."""
    assert_passed(build_and_verify(spec(dtype=dtype), "cpu", TN_CPU, attention_backend="torch_native", dtype=dtype))


@pytest.mark.parametrize("kv", sorted(TESTED_KV))
def test_torch_native_kv_dtypes_run(kv):
    """Each claimed KV-cache dtype (fp8 stored as float8 and upcast on read)."""
    assert_passed(build_and_verify(spec(dtype="float32"), "cpu", TN_CPU, attention_backend="torch_native",
                                   kv_cache_dtype=kv, dtype="float32"))


@pytest.mark.parametrize("d,dv", [(32, 32), (80, 80), (96, 96), (128, 128), (256, 256), (192, 128)])
def test_torch_native_head_dims_run(d, dv):
    """Head dims are unrestricted (None): a spread of qk/v dims, including qk != v, runs."""
    assert_passed(build_and_verify(spec(head_dim=d, v_head_dim=dv), "cpu", TN_CPU, attention_backend="torch_native"))


def test_torch_native_mixed_head_dims_run():
    """Gemma-style layers of two head dims (64 local, 128 global) in one model."""
    m = spec(layer_types=["sliding", "sliding", "full"], sliding_window=5, head_dim=64, v_head_dim=64, scaling=0.125,
             global_head_dim=128)
    assert [k.head_dim_qk for k in m.layer_kinds()] == [64, 128]
    assert_passed(build_and_verify(m, "cpu", TN_CPU, attention_backend="torch_native"))


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_torch_native_page_sizes_run(page_size):
    """Page sizes are unrestricted (None): 1, an odd 3 and 16."""
    assert_passed(build_and_verify(spec(), "cpu", TN_CPU, page_size=page_size, attention_backend="torch_native"))


@pytest.mark.parametrize("dev", ["musa", "npu", "xpu"])
def test_torch_native_other_devices_run(dev):
    """Devices without a pipeline platform here: the backend itself on that torch device, if present."""
    mod = getattr(torch, dev, None)
    if mod is None or not getattr(mod, "is_available", lambda: False)():
        pytest.skip(f"torch has no available {dev} device on this machine")
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125)
    errs = drive(TorchNativeBackend(torch_device=dev), layer, [(ForwardMode.EXTEND, [0, 1], [5, 3]),
                                                              (ForwardMode.DECODE, [0, 1], [1, 1])], device=dev)
    assert max(errs) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("args", [{}, {"enable_pdmux": True, "sm_group_num": 2}])
def test_torch_native_cuda_and_pdmux_run(args):
    """CUDA device and PD-mux (which needs a GPU): every instance verified."""
    assert_passed(build_and_verify(spec(), "cuda", TN_CPU, attention_backend="torch_native", **args))


# ---------------------------------------------------------------------------------------------
# GPU records: real cases on CUDA for every claim (marked gpu)
# ---------------------------------------------------------------------------------------------
GPU_RECORDS = gpu_backends()


def _gpu_cases() -> list:
    cases = []
    for name in GPU_RECORDS:
        cap = registry.get(name).capability
        for d, dv in zip(cap.head_dims_qk or [], cap.head_dims_v or []):
            cases.append((name, dict(head_dim=d, v_head_dim=dv), {}))
        for d, dv in cap.mla_head_dims or []:  # absorbed MLA dims: a DeepSeek-style model with that latent / rope
            cases.append((name, dict(MLA, mla=dict(MLA["mla"], kv_lora_rank=dv, qk_rope_head_dim=d - dv)), {}))
        cases += [(name, dict(dtype=q), {}) for q in cap.q_dtypes]
        cases += [(name, dict(dtype=k) if cap.kv_dtype_matches_q and not k.startswith("fp8") else {},
                   dict(kv_cache_dtype=k)) for k in cap.kv_dtypes]  # fp8 KV under the model's bf16 q
        cases += [(name, {}, {"page_size": p}) for p in (cap.page_sizes or [1, 16])]
        for f in cap.features:
            if f in FEATURE_MODELS:
                cases.append((name, msgspec.to_builtins(FEATURE_MODELS[f]), {}))
            elif f in FEATURE_ARGS:
                cases.append((name, {}, FEATURE_ARGS[f]))
    return cases


def _installed_by_import() -> dict:
    from pipeline.backends.packages import installed_by_import

    return installed_by_import()


@pytest.mark.gpu
@pytest.mark.parametrize("name,model_kw,args", _gpu_cases(), ids=lambda x: str(x)[:40])
def test_gpu_record_claims_run(name, model_kw, args):
    """Each claimed head dim / dtype / KV dtype / page size / feature of a GPU record, verified on CUDA."""
    if PROFILES["h200"].arch not in (registry.get(name).capability.archs or ["any"]):
        pytest.skip("record does not claim sm90")
    model = msgspec.convert({**msgspec.to_builtins(spec()), **model_kw}, ModelSpec)
    args = dict(args)
    ps = args.pop("page_size", 4)
    assert_passed(build_and_verify(model, "cuda", _installed_by_import(), page_size=ps, attention_backend=name,
                                   **args))


# ---------------------------------------------------------------------------------------------
# Every record: what it does not claim, resolve refuses (CPU, pure)
# ---------------------------------------------------------------------------------------------
def _refused(name: str, model: ModelSpec, device_profile: str = "h200", **args: Any) -> list[str]:
    """Reasons of an explicit choice of ``name``; [] when resolve accepts it."""
    try:
        resolve.decide(AttentionArgs(attention_backend=name, **args), model, PROFILES[device_profile],
                       is_draft_worker=False, installed=ALL)
    except CapabilityMismatch as e:
        return [e.info.message]
    return []


@pytest.mark.parametrize("name", registry.names())
def test_unclaimed_features_are_refused_claimed_ones_pass(name):
    """For each feature probe: refused with a reason iff the record does not claim it."""
    cap = registry.get(name).capability
    probes = [(f, m, {}) for f, m in FEATURE_MODELS.items()] + [(f, spec(), a) for f, a in FEATURE_ARGS.items()]
    for feature, model, args in probes:
        why = _refused(name, model, **args)
        assert bool(why) == (not cap.has(feature)), (name, feature, why)


@pytest.mark.parametrize("name", registry.names())
def test_unclaimed_head_dims_and_dtypes_are_refused(name):
    """Head dims outside the record's list, and q/KV dtypes it lacks, are refused naming the value."""
    cap = registry.get(name).capability
    for d in (32, 64, 80, 96, 128, 192, 256, 512):
        why = _refused(name, spec(head_dim=d, v_head_dim=d))
        claimed = cap.head_dims_qk is None or d in cap.head_dims_qk
        assert bool(why) == (not claimed), (name, d)
        if why:
            assert f"head dim {d}" in why[0]
    for q in ("bfloat16", "float16", "float32"):
        why = _refused(name, spec(), dtype=q)
        assert bool(why) == (q not in cap.q_dtypes) and (not why or q in why[0])
    for kv in ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"):
        why = _refused(name, spec(), kv_cache_dtype=kv)  # spec() is bfloat16
        unequal = cap.kv_dtype_matches_q and kv != "bfloat16" and not kv.startswith("fp8")  # fp8 is dequantized
        assert bool(why) == (kv not in cap.kv_dtypes or unequal) and (not why or kv in why[0])


@pytest.mark.parametrize("name", registry.names())
def test_unclaimed_devices_and_arches_are_refused(name):
    """Every named profile the record's devices/arches exclude is refused; the others pass."""
    cap = registry.get(name).capability
    for prof, facts in PROFILES.items():
        ok = facts.type in cap.devices and (cap.archs is None or facts.arch in cap.archs)
        assert bool(_refused(name, spec(), prof)) == (not ok), (name, prof)


@pytest.mark.parametrize("name", registry.names())
def test_cuda_graph_claim_decides_the_downgrade(name):
    """A record without cuda_graph gets the recorded CUDA-graph downgrade on a GPU; with it, none."""
    res = resolve.decide(AttentionArgs(attention_backend=name), spec(), PROFILES["h200"], is_draft_worker=False,
                         installed=ALL)
    assert [s.what for s in res.skips] == ([] if registry.get(name).capability.has("cuda_graph") else ["cuda_graph"])


def test_tree_speculation_refused_iff_unclaimed():
    """EAGLE top-k > 1 needs tree masks: refused naming tree verification exactly for the records without
    speculative_tree (or without speculative at all)."""
    for name in registry.names():
        cap = registry.get(name).capability
        why = _refused(name, spec(), **TREE)
        assert bool(why) == (not cap.has("speculative_tree")), (name, why)


@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_native_speculative_tree_runs(page_size):
    """speculative_tree / speculative_tree_paged: a target verify of random EAGLE trees (top-k 4, 8 tokens, 3 steps)
    through the built backend, against the float64 reference with the tree mask."""
    res = build_and_verify(spec(), "cpu", TN_CPU, attention_backend="torch_native", page_size=page_size, **TREE)
    assert_passed(res)
    assert all("target-verify" in r.detail for r in res)


@pytest.mark.parametrize("name", registry.names())
def test_mla_head_dims_are_claimed_as_pairs(name):
    """A record with mla_head_dims serves MLA kinds with exactly those (qk, v) pairs: another latent / rope split is
    refused naming both dims; a record without them (torch_native) checks its plain head-dim lists."""
    cap = registry.get(name).capability
    if not cap.has("mla"):
        return
    for latent, rope in ((512, 64), (256, 32), (512, 128)):
        model = spec(**dict(MLA, mla=dict(MLA["mla"], kv_lora_rank=latent, qk_rope_head_dim=rope)))
        why = _refused(name, model)
        claimed = cap.mla_head_dims is None or [latent + rope, latent] in cap.mla_head_dims
        assert bool(why) == (not claimed), (name, latent, rope, why)
        if why:
            assert f"MLA head dims {latent + rope}/{latent}" in why[0]


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_only_with_the_claimed_model_features(name, kv):
    """An fp8 KV cache is accepted for a model feature iff the record claims the dtype, the feature and (when it
    lists them) fp8_kv_features; every refusal names kv_cache_dtype or the feature."""
    cap = registry.get(name).capability
    for feature in ("mha", "mla", "sliding_window", "logit_softcap", "attention_sinks"):
        why = _refused(name, FEATURE_MODELS[feature], kv_cache_dtype=kv)
        ok = kv in cap.kv_dtypes and cap.has(feature) and (cap.fp8_kv_features is None
                                                            or feature in cap.fp8_kv_features)
        assert bool(why) == (not ok), (name, kv, feature, why)
