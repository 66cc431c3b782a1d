"""inspect (text, --json, --perfetto), replay and graph survive any log: a hypothesis fuzz over record shapes.

Lines are real records (golden traces) mutated field by field — values of other types, extreme numbers
(1e308, NaN text, 2**70), markup and control characters in strings, deleted and unknown keys, odd
``event`` tags and schema versions, deep nesting — mixed with raw garbage. Every command must end with
one of its documented exit codes and never an ``internal_error``; every line is either read or counted
as skipped (README: "corrupt lines are counted and skipped"). In-process, so it stays fast.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.cli import main
from pipeline.observe.trace import read_trace

GOLDEN = Path(__file__).parent / "data" / "golden"
BASE = [json.loads(x) for name in ("ok_tbo", "failed_pdmux", "tp2_rank0")
        for x in (GOLDEN / f"{name}.jsonl").read_text().splitlines() if x.strip()]
BY_TAG: dict[str, list[dict]] = {}
for _r in BASE:
    BY_TAG.setdefault(_r["event"], []).append(_r)
TAGS = [ev.event_name(c) for c in ev.EVENT_TYPES]
ENVELOPE = set(wire.ENVELOPE)
KEYS = sorted({k for r in BASE for k in r} | {"launch_id", "rules", "duration_ms", "elapsed_s", "started_ns",
                                               "max_rel_err", "exit_code", "command"})
STRINGS = st.one_of(st.text(max_size=10), st.sampled_from([
    "[bold]", "[/]", "[red]x[/red]", "[link=http://x]y", "\x1b[31m", "\x00", "NaN", "Infinity", "done", "failed",
    "ready", "attention", "resolve", "a" * 300]))
NUMBERS = st.one_of(st.integers(-10, 10), st.sampled_from([1e308, -1e308, 2**63, 2**70, -(2**63) - 1, 0.5, -0.0]),
                    st.floats(allow_nan=False))
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS),
                       lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(STRINGS, kids, max_size=3)),
                       max_leaves=6)


def _like(old) -> st.SearchStrategy:
    """A value of the same kind as ``old`` but extreme or emptied: what breaks code that trusts the type."""
    if isinstance(old, bool) or old is None:
        return JSONISH
    if isinstance(old, (int, float)):
        return st.sampled_from([1e308, -1e308, "NaN", "Infinity", "-Infinity", 2**70, -1, 0, 2**63 - 1, None])
    if isinstance(old, dict):
        keys = sorted(old)
        return st.one_of(st.just({}), st.builds(lambda k: {x: v for x, v in old.items() if x != k},
                                                st.sampled_from(keys) if keys else st.just(None)),
                         st.builds(lambda k, v: {**old, k: v}, st.sampled_from(keys) if keys else STRINGS, JSONISH))
    if isinstance(old, list):
        return st.one_of(st.just([]), st.lists(JSONISH, max_size=2), st.builds(lambda v: [v] * 3, st.just(old[:1])))
    return STRINGS


@st.composite
def mutated(draw) -> bytes:
    rec = dict(draw(st.sampled_from(BY_TAG[draw(st.sampled_from(sorted(BY_TAG)))])))  # every record type alike
    own = sorted(set(rec) - ENVELOPE) or sorted(rec)
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["own"] * 6 + ["set", "delete", "event", "version", "run_id", "state"]))
        if op == "own":  # one of the record's own fields: same kind but extreme, or another type
            key = draw(st.sampled_from(own))
            rec[key] = draw(st.one_of(_like(rec.get(key)), _like(rec.get(key)), JSONISH))
        elif op == "set":
            rec[draw(st.sampled_from(KEYS))] = draw(JSONISH)
        elif op == "delete" and rec:
            rec.pop(draw(st.sampled_from(sorted(rec))))
        elif op == "event":
            rec["event"] = draw(st.one_of(st.sampled_from(TAGS), JSONISH))
        elif op == "version":
            rec["schema_version"] = draw(st.one_of(st.integers(-3, 3), JSONISH))
        else:
            rec[op] = draw(STRINGS)
    line = json.dumps(rec, ensure_ascii=draw(st.booleans()))  # NaN/Infinity literals too: not JSON
    return line.encode("utf-8", "surrogatepass")


GARBAGE = st.one_of(st.binary(max_size=40), st.just(b"[" * 5000 + b"]" * 5000), st.just(b'{"event":["x"]}'),
                    st.builds(lambda d: b"{" * d, st.integers(1, 3000)))
LINES = st.lists(st.one_of(mutated(), mutated(), st.sampled_from([json.dumps(r).encode() for r in BASE]), GARBAGE),
                 min_size=1, max_size=16)


def _call(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(LINES)
def test_every_command_survives_any_log(capsys, lines):
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "fuzz.jsonl"
        body = [x for x in dict.fromkeys(ln.replace(b"\n", b" ").strip() for ln in lines) if x]  # distinct lines
        log.write_bytes(b"\n".join(body) + b"\n")

        code, out, err = _call(capsys, "inspect", str(log), "--json")
        assert code in (0, 1, 2), err
        obj = json.loads(out)
        assert "internal_error" not in out
        if code == 2:
            assert obj["error"]["code"] == "trace_unreadable"
        else:
            t = read_trace(log)
            read = sum(len(r.records) for r in t.runs)
            assert read + obj["skipped_lines"] == len(body)  # every line read or counted as skipped, none lost
            assert code == (0 if all(r["ok"] for r in obj["runs"]) else 1)
            assert len(obj["runs"]) == len(t.runs)

        text_code, out, err = _call(capsys, "inspect", str(log))
        assert text_code == code and "internal_error" not in out + err and "Traceback" not in out + err

        perf = Path(d) / "p.json"
        p_code, out, err = _call(capsys, "inspect", str(log), "--json", "--perfetto", str(perf))
        assert p_code == code and "internal_error" not in out + err
        if code != 2:
            assert isinstance(json.loads(perf.read_bytes())["traceEvents"], list)

        for argv in (["replay", str(log), "--json"], ["replay", str(log)]):
            r_code, out, err = _call(capsys, *argv)
            assert r_code in (0, 1, 2) and "internal_error" not in out + err, out + err
            if r_code == 2 and "--json" in argv:
                r_err = json.loads(out)["error"]["code"]
                assert r_err in ("trace_unreadable", "nothing_to_replay", "trace_incomplete")
                if r_err == "trace_incomplete":  # a run that never recorded its end, its trace cut before a decision
                    t = read_trace(log)
                    assert not t.skipped_lines and any(r.status == "incomplete" for r in t.runs)
                if r_err == "nothing_to_replay":  # it reads, and no run got to a decision: no device facts to start
                    runs = read_trace(log).runs
                    assert runs and all(r.started is None or r.first(ev.DeviceInitialized) is None for r in runs)

        mmd = Path(d) / "g.mmd"
        g_code, out, err = _call(capsys, "graph", str(log), "-o", str(mmd))
        assert g_code in (0, 2) and "internal_error" not in out + err, out + err
        assert (g_code == 0) == mmd.exists()


SWEEP_VALUES = [1e308, "NaN", -1, {}, [], "[/]"]  # valid-looking but extreme / empty / markup


def _fields() -> list[str]:
    return sorted({k for r in BASE for k in r if k not in ("event", "schema_version")})


def test_every_field_at_every_extreme(tmp_path, capsys):
    """Deterministic sweep next to the fuzz: each field of every golden record type set (in every record
    that has it) to each extreme in turn; the four commands' in-process entry points stay within their
    exit codes. Calls the same functions the commands call, without the CLI's per-call setup."""
    import io

    from pipeline.cli import graph as cli_graph, inspect as cli_inspect
    from pipeline.core.errors import UsageError
    from pipeline.observe.perfetto import chrome_trace
    from pipeline.observe.replay import replay

    console = io.StringIO()
    base = [json.loads(x) for x in (GOLDEN / "ok_tbo.jsonl").read_text().splitlines() if x.strip()]
    log = tmp_path / "sweep.jsonl"
    for key in _fields():
        for value in SWEEP_VALUES:
            log.write_text("\n".join(json.dumps({**r, key: value} if key in r else r) for r in base) + "\n")
            t = read_trace(log)
            assert sum(len(r.records) for r in t.runs) + t.skipped_lines == len(base)
            if not t.runs:
                continue
            for run in t.runs:
                json.dumps(cli_inspect.run_obj(run), default=str)
                cli_inspect.render_run(console, run)
            cli_inspect.render_tail(console, t, cli_inspect.rank_differences(t))
            json.dumps(chrome_trace(t), default=str)
            try:
                replay(t)
            except UsageError as e:
                assert e.info.code == "trace_unreadable", (key, value)
            cli_graph.path_of(str(log), None)
