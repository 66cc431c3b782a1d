"""Human output follows the console width and never cuts what a user needs, and CLI errors
speak the command line's words (the checker itself, and cli_error over generated errors).

Each human command runs at ``COLUMNS`` = 60, 80, 120 and 220 and its output is compared with the same command's
``--json`` (or the trace it reads): no ellipsis anywhere, every word of every value the user needs (backend names,
features, packages, rejection reasons, states, paths) appears whole as a word of the output — so no cell was cut
and no word was split across lines —, and no line is wider than the console unless it holds a single word longer
than the line (a long path, left whole for the terminal to wrap).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_words import check_cli_error, rendered
from conftest import ROOT
from pipeline.cli import main

WIDTHS = [60, 80, 120, 220]
GOLDEN = ROOT / "tests" / "data" / "golden"
BORDERS = "│┃┏┓┗┛┡┩└┘┌┐━─┳┻╇╈┼├┤"


def _words(text: str) -> set[str]:
    """The output's words: split at spaces and table borders, trailing punctuation of prose dropped."""
    for ch in BORDERS:
        text = text.replace(ch, " ")
    out = set()
    for w in text.split():
        out |= {w, w.rstrip(",;:."), w.strip("(),;:.'\"")}
    return out


def _value_words(values) -> set[str]:
    """Every word of the given values (strings, numbers, lists and dicts of them)."""
    if isinstance(values, dict):
        return set().union(*(_value_words(v) for v in values.values())) if values else set()
    if isinstance(values, (list, tuple)):
        return set().union(*(_value_words(v) for v in values)) if values else set()
    return {w.strip("(),;:.'\"") for w in str(values).split()} - {""}


def _check(out: str, cols: int, need: set[str]) -> None:
    assert "…" not in out and "..." not in out, out
    missing = need - _words(out)
    assert not missing, (cols, sorted(missing)[:20], out[:3000])
    for line in out.splitlines():
        if len(line) > cols:
            assert len(line.split()) == 1, (cols, line)  # one word longer than the line, left whole


def _human_and_json(capsys, monkeypatch, cols: int, argv: list[str]) -> tuple[int, str, dict]:
    monkeypatch.setenv("COLUMNS", str(cols))
    code = main(argv)
    text = capsys.readouterr().out
    assert main([*argv, "--json"]) == code
    return code, text, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("cols", WIDTHS)
def test_backends_table_never_cuts_a_cell(capsys, monkeypatch, cols):
    code, text, rep = _human_and_json(capsys, monkeypatch, cols, ["backends"])
    assert code == 0
    need = set()
    for r in rep["backends"]:
        need |= _value_words([r["name"], r["devices"], r["features"], r["kv_dtypes"], r["archs"] or [],
                              r["head_dims_qk"] or [], [p for p, ok in r["package_status"].items() if not ok]])
    need |= _value_words(list(rep["known_unavailable"]))
    _check(text, cols, need)
    assert any("chunked_local_attention" in w for w in _words(text)) and "flashinfer-python" in _words(text)
    if cols >= 120:  # the table form, one row per backend
        assert text.count("┏") == 1 and all(f"│ {r['name']}" in text for r in rep["backends"])


@pytest.mark.parametrize("cols", WIDTHS)
def test_plan_lines_wrap_at_words(capsys, monkeypatch, cols):
    argv = ["plan", "--device-profile", "h100", "--installed", "torch,triton", "--enable-two-batch-overlap",
            "--moe-a2a-backend", "deepep"]
    code, text, rep = _human_and_json(capsys, monkeypatch, cols, argv)
    assert code == 0
    need = _value_words([[r["reasons"], r["backend"]] for half in rep["rejected"].values() for r in half])
    need |= _value_words([[i["role"], i["backend"], i["workspace"]] for i in rep["plan"]["instances"]])
    need |= _value_words([s["reason"] for s in rep["skips"]]) | {rep["resolved"]["prefill"]}
    _check(text, cols, need)


@pytest.mark.parametrize("cols", WIDTHS)
def test_inspect_and_replay_lines_wrap_at_words(capsys, monkeypatch, cols):
    log = str(GOLDEN / "failed_pdmux_tbo.jsonl")
    code, text, rep = _human_and_json(capsys, monkeypatch, cols, ["inspect", log])
    assert code == 1
    (run,) = rep["runs"]
    need = _value_words([run["failure"]["message"], run["failure"]["remedy"], [s["state"] for s in run["states"]]])
    _check(text, cols, need)
    code, text, rep = _human_and_json(capsys, monkeypatch, cols, ["replay", str(GOLDEN / "ok_gemma2.jsonl")])
    assert code == 0 and rep["same"]
    _check(text, cols, _value_words([r["run_id"] for r in rep["runs"]]) | {"same"})


@pytest.mark.parametrize("cols", [60, 220])
def test_run_output_and_error_follow_the_width(capsys, monkeypatch, tmp_path, cols):
    """A real CPU run (TBO: more rows) and a refused one, human at ``cols``: every state, backend and the log path
    whole; the refusal's message and remedy whole on stderr."""
    monkeypatch.setenv("COLUMNS", str(cols))
    log = tmp_path / "a-rather-long-directory-name-for-the-trace-files" / "run.jsonl"
    log.parent.mkdir()
    argv = ["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1", "--enable-two-batch-overlap", "--moe-a2a-backend", "deepep",
            "--log-file", str(log), "--no-progress"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    from pipeline.observe.trace import read_trace

    (run,) = read_trace([str(log)]).runs
    need = _value_words([[s["state"] for s in run.states() + run.runner_states()],
                         [i["backend"] for i in run.decisions()["plan"]["instances"]], str(log)])
    _check(cap.out, cols, need)
    assert cap.err == ""
    assert main([*argv[:-3], "--log-file", str(log), "--attention-backend", "triton"]) == 3
    cap = capsys.readouterr()
    assert main([*argv[:-3], "--log-file", str(log), "--attention-backend", "triton", "--json"]) == 3
    err = json.loads(capsys.readouterr().out)["error"]
    _check(cap.err, cols, _value_words([err["message"], err["remedy"]]))
    heading = [line for line in cap.out.splitlines() if line.startswith("timeline")]
    assert heading and "under attention" not in " ".join(cap.out.split())  # refused before the runner started
    assert "the runner did not start" in " ".join(cap.out.split())


def test_wrap_never_splits_a_word():
    from pipeline.cli.output import wrap

    text = "a " * 5 + "x" * 50 + " b-c-d-e-f-g-h-i-j " + "word " * 20
    for cols in (10, 20, 33, 80):
        lines = wrap(text, cols)
        assert " ".join(" ".join(lines).split()) == " ".join(text.split())  # nothing lost or split
        assert all(len(line) <= cols or len(line.split()) == 1 for line in lines), lines


def test_column_widths_fit_and_keep_every_word():
    from pipeline.cli.output import column_widths, table_fits

    cols, rows = ["a", "features"], [["x", "mha, chunked_local_attention, speculative"], ["yy", "tbo"]]
    for width in (40, 50, 80):
        assert table_fits(cols, rows, width)
        w = column_widths(cols, rows, width)
        assert sum(w) + 3 * len(cols) + 1 <= width and w[1] >= len("chunked_local_attention,")
    assert not table_fits(cols, rows, 30)


# -- one vocabulary in CLI errors -----------------------------------------------------------------


def test_the_checker_catches_the_library_words(capsys):
    """The library's own ErrorInfo (fields, pool paths) fails the check; the command line's passes."""
    import msgspec

    from pipeline.cli.output import cli_error, command_dests
    from pipeline.core.contracts import PoolFacts
    from pipeline.core.errors import AttnSetupError

    with pytest.raises(AttnSetupError) as e:
        PoolFacts(max_reqs=0)
    raw = msgspec.to_builtins(e.value.info)
    assert raw["flags"][0]["name"] == "pool.max_reqs"
    with pytest.raises(AssertionError):
        check_cli_error(raw, "run")
    cli = msgspec.to_builtins(cli_error(e.value.info, command_dests("run")))
    check_cli_error(cli, "run", rendered(cli, capsys))
    assert cli["flags"] == [{"name": "--max-reqs", "value": 0}] and cli["message"] == "--max-reqs 0 is not allowed"


_RUN_FIELDS = ["max_reqs", "max_context_len", "num_token_slots", "attention_backend", "page_size", "cuda_graph_bs",
               "enable_two_batch_overlap", "rank", "mem_fraction"]


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(_RUN_FIELDS), prefix=st.sampled_from(["", "pool.", "args."]),
       value=st.one_of(st.none(), st.integers(-5, 10**6), st.sampled_from(["triton", "x y"]), st.booleans()),
       shape=st.sampled_from(["{p}{f}={v!r} is not allowed", "set {p}{f} to 3", "{p}{f} = None here",
                              "{p}{f} is None", "must be int | None", "drop {p}{f}"]))
def test_cli_error_words_generated_errors(field, prefix, value, shape):
    """Any library error naming a field the command has a flag for, with any value (None included), comes out in
    flags and without Python's None — in the JSON object and in the human block."""
    import io
    import sys

    import msgspec

    from pipeline.cli.output import render_error
    from pipeline.cli.output import cli_error, command_dests
    from pipeline.core.errors import ErrorInfo, Flag

    text = shape.format(p=prefix, f=field, v=value)
    info = ErrorInfo(code="invalid_value", state="args", flags=[Flag(name=prefix + field, value=value)],
                     message=text, allowed=[text], remedy=text)
    cli = msgspec.to_builtins(cli_error(info, command_dests("run")))
    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        render_error(msgspec.convert(cli, ErrorInfo))
        human = sys.stderr.getvalue()
    finally:
        sys.stderr = old
    check_cli_error(cli, "run", human)
    assert cli["flags"][0]["name"] == "--" + field.replace("_", "-")
    if value is None:
        assert "not set" in human


def test_unknown_run_is_named_without_python_values(capsys):
    """graph --rank N with no such rank: the error names --rank and the value, never run_id=None."""
    code = main(["graph", str(GOLDEN / "ok_default.jsonl"), "--rank", "7", "-o", "/dev/null/x.mmd"])
    err = capsys.readouterr().err
    assert code == 2 and "None" not in err and "rank 7" in " ".join(err.split()) and "--rank = 7" in err


def test_notices_break_at_stderrs_width(monkeypatch, capsys):
    from pipeline.cli.output import print_stderr_lines

    monkeypatch.setenv("COLUMNS", "40")
    note = ("notice: --world-size 2 outside torchrun: this process runs rank 0 alone (no rank group, the rank "
            "agreement is skipped)")
    print_stderr_lines([note])
    err = capsys.readouterr().err.splitlines()
    assert len(err) > 1 and all(len(ln) <= 40 for ln in err), err
    assert " ".join(" ".join(err).split()) == note
