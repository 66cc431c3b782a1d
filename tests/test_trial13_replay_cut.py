"""``replay`` of a cut-off trace says where it ends instead of a false divergence (trial 13, finding 3).

``head -20 tbo.jsonl > inc.jsonl; attn-setup replay inc.jsonl`` (a good ``run`` log cut right after the transition
into npu-lazy-mem) said ``DIVERGED in state 'npu-lazy-mem', field 'setting.zbal_local_mem_size': recorded None, now
[0, 'default']``, exit 1, though ``inspect`` called the run incomplete: the records after the cut were never
written, not decided differently. Replay now compares only what was recorded, and a run that never recorded its end
and whose trace stops before its last decision is ``trace_incomplete``, exit 2 (replay's code for input it cannot
use, as ``nothing_to_replay``), naming the run and the state the trace ends in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.errors import UsageError
from pipeline.observe.replay import replay

GOLDEN = sorted((Path(__file__).resolve().parent / "data" / "golden").glob("*.jsonl"))


def _cut(src: Path, n: int, dst: Path) -> Path:
    dst.write_bytes(b"".join(src.read_bytes().splitlines(keepends=True)[:n]))
    return dst


@pytest.mark.parametrize("src", GOLDEN, ids=lambda p: p.stem)
def test_no_prefix_of_a_recorded_trace_diverges(src, tmp_path):
    """Every prefix of every golden trace (each replays the same whole) replays the same or is trace_incomplete,
    never a divergence: a value the cut left out is not compared."""
    assert replay(src).same
    lines = src.read_bytes().splitlines()
    for n in range(1, len(lines)):
        path = _cut(src, n, tmp_path / f"{n}.jsonl")
        try:
            got = replay(path)
        except UsageError as e:
            assert e.info.code == "trace_incomplete", (n, e.info.message)
            assert "the trace ends in state" in e.info.message and e.exit_code == 2
            continue
        assert got.same and not any(r.ends_in for r in got.runs), (n, got)


def _lazy_cut(tmp_path: Path) -> Path:
    """A recorded ``run`` log cut right after its transition into npu-lazy-mem, as the finding's ``head -20``."""
    src = next(p for p in GOLDEN if p.stem == "h200_tbo")
    lines = src.read_bytes().splitlines()
    n = next(i for i, line in enumerate(lines, 1)
             if (r := wire.decode_line(line)) and isinstance(r, ev.StateTransition) and r.to == "npu-lazy-mem")
    return _cut(src, n, tmp_path / "inc.jsonl")


def test_the_findings_cut_is_incomplete_not_diverged(tmp_path):
    from conftest import run_main

    inc = _lazy_cut(tmp_path)
    proc = run_main("replay", str(inc))
    assert proc.returncode == 2 and "DIVERGED" not in proc.stdout + proc.stderr
    assert proc.stderr.startswith("error [trace_incomplete]")
    text = " ".join(proc.stderr.split())
    assert "the trace ends in state 'npu-lazy-mem', before the run recorded its end" in text
    assert "decision(s) recorded up to there are the same now" in text
    err = json.loads(run_main("replay", str(inc), "--json").stdout)["error"]
    assert err["code"] == "trace_incomplete"
    assert {f["name"]: f["value"] for f in err["flags"]}["state"] == "npu-lazy-mem"
    # inspect agrees: incomplete
    assert ": incomplete" in run_main("inspect", str(inc)).stdout.splitlines()[0]


def test_a_real_divergence_before_the_cut_is_still_one(tmp_path):
    """Compare what was recorded: a recorded decision that differs is still DIVERGED (exit 1), cut or not."""
    from conftest import run_main

    inc = _lazy_cut(tmp_path)
    lines = inc.read_bytes().splitlines()
    i = next(i for i, line in enumerate(lines) if isinstance(wire.decode_line(line), ev.BuildPlanned))
    rec = json.loads(lines[i])
    rec["mode"] = "normal"
    lines[i] = json.dumps(rec).encode()
    inc.write_bytes(b"\n".join(lines) + b"\n")
    proc = run_main("replay", str(inc))
    assert proc.returncode == 1 and "DIVERGED in state 'build-mode'" in " ".join(proc.stdout.split())
