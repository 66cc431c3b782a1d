"""``slow_phase`` warnings come as each phase ends, tagged with that phase.

They all came at the end, tagged ``ready``. Now each phase that ends during the run is judged when the record that
ends it is logged; only the phases known at the end (verification, model-steps, release, JIT variants) come with the
summary — still tagged with their own phase.
"""

from __future__ import annotations

from pipeline.cli import main
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.eventlog import EventLog
from pipeline.observe.startup import SlowPhaseWatch, phase_state
from pipeline.observe.startup import emit_summary

AT_END = {("verification", ""), ("model-steps", ""), ("release", "")}


def _records(path):
    return [wire.decode_line(x) for x in path.read_bytes().splitlines()]


def test_each_slow_phase_follows_the_record_that_ended_it(tmp_path, capsys):
    """A CPU run with a tiny threshold: a runner state's warning comes right after its runner_transition (state =
    the phase), before the next phase's records; none is tagged 'ready' unless it is about ready; the set of
    warnings is still exactly the summary's phases above the threshold."""
    log = tmp_path / "a.jsonl"
    code = main(["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1", "--log-file", str(log),
                 "--slow-phase-s", "1e-6", "--json"])
    capsys.readouterr()
    assert code == 0
    recs = _records(log)
    slow = [(i, r) for i, r in enumerate(recs) if isinstance(r, ev.SlowPhase)]
    summary = next(r for r in recs if isinstance(r, ev.StartupSummary))
    assert sorted((r.phase, r.parent) for _, r in slow) == \
        sorted((p.name, p.parent) for p in summary.phases if p.seconds > 1e-6)
    by_phase = {(r.phase, r.parent): (i, r) for i, r in slow}
    for j, t in enumerate(recs):
        if isinstance(t, ev.RunnerTransition) and t.duration_ms > 1e-3:
            i, r = by_phase[(t.from_state, "")]
            assert i == j + 1 and r.state == t.from_state, (t, r)
    i, r = by_phase[("load-model", "")]
    assert i < next(k for k, x in enumerate(recs) if isinstance(x, ev.MemoryPoolSized))  # before the next phase's
    assert i < recs.index(summary)
    assert all(r.state != "ready" for _, r in slow)
    assert all(by_phase[k][1].state == k[0] for k in AT_END if k in by_phase)
    # a retrospective record does not move the run's state: the record after a warning keeps the run's own
    assert recs[by_phase[("load-model", "")][0] + 1].state == "init-memory-pool"


def test_watch_judges_each_phase_once_and_summary_judges_the_rest(tmp_path):
    """The watch warns when a transition ends a slow phase and records what it judged; emit_summary warns only
    for the phases the watch never judged, tagged with their phase, and the log's current state is not moved."""
    log = EventLog("r", path=None)
    watch = SlowPhaseWatch(log, 0.5).install()
    log.emit(ev.RunnerStarted, state="init-distributed", config={})
    log.emit(ev.RunnerTransition, state="load-model", from_state="init-distributed", to="load-model",
             trigger="distributed_ready", duration_ms=10.0)
    log.emit(ev.RunnerTransition, state="init-memory-pool", from_state="load-model", to="init-memory-pool",
             trigger="model_loaded", duration_ms=900.0)
    warned = [r for r in log.records if isinstance(r, ev.SlowPhase)]
    assert [(r.phase, r.state, r.seconds) for r in warned] == [("load-model", "load-model", 0.9)]
    assert log.records[-1] is warned[0] and log.current_state == "init-memory-pool"
    assert watch.seen == {("init-distributed", ""), ("load-model", "")}
    emit_summary(log, start_ns=None, slow_s=0.5, judged=watch.seen)
    assert len([r for r in log.records if isinstance(r, ev.SlowPhase)]) == 1  # load-model not warned twice


def test_without_a_watch_the_summary_tags_each_warning_with_its_phase():
    """A library caller of emit_summary (no watch): the warnings still carry their phase as state, never the
    state the run ended in."""
    log = EventLog("r", path=None)
    log.emit(ev.RunnerStarted, state="init-distributed", config={})
    log.emit(ev.RunnerTransition, state="ready", from_state="load-model", to="ready", trigger="t", duration_ms=900.0)
    emit_summary(log, start_ns=None, slow_s=0.5)
    warned = [r for r in log.records if isinstance(r, ev.SlowPhase)]
    assert [(r.phase, r.state) for r in warned] == [("load-model", "load-model")]


def test_phase_state_names_the_phase_or_its_parent():
    """States and top-level phases are their own state; other children take their parent's."""
    assert phase_state("load-model", "") == "load-model"
    assert phase_state("resolve", "attention") == "resolve"
    assert phase_state("bs=8", "capture-cuda-graphs") == "capture-cuda-graphs"
    assert phase_state("primary", "verification") == "verification"
    assert phase_state("import torch", "startup") == "startup"
