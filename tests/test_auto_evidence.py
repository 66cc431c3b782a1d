"""auto by measurement: the measured table's writer and loader, the order it gives, and what plan reports.

The table (pipeline/data/auto_evidence.json, written by benchmarks/auto_evidence.py) moves the fastest capable
backend first only where its device class, phase, layer kind, KV dtype and package versions match; else the fixed
priority stands and the evidence says "unmeasured". Independent reference: the fixed priority itself (a plan
without a matching table) and the capability records (an incapable backend never comes first).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_json
from states import evidence

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS = str(ROOT / "examples" / "configs" / "gpt-oss-20b.json")
HERE = {"torch": "2.13.0", "triton": "3.9.0", "flashinfer-python": "0.7.2"}
INSTALLED = ",".join(f"{k}=={v}" for k, v in HERE.items())
EXCLUDED = {"torch_native": "the reference"}


def _table(versions=HERE, **row) -> evidence.Table:
    r = dict(device_class="h200", phase="decode", layer_kind="sinks", kv_dtype="16bit",
             shape="B=64 ctx=4096 window=128 sinks H=64/8 D=64", times_us={"flashinfer": 151.0, "triton": 100.0},
             excluded=EXCLUDED)
    return evidence.Table(date="2026-12-02", gpu="NVIDIA H200", device_class="h200", arch="sm90",
                          versions=dict(versions), rows=[evidence.Row(**{**r, **row})])


@pytest.fixture
def table_at(tmp_path, monkeypatch):
    """Write a table where plan reads it (evidence.DATA_PATH)."""
    def put(t: evidence.Table) -> None:
        path = tmp_path / "auto_evidence.json"
        evidence.write(t, path)
        monkeypatch.setattr(evidence, "DATA_PATH", path)
    return put


def _plan(*extra: str) -> dict:
    rc, out = run_json("plan", "--model", GPT_OSS, "--device-profile", "h200", "--installed", INSTALLED, *extra)
    assert rc == 0, out
    return out["resolved"]


_name = st.text("abcdefghij_", min_size=1, max_size=8)
_rows = st.builds(evidence.Row, device_class=_name, phase=st.sampled_from(["prefill", "decode"]),
                  layer_kind=st.sampled_from(list(evidence.LAYER_KINDS)), kv_dtype=_name, shape=st.text(max_size=20),
                  times_us=st.dictionaries(_name, st.floats(0.001, 1e6), max_size=3),
                  failed=st.dictionaries(_name, st.text(max_size=20), max_size=2), relative=st.booleans())


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(_rows, max_size=4), versions=st.dictionaries(_name, _name, max_size=3))
def test_table_round_trips(tmp_path_factory, rows, versions):
    """What write() writes, load() reads back equal (the writer and loader of benchmarks/auto_evidence.py)."""
    t = evidence.Table(date="2026-12-02", gpu="NVIDIA H200", device_class="h200", arch="sm90", versions=versions,
                       rows=rows)
    path = tmp_path_factory.mktemp("ev") / "t.json"
    evidence.write(t, path)
    assert evidence.load(path) == t


def test_matching_versions_put_the_measured_fastest_first(table_at):
    """gpt-oss on the H200: the fixed priority serves decode with flashinfer; the row (triton 1.51x faster on
    sink layers, same versions) puts triton first, and the JSON evidence says so exactly."""
    table_at(_table(versions={"torch": "2.11.0"}))  # another torch: the fixed priority
    fixed = _plan()
    assert fixed["decode"] == "flashinfer" and fixed["evidence"]["decode"] == "unmeasured"
    table_at(_table())
    res = _plan()
    assert res["decode"] == "triton" and res["rules"]["decode"] == "auto"
    assert res["evidence"]["decode"] == {"source": "benchmarks/auto_evidence.py, 2026-12-02", "device": "NVIDIA H200",
                                         "versions": HERE, "next": "flashinfer", "ratio_vs_next": 1.51}
    assert res["evidence"]["prefill"] == "unmeasured"  # no prefill row
    assert res["evidence_text"]["decode"] == ("decode: triton — 1.51× flashinfer for sink layers on NVIDIA H200 "
                                              "(benchmarks/auto_evidence.py, 2026-12-02)")


def test_mismatched_versions_keep_the_fixed_priority(table_at):
    """FlashInfer compared exactly: a table measured on 0.6.13 does not apply to 0.7.2 and says why."""
    table_at(_table(versions={**HERE, "flashinfer-python": "0.6.13"}))
    res = _plan()
    assert res["decode"] == "flashinfer" and res["evidence"]["decode"] == "unmeasured"
    assert "measured on flashinfer-python 0.6.13, installed 0.7.2" in res["evidence_text"]["decode"]


def test_torch_and_triton_match_by_major_minor(table_at):
    table_at(_table(versions={**HERE, "torch": "2.13.1+cu130", "triton": "3.9.5"}))
    assert _plan()["decode"] == "triton"
    table_at(_table(versions={**HERE, "triton": "3.8.0"}))
    assert _plan()["decode"] == "flashinfer"


def test_a_winner_within_noise_keeps_the_fixed_priority(table_at):
    """Triton measured 1.01x faster (decode on the H200, FlashInfer 0.7.2) is within run-to-run noise: flashinfer,
    the priority's choice, stays, with the measurement and the reason; 1.05x is enough to move."""
    table_at(_table(times_us={"flashinfer": 268.6, "triton": 266.0}))
    res = _plan()
    assert res["decode"] == "flashinfer" and res["evidence"]["decode"]["next"] == "triton"
    assert res["evidence"]["decode"]["ratio_vs_next"] == round(266.0 / 268.6, 3)
    assert "less than 1.05× faster: the fixed priority stands" in res["evidence_text"]["decode"]
    table_at(_table(times_us={"flashinfer": 105.0, "triton": 100.0}))
    assert _plan()["decode"] == "triton"


def test_explicit_flag_wins(table_at):
    table_at(_table())
    res = _plan("--decode-attention-backend", "flashinfer")
    assert res["decode"] == "flashinfer" and res["evidence"]["decode"] == "explicit"


def test_capability_still_decides(table_at):
    """A faster backend the records refuse (fa3: no sinks, head dim 64) is never put first and needs no time; the
    candidates refused are the fixed priority's (the winner takes the first capable one's place)."""
    argv = ("plan", "--model", GPT_OSS, "--device-profile", "h200", "--installed", INSTALLED)
    table_at(_table(versions={**HERE, "triton": "3.8.0"}))
    fixed = run_json(*argv)[1]
    table_at(_table(times_us={"fa3": 1.0, "flashinfer": 151.0, "triton": 100.0}))
    out = run_json(*argv)[1]
    assert out["resolved"]["decode"] == "triton" and out["resolved"]["evidence"]["decode"]["next"] == "flashinfer"
    assert out["rejected"] == fixed["rejected"]


def test_a_failed_measurement_is_unmeasured(table_at):
    table_at(_table(times_us={"triton": 100.0}, failed={"flashinfer": "RuntimeError('jit')"}))
    res = _plan()
    assert res["decode"] == "flashinfer" and "flashinfer: RuntimeError('jit')" in res["evidence_text"]["decode"]


def test_unknown_versions_are_unmeasured(table_at):
    """``--installed NAME`` assumes a package without its version: the row cannot be checked."""
    table_at(_table())
    rc, out = run_json("plan", "--model", GPT_OSS, "--device-profile", "h200", "--installed", "torch,triton,flashinfer")
    assert rc == 0 and out["resolved"]["evidence"]["decode"] == "unmeasured"
    assert "installed torch version is not known" in out["resolved"]["evidence_text"]["decode"]


def test_shipped_table_applies_with_its_versions_and_not_with_others():
    """The shipped table loads, is stamped with date, GPU and versions; planned with those versions on its device
    class, gpt-oss decode carries the measured evidence (the row's times), and with another FlashInfer it is
    unmeasured."""
    t = evidence.load()
    assert isinstance(t, evidence.Table) and t.gpu and t.date and set(t.versions) >= {"torch", "triton",
                                                                                      "flashinfer-python"}
    row = next(r for r in t.rows if r.phase == "decode" and r.layer_kind == "sinks")
    best, nxt = sorted(row.times_us, key=row.times_us.get)[:2]
    pins = {**t.versions}
    rc, out = run_json("plan", "--model", GPT_OSS, "--device-profile", t.device_class, "--installed",
                       ",".join(f"{k}=={v}" for k, v in pins.items()))
    ev = out["resolved"]["evidence"]["decode"]
    assert rc == 0 and out["resolved"]["decode"] == best and ev["next"] == nxt
    assert ev["ratio_vs_next"] == round(row.times_us[nxt] / row.times_us[best], 3) and ev["versions"] == t.versions
    pins["flashinfer-python"] = "0.7.1"
    rc, out = run_json("plan", "--model", GPT_OSS, "--device-profile", t.device_class, "--installed",
                       ",".join(f"{k}=={v}" for k, v in pins.items()))
    assert rc == 0 and out["resolved"]["evidence"]["decode"] == "unmeasured"


def test_benchmark_dry_run_writes_a_table_plan_reads(tmp_path, monkeypatch):
    """benchmarks/auto_evidence.py --dry-run (fake timings, no GPU) writes a table the loader reads, with a row per
    case and the failures recorded as failed."""
    spec = importlib.util.spec_from_file_location("auto_evidence", ROOT / "benchmarks" / "auto_evidence.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    assert mod.main(["--dry-run", "--out", str(out)]) == 0
    t = evidence.load(out)
    assert isinstance(t, evidence.Table)
    keys = {(r.phase, r.layer_kind, r.kv_dtype) for r in t.rows}
    assert keys == {("decode", "full", "16bit"), ("decode", "sinks", "16bit"), ("decode", "softcap", "16bit"),
                    ("decode", "mla", "16bit"), ("decode", "full", "fp8_e4m3"), ("prefill", "full", "16bit")}
    assert all(r.times_us or r.failed for r in t.rows)
    assert t.rows[-1].failed == {"fa3": "RuntimeError('dry run: no GPU')"}  # recorded, not raised
    assert t.rows[-1].times_us == {"flashinfer": 157.0, "triton": 150.0}
    assert json.loads(out.read_text())["rows"][0]["source"] == "benchmarks/auto_evidence.py"


def test_backends_resolved_records_the_evidence_and_replay_rechecks_it(table_at, tmp_path):
    """The trace's backends_resolved holds the evidence; replay with the same table agrees, with other measured
    times (same choice, another ratio) it diverges at resolve / evidence."""
    import pipeline
    from pipeline import testing
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.core.model_spec import load_model_spec
    from pipeline.observe.replay import replay

    table_at(_table())
    req = SetupRequest(args=AttentionArgs(prefill_attention_backend="torch_native"), model=load_model_spec(GPT_OSS),
                       device="cuda:0", pool=pipeline.PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=64))
    path = tmp_path / "t.jsonl"
    testing.record_trace(req, path, facts=testing.cuda_facts(name="NVIDIA H200"), installed=HERE)
    rec = next(json.loads(x) for x in path.read_text().splitlines() if '"backends_resolved"' in x)
    assert rec["decode"] == "triton" and rec["evidence"]["decode"]["kind"] == "measured"
    assert rec["evidence"]["prefill"]["kind"] == "explicit"
    assert replay(path).divergence is None
    table_at(_table(times_us={"flashinfer": 120.0, "triton": 100.0}))
    d = replay(path).divergence
    assert (d.state, d.field) == ("resolve", "evidence")


def test_speculative_prefill_is_unmeasured_by_plain_extend_rows():
    """With EAGLE the prefill half serves target verify over trees, which the table's plain extend rows do not
    time: it keeps the fixed priority (flashinfer on the H200) and says why; without EAGLE the row applies."""
    t = evidence.load()
    argv = ("plan", "--device-profile", t.device_class, "--installed",
            ",".join(f"{k}=={v}" for k, v in t.versions.items()))
    eagle = ("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens",
             "8", "--speculative-num-steps", "3")
    rc, out = run_json(*argv, *eagle)
    res = out["resolved"]
    assert rc == 0 and res["prefill"] == "flashinfer" and res["evidence"]["prefill"] == "unmeasured"
    assert "not speculative target verify" in res["evidence_text"]["prefill"]
    rc, out = run_json(*argv)
    assert rc == 0 and isinstance(out["resolved"]["evidence"]["prefill"], dict)
