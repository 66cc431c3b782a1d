"""The runner's outer machine on CPU with fake platforms: order, guards, failures, pools, graphs sizes."""

from __future__ import annotations

import msgspec
import pytest

from conftest import CONFIGS, npu_facts
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from states.build_mode import capture_batch_sizes, skip_reason
from pipeline.core.errors import BackendClosed, ConfigError, OrderingError
from pipeline.core.steps import GuardError
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.memory.pools import kv_bytes_per_token, size_pools
from pipeline.runtime.runner import Runner, RunnerConfig
from pipeline.runtime.table import RunnerState

ORDER = ["init-distributed", "load-model", "init-memory-pool", "attention", "capture-cuda-graphs", "ready"]
STEPS = ["init_distributed", "load_model", "init_memory_pool", "init_attention", "capture_cuda_graphs"]
POOL = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=256)


@pytest.fixture(scope="module")
def qwen():
    return load_model_spec(CONFIGS / "qwen3-8b.json")


def cpu_facts(mem=1 << 30):
    return DeviceFacts(type="cpu", name="fake cpu", total_memory_bytes=mem, sm_count=2, source="test")


def runner(model, *, platform=None, args=None, **cfg):
    args = args or AttentionArgs()
    pool = msgspec.structs.replace(POOL, page_size=args.page_size)
    req = SetupRequest(args=args, model=model, device=cfg.pop("device", "cpu"), pool=pool,
                       rank=cfg.pop("rank", 0), world_size=cfg.pop("world_size", 1),
                       is_draft_worker=cfg.pop("draft", False))
    kw = {k: cfg.pop(k) for k in ("cpu_group", "agree") if k in cfg}
    return Runner(RunnerConfig(request=req, num_layers=cfg.pop("num_layers", 1), **cfg),
                  platform=platform or FakePlatform(cpu_facts()), **kw)


def transitions(r):
    return [t.from_state for t in r.log.records if isinstance(t, ev.RunnerTransition)]


def test_initialize_reaches_ready_and_steps_verify(qwen):
    from pipeline.runtime.model_steps import verify_model_steps

    with runner(qwen) as r:
        r.initialize()
        assert r.state is RunnerState.READY and transitions(r) + ["ready"] == ORDER
        skip = [x for x in r.log.records if isinstance(x, ev.StepSkipped) and x.what == "cuda_graph_capture"]
        assert len(skip) == 1 and "CUDA graphs need a CUDA device" in skip[0].reason and r.graphs is None
        ready = r.log.records[-1]
        assert isinstance(ready, ev.RunnerReady) and ready.rank_agreement.startswith("single rank")
        checks = verify_model_steps(r, decode_steps=2)
        assert [c.step for c in checks] == ["extend", "chunked-extend", "decode#0", "decode#1"]
        assert all(c.passed and not c.graph for c in checks), checks
    assert r.machine.model.pools == {} and r.backends.closed


@pytest.mark.parametrize("i", range(1, 5))
def test_out_of_order_step_names_the_missing_steps(qwen, i):
    r = runner(qwen)
    with pytest.raises(OrderingError) as e:
        getattr(r, STEPS[i])()
    assert f"{ORDER[i]} refused" in str(e.value) and e.value.info.flags[1].value == ORDER[:i]
    assert r.state is RunnerState.INIT_DISTRIBUTED and not [x for x in r.log.records if isinstance(x, ev.RunFailed)]


def test_a_step_cannot_run_twice(qwen):
    r = runner(qwen)
    r.init_distributed()
    with pytest.raises(OrderingError, match="init-distributed refused: it already ran"):
        r.init_distributed()


def _to_capture(r):
    for s in STEPS[:4]:
        getattr(r, s)()
    assert r.state is RunnerState.CAPTURE


@pytest.mark.parametrize("break_it,guard,step", [
    (lambda r: setattr(r.machine.model, "lazy_mem", None), "lazy_mem_settled", "npu-lazy-mem"),
    (lambda r: setattr(r.stack, "aux_hidden_state_layers", None), "aux_hidden_set", "load-model"),
    (lambda r: r.machine.model.pools.clear(), "kv_pool_exists", "init-memory-pool"),
    (lambda r: r.backends.close(), "attention_done", "attention"),
])
def test_capture_refused_unless_every_precondition_holds(qwen, break_it, guard, step):
    r = runner(qwen, aux_hidden_state_layers=(0,))
    _to_capture(r)
    break_it(r)
    with pytest.raises(GuardError) as e:
        r.capture_cuda_graphs()
    assert e.value.info.flags[0].value == guard and step in e.value.info.flags[1].value
    assert "capture refused" in str(e.value)
    failed = [x for x in r.log.records if isinstance(x, ev.RunFailed)]
    assert r.state is RunnerState.FAILED and failed[-1].error.state == "capture-cuda-graphs"
    assert failed[-1].error.code == "guard_blocked"


def test_capture_refused_when_ranks_have_a_group_but_no_agreement(qwen):
    r = runner(qwen, rank=1, world_size=2, cpu_group=object())
    _to_capture(r)
    with pytest.raises(GuardError) as e:
        r.capture_cuda_graphs()
    assert e.value.info.flags[0].value == "ranks_agreed"


def test_rank_agreement_from_callable_or_recorded_skip(qwen):
    seen = []
    r = runner(qwen, rank=1, world_size=2, cpu_group="G", agree=lambda res, req, g: seen.append(
        (res.pair.prefill, req.rank, g)) or "agreed by test")
    r.initialize()
    assert seen == [("torch_native", 1, "G")] and r.log.records[-1].rank_agreement == "agreed by test"
    r2 = runner(qwen, rank=1, world_size=2)   # no process group at all: the pipeline records the skip
    r2.initialize()
    assert r2.log.records[-1].rank_agreement.startswith("skipped: world_size=2")


def test_zbal_before_capture_never_for_draft_or_size_zero(qwen, monkeypatch):
    """With a fake NPU platform and a fake capture: zbal lazy memory is called before capture."""
    import pipeline.runtime.cuda_graphs as cg
    import states.build_mode as graphs

    class FakeGraphs:
        def __init__(self, stack, backend, rp, kv, sizes, **mode):  # mode / spec: what a speculative worker captures
            self.sizes, self.capture_ms = sizes, {}
            self.graph_bytes, self.device_bytes = dict.fromkeys(sizes, 0), dict.fromkeys(sizes, 0)
            self.step_device_bytes = 0

        def capture(self, on_captured):
            for bs in self.sizes:
                plat.calls.append(("capture", (bs,)))
                self.capture_ms[bs] = 0.0
                on_captured(bs, 0.0)

        def close(self):
            pass

    monkeypatch.setattr(graphs, "decide_graphs", lambda *a: graphs.GraphDecision(True))  # capture on the fake NPU
    monkeypatch.setattr(cg, "DecodeGraphRunner", FakeGraphs)
    for draft, size, zbal in [(False, 4096, True), (True, 4096, False), (False, 0, False)]:
        plat = FakePlatform(npu_facts())
        r = runner(qwen, platform=plat, device="npu:0", rank=0, world_size=1, draft=draft,
                   args=AttentionArgs(zbal_local_mem_size=size, cuda_graph_bs=[1, 2]))
        r.initialize()
        names = [c[0] for c in plat.calls]
        assert names.count("init_lazy_device_memory") == int(zbal)
        assert [c for c in plat.calls if c[0] == "capture"] == [("capture", (1,)), ("capture", (2,))]
        if zbal:
            assert names.index("init_lazy_device_memory") < names.index("capture")
            assert plat.called("init_lazy_device_memory") == [(4096, 0, 1, None)]
        captured = [x.bs for x in r.log.records if isinstance(x, ev.CudaGraphCaptured)]
        assert captured == [1, 2] and r.log.records[-1].graph_batch_sizes == [1, 2]
        r.close()


def _fail_dist(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    return {"world_size": 2}


def _fail_model(monkeypatch):
    import pipeline.runtime.model as m

    def boom(*a, **k):
        raise RuntimeError("weights exploded")
    monkeypatch.setattr(m.AttentionStack, "__init__", boom)
    return {}


def _fail_capture(monkeypatch):
    import pipeline.runtime.cuda_graphs as cg
    import states.build_mode as graphs

    monkeypatch.setattr(graphs, "decide_graphs", lambda *a: graphs.GraphDecision(True))  # capture on CPU: it fails
    monkeypatch.setattr(cg, "DecodeGraphRunner",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("capture exploded")))
    return {}


@pytest.mark.parametrize("setup,step,code,words", [
    (_fail_dist, "init-distributed", "invalid_value", "torch.distributed disagrees"),
    (_fail_model, "load-model", "internal_error", "weights exploded"),
    (lambda mp: {"mem_bytes": 1000}, "init-memory-pool", "pool_budget_too_small", "cannot hold req_to_token"),
    (lambda mp: {"args": AttentionArgs(attention_backend="nosuch")}, "resolve", "backend_unknown", "nosuch"),
    (_fail_capture, "capture-cuda-graphs", "internal_error", "capture exploded"),
])
def test_failure_in_any_step_is_logged_with_step_and_cause(qwen, monkeypatch, tmp_path, setup, step, code, words):
    from pipeline.observe.trace import read_trace

    kw = setup(monkeypatch)
    r = runner(qwen, **kw)
    r.log.__init__(r.log.run_id, 0, tmp_path / "t.jsonl")
    with pytest.raises(Exception):
        r.initialize()
    assert r.state is RunnerState.FAILED
    fails = [x for x in r.log.records if isinstance(x, ev.RunFailed)]
    assert len(fails) == 1 and fails[0].error.state == step and fails[0].error.code == code
    assert words in fails[0].error.message
    moved = [x for x in r.log.records if isinstance(x, ev.RunnerTransition)][-1]
    assert moved.to == "failed" and moved.from_state == (step if step != "resolve" else "attention")
    r.log.close()
    run = read_trace(tmp_path / "t.jsonl").runs[0]
    assert run.status == "failed" and run.failure.code == code
    with pytest.raises(OrderingError, match="the runner failed"):
        r.capture_cuda_graphs()


def test_pool_sized_from_bytes_and_fraction(qwen):
    kinds = qwen.layer_kinds()
    per_tok = qwen.num_key_value_heads * 2 * qwen.head_dim * 2   # K and V, bf16, one layer
    assert kv_bytes_per_token(kinds, 1, "bfloat16") == per_tok
    r = runner(qwen, mem_bytes=1 << 20, args=AttentionArgs(page_size=16))
    r.initialize()
    want = ((1 << 20) - 4 * 64 * 4) // per_tok // 16 * 16
    rec = next(x for x in r.log.records if isinstance(x, ev.MemoryPoolSized))
    assert (rec.source, rec.num_token_slots, rec.bytes_per_token) == ("bytes", want, per_tok)
    assert rec.kv_bytes == r.pools["kv_pool"].nbytes() and r.pools["kv_pool"].size == want
    assert r.request.pool.num_token_slots == want
    r.close()
    r = runner(qwen, mem_fraction=0.001, platform=FakePlatform(cpu_facts(mem=1 << 30)))
    r.init_distributed(), r.load_model(), r.init_memory_pool()
    rec = next(x for x in r.log.records if isinstance(x, ev.MemoryPoolSized))
    assert rec.source == "mem_fraction" and rec.budget_bytes == int(0.001 * (1 << 30))
    assert rec.num_token_slots == (rec.budget_bytes - 4 * 64 * 4) // per_tok
    with pytest.raises(ConfigError):
        size_pools(kinds, 1, "bfloat16", page_size=1, max_reqs=1, max_context_len=1, budget_bytes=10)


def test_num_layers_truncates_model_pool_and_request(qwen):
    r = runner(qwen, num_layers=3)
    r.initialize()
    assert r.stack.num_layers == 3 and len(r.pools["kv_pool"].k_buffer) == 3
    assert r.request.model.num_hidden_layers == 3
    started = next(x for x in r.log.records if isinstance(x, ev.RunStarted))
    assert started.request["model"]["num_hidden_layers"] == 3
    r.close()


@pytest.mark.parametrize("bs,max_bs,max_reqs,want", [
    (None, None, 40, [1, 2, 4, 8, 16, 24, 32, 40]), (None, 20, 64, [1, 2, 4, 8, 16]),
    (None, 3, 64, [1, 2]), ([8, 1, 3], None, 8, [1, 3, 8]), (None, 4, 4, [1, 2, 4]), ([8, 1], 8, 8, [1, 8]),
])
def test_capture_batch_sizes(bs, max_bs, max_reqs, want):
    assert capture_batch_sizes(AttentionArgs(cuda_graph_bs=bs, cuda_graph_max_bs=max_bs), max_reqs) == want


def test_capture_batch_size_beyond_pool_is_refused():
    with pytest.raises(ConfigError) as e:
        capture_batch_sizes(AttentionArgs(cuda_graph_bs=[1, 9]), 8)
    assert e.value.info.flags[0].name == "cuda_graph_bs"


def test_graph_sizes_one_rule_over_the_space():
    """Every combination of cuda_graph_bs (unset or a list), cuda_graph_max_bs (unset or 1..40) and max_reqs 1..33:
    accepted exactly when every given size is reachable (list entries and the max within max_reqs) and the two
    fields agree (the max, when both are given, is the list's largest); an accepted request captures only sizes
    within max_reqs and, with the max given, up to it; a refused one names the field at fault and its remedy's
    first change is then accepted (max 4 with bs 8, and max 100 with max_reqs 8, were accepted silently)."""
    import re

    lists = [None, [1], [8], [1, 2, 4], [3, 16], [24, 5], [40]]
    for max_reqs in range(1, 34):
        for bs in lists:
            for top in [None, *range(1, 41)]:
                args = AttentionArgs(cuda_graph_bs=bs, cuda_graph_max_bs=top)
                ok = (all(b <= max_reqs for b in bs or ()) and not (top and bs and top != max(bs))
                      and not (top and top > max_reqs))
                try:
                    sizes = capture_batch_sizes(args, max_reqs)
                except ConfigError as e:
                    assert not ok, (bs, top, max_reqs, e.info.message)
                    info = e.info
                    assert info.flags[0].name == ("cuda_graph_bs" if any(b > max_reqs for b in bs or ())
                                                  else "cuda_graph_max_bs")
                    first = info.remedy.split(", or ")[0]  # the first way: it must then be accepted
                    m = re.fullmatch(r"set cuda_graph_max_bs=(\d+)", first)
                    if m:
                        fixed = AttentionArgs(cuda_graph_bs=bs, cuda_graph_max_bs=int(m.group(1)))
                    else:
                        m = re.match(r"drop ([\d, ]+) from cuda_graph_bs( \(keeping [\d, ]+\))?"
                                     r"( and drop cuda_graph_max_bs)?$", first)
                        assert m and bool(m.group(3)) == bool(top), first
                        keep = [b for b in bs if str(b) not in m.group(1).split(", ")]
                        if not keep:  # dropping every size leaves no list: the remedy's other way (max_reqs)
                            continue
                        fixed = AttentionArgs(cuda_graph_bs=keep, cuda_graph_max_bs=None)
                    assert capture_batch_sizes(fixed, max_reqs)
                    continue
                assert ok, (bs, top, max_reqs, sizes)
                assert sizes and max(sizes) <= max_reqs and (not top or max(sizes) <= top)
                cap = top or max_reqs  # sglang's series (1, 2, 4, 8, then every 8th) up to the max, restated
                assert sizes == (sorted(set(bs)) if bs else [b for b in [1, 2, 4, 8, *range(16, 41, 8)] if b <= cap])


@pytest.mark.parametrize("args,dev,names,want", [
    (AttentionArgs(disable_cuda_graph=True), "cuda", ["flashinfer"], "disable_cuda_graph"),
    (AttentionArgs(), "cpu", ["torch_native"], "CUDA graphs need a CUDA device"),
    (AttentionArgs(), "cuda", ["torch_native"], "'torch_native' cannot be captured in a CUDA graph"),
    (AttentionArgs(), "cuda", ["flashinfer"], None),
])
def test_skip_reason(args, dev, names, want):
    got = skip_reason(args, dev, names)
    assert got == want if want is None else want in got


def test_compat_adapter_exposes_sglang_attributes(qwen):
    from pipeline.setup.build import ModelRunnerAttention

    req = SetupRequest(model=qwen, device="cpu", pool=POOL)
    m = ModelRunnerAttention(req, platform=FakePlatform(cpu_facts()))
    assert (m.attn_backend, m.decode_attn_backend, m.decode_attn_backend_group) == (None, None, [])
    m.init_attention_backends()
    assert type(m.attn_backend).__name__ == "TorchNativeBackend" and m.decode_attn_backend is None
    assert m.attn_backend.decode_attention_backend_str == m.decode_attention_backend_str == "torch_native"
    with pytest.raises(OrderingError, match="already ran"):
        m.init_attention_backends()
    assert m.close()
    with pytest.raises(BackendClosed, match=r"ModelRunnerAttention\.attn_backend was read after close\(\)"):
        m.attn_backend


def test_runner_trace_reads_and_replays(qwen, tmp_path):
    from pipeline.observe.replay import replay
    from pipeline.observe.trace import read_trace

    req = SetupRequest(model=qwen, device="cpu", pool=POOL)
    with Runner(RunnerConfig(request=req, num_layers=1), log_file=str(tmp_path / "r.jsonl")) as r:
        r.initialize()
    t = read_trace(tmp_path / "r.jsonl")
    assert t.skipped_lines == 0 and t.runs[0].status == "ok"
    assert [s["state"] for s in t.runs[0].states()][-1] == "done"
    assert replay(tmp_path / "r.jsonl").same


@pytest.mark.parametrize("flags,code,flag", [
    (["--num-layers", "0"], 2, "--num-layers"), (["--mem-fraction", "1.5"], 2, "--mem-fraction"),
    (["--mem-bytes", "5000"], 3, "--mem-bytes"), (["--mem-fraction", "0.5", "--mem-bytes", "1"], 2, None),
])
def test_cli_budget_and_layer_flags_refused(tmp_path, flags, code, flag):
    import json

    from conftest import run_main

    proc = run_main("run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "l.jsonl"), *flags)
    assert proc.returncode == code, proc.stderr[-1500:]
    err = json.loads(proc.stdout)["error"]
    assert err["remedy"] and (flag is None or flag in [f["name"] for f in err["flags"]])


def test_cli_mem_bytes_sizes_the_pool(tmp_path):
    from conftest import run_main

    proc = run_main("run", "--device", "cpu", "--json", "--num-layers", "3", "--mem-bytes", str(8 << 20),
                    "--log-file", str(tmp_path / "l.jsonl"))
    assert proc.returncode == 0, proc.stderr[-1500:]
    recs = [wire.decode_line(x) for x in (tmp_path / "l.jsonl").read_bytes().splitlines()]
    sized = next(r for r in recs if isinstance(r, ev.MemoryPoolSized))
    per_tok = 3 * 8 * 2 * 128 * 2   # llama: 3 layers x Hkv 8 x (K+V) 128 dims x bf16
    assert (sized.source, sized.bytes_per_token) == ("bytes", per_tok)
    assert sized.num_token_slots == ((8 << 20) - 8 * 1024 * 4) // per_tok
    loaded = next(r for r in recs if isinstance(r, ev.ModelLoaded))
    assert (loaded.num_layers, loaded.num_hidden_layers) == (3, 32)
