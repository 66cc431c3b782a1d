"""Adversarial pass #5's findings, each followed through: a symbolic-link remedy that names the path to pass from
here (the link's text is relative to its folder) and says so when the link points to a directory; a page-multiple
remedy that also holds run's verification batches; a budget remedy that offers lowering only what can go lower;
``inspect``'s rank differences without a rank that never recorded its request."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_main

from pipeline.core.errors import UsageError
from pipeline.core.files import refuse_symlink


def test_a_relative_link_remedy_names_the_path_from_here_and_following_it_writes_the_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "target.prom").write_text("")
    os.symlink("target.prom", tmp_path / "d" / "rel.prom")
    with pytest.raises(UsageError) as e:
        refuse_symlink("d/rel.prom", flag="--metrics-file", what="--metrics-file")
    remedy = e.value.info.remedy
    assert "'d/target.prom'" in remedy, remedy
    refuse_symlink("d/target.prom", flag="--metrics-file", what="--metrics-file")   # the path it names is no link


def test_a_link_to_a_directory_is_not_offered_as_the_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "realdir").mkdir()
    os.symlink("realdir", tmp_path / "dlink")
    with pytest.raises(UsageError) as e:
        refuse_symlink("dlink", flag="--perfetto", what="--perfetto")
    assert "points to a directory" in e.value.info.remedy and "pass the link's target" not in e.value.info.remedy


@pytest.mark.parametrize("page,given", [(16, 1), (16, 1000), (4096, 1), (64, 65)])
def test_the_page_multiple_named_then_plans(page, given):
    proc = run_main("plan", "--device-profile", "cpu", "--page-size", str(page), "--num-token-slots", str(given),
                    "--json")
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert proc.returncode == 3 and err["code"] == "invalid_value", err
    fix = err["remedy"].split("--num-token-slots ", 1)[1].split()[0]
    assert int(fix) % page == 0 and int(fix) >= given
    proc = run_main("plan", "--device-profile", "cpu", "--page-size", str(page), "--num-token-slots", fix, "--json")
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("max_reqs,ctx,tail", [(1, 12, ""), (2, 40, ", or lower max_reqs or max_context_len"),
                                               (1, 40, ", or lower max_context_len"), (4, 12, ", or lower max_reqs")])
def test_a_budget_remedy_offers_only_what_can_go_lower(max_reqs, ctx, tail):
    from pipeline.core.errors import ConfigError
    from pipeline.memory.pools import size_pools

    with pytest.raises(ConfigError) as e:
        size_pools([], 1, "bfloat16", page_size=1, max_reqs=max_reqs, max_context_len=ctx, budget_bytes=1,
                   min_slots=72, min_context_len=12)
    assert e.value.info.code == "pool_budget_too_small" and e.value.info.remedy.endswith(f"bytes{tail}"), \
        e.value.info.remedy


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


@pytest.mark.parametrize("var", ["ATTN_SETUP_SLOW_PHASE_S", "ATTN_SETUP_DIST_TIMEOUT", "ATTN_SETUP_MAX_MEMORY_IMBALANCE"])
@pytest.mark.parametrize("text", ["٣", "３", "0_5"])
def test_the_variables_take_ascii_numbers_as_their_flags_do(var, text, monkeypatch):
    """``ATTN_SETUP_DIST_TIMEOUT=٣`` was taken as 3 s (Python's float() reads any Unicode digit), while
    ``--dist-timeout ٣`` is refused; each variable is now refused naming itself and the value as set."""
    from pipeline.observe.startup import slow_threshold
    from pipeline.setup.distributed import max_imbalance_from
    from pipeline.setup.rank_watch import timeout_from_env

    monkeypatch.setenv(var, text)
    read = {"ATTN_SETUP_SLOW_PHASE_S": lambda: slow_threshold(None),
            "ATTN_SETUP_DIST_TIMEOUT": lambda: timeout_from_env(60.0),
            "ATTN_SETUP_MAX_MEMORY_IMBALANCE": lambda: max_imbalance_from(None)}[var]
    with pytest.raises(UsageError) as e:
        read()
    assert e.value.exit_code == 2 and var in e.value.info.message and text in e.value.info.message


def test_a_blank_slow_phase_variable_is_unset_as_the_others(monkeypatch):
    from pipeline.observe.startup import slow_threshold
    from pipeline.setup.rank_watch import timeout_from_env

    monkeypatch.setenv("ATTN_SETUP_SLOW_PHASE_S", " ")
    monkeypatch.setenv("ATTN_SETUP_DIST_TIMEOUT", " ")
    assert slow_threshold(None) is None and timeout_from_env(60.0) == 60.0


def test_a_secret_equal_to_a_state_name_leaves_the_transitions_alone(tmp_path):
    """``ATTN_SETUP_SECRET_TOK=ready`` rewrote ``runner_transition.to`` to ``<redacted>`` (inspect then showed a
    ``<redacted>`` state); a transition's states and trigger are machine names, kept, while free text is still
    redacted."""
    from pipeline.core import events as ev
    from pipeline.core.eventlog import EventLog

    path = tmp_path / "t.jsonl"
    log = EventLog("r1", 0, path, secrets=("ready",))
    log.emit(ev.RunnerTransition, state="capture-cuda-graphs", from_state="capture-cuda-graphs", to="ready",
             trigger="graphs_settled", duration_ms=1.0, outcome="ok")
    log.emit(ev.CommandStarted, state="args", command="run", argv=["--note", "is ready"])
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert recs[0]["to"] == "ready" and recs[0]["from"] == "capture-cuda-graphs"
    assert recs[1]["argv"] == ["--note", "is <redacted>"]
