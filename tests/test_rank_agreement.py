"""Many ranks agree on the whole configuration, balance free memory, and name the rank that stalls.

Two torchrun launches (2 and 4 processes, gloo on CPU) run every scenario of
``tests/dist_rank_worker.py`` over one process group each, under a hard subprocess timeout.
The 2-process launch flips every digest field and every attention arg once; the 4-process launch
repeats one flip of each kind, the memory imbalance and the stall with four tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.model_spec import load_model_spec
from pipeline.setup.distributed import check_memory_balance, digest_fields, max_imbalance_from
from pipeline.setup.rank_watch import heartbeat_interval
from pipeline.core.errors import MemoryImbalance, UsageError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_rank_worker import FLIPS, INSTALLED, MODEL, POOL  # noqa: E402

WORKER = Path(__file__).resolve().parent / "dist_rank_worker.py"
TIMEOUT_S = 3.0
HB_S = heartbeat_interval(TIMEOUT_S)
FLIP_SCENARIOS = [f"flip:{f}" for f in FLIPS]
TWO = ["agree", *FLIP_SCENARIOS, "mem_low:0", "mem_even", "stall"]
FOUR = ["agree", "flip:pool.max_reqs", "flip:versions.torch", "flip:args.page_size", "mem_low:2", "stall"]


def _launch(tmp: Path, n: int, scenarios: list[str]) -> Path:
    env = {**os.environ, "EXCHANGE_TIMEOUT_S": str(TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           str(WORKER), ",".join(scenarios), str(tmp)], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("ranks2"), 2, TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    return _launch(tmp_path_factory.mktemp("ranks4"), 4, FOUR)


def results(out: Path, sc: str, n: int) -> list[dict]:
    return [json.loads((out / f"result.{sc}.rank{r}.json").read_text()) for r in range(n)]


def trace(out: Path, sc: str, r: dict) -> list[ev.Event]:
    path = out / sc / f"{r['group_run_id']}.rank{r['rank']}.jsonl"
    return [wire.decode_line(x) for x in path.read_bytes().splitlines()]


def _flags(r: dict) -> dict:
    return {f["name"]: f["value"] for f in r["error"]["flags"]}


def test_the_corpus_flips_every_digest_field_and_every_arg():
    """The scenario table covers every field digest_fields reports (but nothing that may differ) and every arg."""
    req = SetupRequest(model=MODEL, device="cpu", rank=0, world_size=2, pool=PoolFacts(**POOL))
    fields = set(digest_fields(req, INSTALLED))
    want = fields | {f"args.{f}" for f in AttentionArgs.__struct_fields__}
    assert want == set(FLIPS) | {f for f in fields if f.startswith("versions.") or f == "capabilities"}
    assert {f for f in fields if f.startswith("versions.")} >= {"versions.torch", "versions.attn-setup"}


def _check_divergence(out: Path, sc: str, n: int) -> None:
    field = sc.partition(":")[2]
    rs = results(out, sc, n)
    odd = n - 1
    for r in rs:
        assert r["ok"] is False, (sc, r)
        if r["rank"] == odd and r["type"] != "RankDivergence":  # the odd rank may refuse its own flip first
            assert r["exit_code"] == 3, (sc, r)
            continue
        assert r["type"] == "RankDivergence" and r["exit_code"] == 3, (sc, r)
        assert r["seconds"] < TIMEOUT_S, (sc, r)
        flags = _flags(r)
        assert field in flags["diverging"], (sc, flags["diverging"])
        per_rank = flags[field]
        assert set(per_rank) == {str(i) for i in range(n)}
        assert len({json.dumps(per_rank[str(i)]) for i in range(odd)}) == 1  # the others agree
        msg = r["error"]["message"]
        from pipeline.setup.distributed import DERIVED_WORDS

        named = f"{field}: rank 0: " in msg or f"{DERIVED_WORDS.get(field, field)} (derived from " in msg
        assert per_rank[str(odd)] != per_rank["0"] and named, msg   # a derived field names what it follows from
        recs = trace(out, sc, r)
        assert not any(isinstance(x, (ev.BackendBuilt, ev.BuildPlanned)) for x in recs)
        assert isinstance(recs[-1], ev.RunFailed) and recs[-1].error.code == "rank_divergence"


@pytest.mark.parametrize("sc", FLIP_SCENARIOS)
def test_each_flip_fails_every_rank_naming_the_field_2_ranks(two, sc):
    _check_divergence(two, sc, 2)


@pytest.mark.parametrize("sc", [s for s in FOUR if s.startswith("flip:")])
def test_flips_with_4_ranks(four, sc):
    _check_divergence(four, sc, 4)


@pytest.mark.parametrize("n", [2, 4])
def test_agreeing_ranks_pass_and_skip_the_cpu_memory_check(two, four, n):
    out = two if n == 2 else four
    for r in results(out, "agree", n):
        assert r["ok"], r
        recs = trace(out, "agree", r)
        agreed = [x for x in recs if isinstance(x, ev.ResolutionAgreed)]
        assert len(agreed) == 1 and [row.rank for row in agreed[0].table] == list(range(n))
        assert any(isinstance(x, ev.StepSkipped) and x.what == "memory_balance" for x in recs)


@pytest.mark.parametrize("n,low", [(2, 0), (4, 2)])
def test_memory_imbalance_fails_every_rank_naming_the_low_one(two, four, n, low):
    out = two if n == 2 else four
    for r in results(out, f"mem_low:{low}", n):
        assert r["type"] == "MemoryImbalance" and r["exit_code"] == 1, r
        flags = _flags(r)
        assert flags["low_rank"] == low
        assert flags["free_bytes"] == {str(i): (40 if i == low else 80) << 30 for i in range(n)}
        assert flags["max_imbalance"] == 0.1 and r["error"]["state"] == "device-init"
        assert f"rank {low} has 40.00 GiB free, the most is 80.00 GiB" in r["error"]["message"]
        recs = trace(out, f"mem_low:{low}", r)
        assert not any(isinstance(x, (ev.BackendsResolved, ev.BuildPlanned)) for x in recs)


def test_balanced_memory_is_recorded(two):
    for r in results(two, "mem_even", 2):
        assert r["type"] == "InjectedFault", r  # the test stops every rank at resolve
        bal = [x for x in trace(two, "mem_even", r) if isinstance(x, ev.MemoryBalanced)]
        assert len(bal) == 1 and bal[0].free_bytes == [80 << 30, 80 << 30] and bal[0].max_imbalance == 0.1


@pytest.mark.parametrize("n", [2, 4])
def test_stalled_rank_is_named_by_every_other_rank_in_time(two, four, n):
    """The last rank sleeps in resolve; every other rank fails with rank_stalled within timeout + one heartbeat."""
    out = two if n == 2 else four
    rs = results(out, "stall", n)
    stalled = n - 1
    for r in rs[:stalled]:
        assert r["type"] == "RankStalled" and r["exit_code"] == 1, r
        flags = _flags(r)
        assert flags["stalled_rank"] == stalled and flags["last_state"] == "resolve"
        assert flags["doing"] == "injected sleep at state:resolve"
        assert 0 <= flags["seconds_since_heartbeat"] <= 2 * HB_S + 0.5  # it is alive: it keeps beating
        assert r["seconds"] < TIMEOUT_S + HB_S + 2.0  # device-init + memory exchange + the wait
        recs = trace(out, "stall", r)
        st = [x for x in recs if isinstance(x, ev.RankStalled)]
        assert [x.stalled_rank for x in st] == [stalled] and st[0].waiting_at == "the resolution exchange"
        assert TIMEOUT_S <= st[0].waited_s <= TIMEOUT_S + HB_S + 0.25
        assert isinstance(recs[-1], ev.RunFailed) and recs[-1].error.code == "rank_stalled"


def test_memory_balance_rule_matches_sglang():
    """sglang refuses min_free < 0.9 * local_free; the boundary itself passes."""
    check_memory_balance([90, 100], 0.1, rank=0)
    with pytest.raises(MemoryImbalance) as ei:
        check_memory_balance([100, 89, 100], 0.1, rank=2)
    assert ("low_rank", 1) in [(f.name, f.value) for f in ei.value.info.flags]
    check_memory_balance([1, 100], 1.0, rank=0)


ENV_SPREAD = "ATTN_SETUP_MAX_MEMORY_IMBALANCE"


@pytest.mark.parametrize("value,env,want", [(None, {}, 0.1), (0.25, {}, 0.25), (None, {ENV_SPREAD: "0.3"}, 0.3),
                                            (0.2, {ENV_SPREAD: "0.3"}, 0.2)])
def test_imbalance_flag_then_env_then_default(value, env, want):
    assert max_imbalance_from(value, env) == want


@pytest.mark.parametrize("value,env,name", [(1.5, {}, "--max-memory-imbalance"), (-0.1, {}, "--max-memory-imbalance"),
                                            (None, {"ATTN_SETUP_MAX_MEMORY_IMBALANCE": "lots"},
                                             "ATTN_SETUP_MAX_MEMORY_IMBALANCE")])
def test_bad_imbalance_is_refused_naming_it(value, env, name):
    with pytest.raises(UsageError) as ei:
        max_imbalance_from(value, env)
    assert ei.value.info.flags[0].name == name and ei.value.info.remedy


# -- inspect over several ranks' logs ---------------------------------------------------------------

GOLDEN = Path(__file__).parent / "data" / "golden"


def _inspect(capsys, *paths, json_out=True):
    from pipeline.cli import main

    code = main(["inspect", *map(str, paths), *(["--json"] if json_out else [])])
    out = capsys.readouterr().out
    return code, (json.loads(out) if json_out else out)


def _raw_durations(path: Path, event: str) -> dict[str, float]:
    """Per state, ms spent in it, read straight from the raw transition lines (from → duration)."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == event and rec["from"] != "failed":
            out[rec["from"]] = rec["duration_ms"]
    return out


@pytest.mark.parametrize("pair,event", [(("tp2_rank0", "tp2_rank1"), "state_transition"),
                                        (("tp2_mismatch_rank0", "tp2_mismatch_rank1"), "state_transition"),
                                        (("tp2_torchrun_rank0", "tp2_torchrun_rank1"), "runner_transition")])
def test_critical_path_is_the_slowest_rank_per_state(capsys, pair, event):
    """Setup-machine traces use its states; a torchrun `attn-setup run` pair uses the runner's."""
    paths = [GOLDEN / f"{p}.jsonl" for p in pair]
    code, out = _inspect(capsys, *paths[::-1])
    raw = [_raw_durations(p, event) for p in paths]
    (cp,) = out["critical_path"]
    rows = {r["state"]: r for r in cp["states"]}
    for state in set(raw[0]) | set(raw[1]):
        got = [raw[r].get(state, -1.0) for r in (0, 1)]
        want_rank = 0 if got[0] >= got[1] else 1
        assert rows[state]["rank"] == want_rank and rows[state]["duration_ms"] == pytest.approx(max(got), abs=1e-3)
    assert cp["total_ms"] == pytest.approx(sum(r["duration_ms"] for r in cp["states"]), abs=1e-2)
    assert [r["rank"] for r in out["ranks"]] == [0, 1] and all(r["waited_for"] == [] for r in out["ranks"])
    code, text = _inspect(capsys, *paths, json_out=False)
    assert f"critical path of run {cp['run_id']}" in text and "total" in text


def test_single_rank_log_has_no_critical_path(capsys):
    _, out = _inspect(capsys, GOLDEN / "ok_tbo.jsonl")
    assert out["critical_path"] == [] and out["ranks"] == []


def test_inspect_names_the_stalled_rank_and_its_last_state(two, capsys):
    rs = results(two, "stall", 2)
    paths = [two / "stall" / f"{r['group_run_id']}.rank{r['rank']}.jsonl" for r in rs]
    code, out = _inspect(capsys, *paths)
    assert code == 1
    r0, r1 = out["ranks"]
    assert r0["waited_for"] == [1] and r0["last_state"] == "resolve" and r0["status"] == "failed"
    (s,) = r0["stalled"]
    assert s["stalled_rank"] == 1 and s["last_state"] == "resolve" and s["doing"] == "injected sleep at state:resolve"
    assert r1["last_state"] == "resolve"
    (cp,) = out["critical_path"]
    resolve = next(x for x in cp["states"] if x["state"] == "resolve")
    assert resolve["rank"] == 1 and resolve["duration_ms"] > (TIMEOUT_S + 1.5) * 1e3  # it slept in resolve
    _, text = _inspect(capsys, *paths, json_out=False)
    assert "rank 0: failed, last state resolve · waited for rank 1 (last state 'resolve'" in text


# -- in-process: the watch over a shared store (no processes) ---------------------------------------


def test_jit_compile_is_what_a_stalled_rank_reports_doing():
    """Rank 1 compiles a FlashInfer variant (fake loader) and never arrives; rank 0 names it and what it compiles."""
    import threading
    import time as _time

    import torch.distributed as dist

    from pipeline.core.errors import RankStalled
    from pipeline.backends.flashinfer.jit import Variant, ensure_compiled
    from pipeline.setup.rank_watch import Watch
    from pipeline.core.heartbeat import current_doing

    store = dist.HashStore()
    w0, w1 = Watch(store, 0, 2, 0.5, "t"), Watch(store, 1, 2, 0.5, "t")
    seen, started = {}, threading.Event()
    v = Variant(kind="decode", backend="cuda_core", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=128,
                head_dim_vo=128)

    def compile_slowly(_v):
        seen["doing"] = current_doing()
        w1.beat("build-mode")
        started.set()
        _time.sleep(0.9)

    t = threading.Thread(target=lambda: ensure_compiled(v, loader=compile_slowly, cached=lambda _: False))
    t.start()
    started.wait(5)
    t0 = _time.monotonic()
    with pytest.raises(RankStalled) as ei:
        w0.wait_all("the pre-capture barrier", "capture-cuda-graphs")
    waited = _time.monotonic() - t0
    t.join()
    flags = {f.name: f.value for f in ei.value.info.flags}
    assert seen["doing"] == f"compiling FlashInfer JIT variant {v.name}" == flags["doing"]
    assert flags["stalled_rank"] == 1 and flags["last_state"] == "build-mode" and flags["timeout_s"] == 0.5
    assert 0.5 <= waited <= 0.5 + heartbeat_interval(0.5) + 0.2
    assert current_doing() == ""  # the mark ends with the compile


def test_a_rank_that_recorded_no_request_is_not_compared():
    from types import SimpleNamespace

    from pipeline.observe.ranks import RankDifferences

    class R(SimpleNamespace):
        def decisions(self):
            return dict(self.d)

    started = SimpleNamespace(request={"args": {"page_size": 1}})
    rd = RankDifferences()
    rd.add(R(run_id="x", rank=0, started=started, d={"resolve": {"prefill": "torch_native"}}))
    rd.add(R(run_id="x", rank=1, started=None, d={}))
    assert rd.finish() == []
    rd.add(R(run_id="y", rank=0, started=started, d={"resolve": {"prefill": "torch_native"}}))
    rd.add(R(run_id="y", rank=1, started=started, d={"resolve": {"prefill": "triton"}}))
    assert [f["key"] for f in rd.finish()] == ["resolve.prefill"]
