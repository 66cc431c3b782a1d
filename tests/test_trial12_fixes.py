"""New-user trial #12's fixes: ``inspect``'s ``flag to change:`` names only the flags the remedy changes (the rest
are ``flag`` lines, as in ``run``'s error block), and ``notice:`` / ``warning:`` lines on stderr break at its width."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.cli.inspect import explain
from pipeline.core.contracts import ErrorInfo, Flag


def _lines(flags: list[tuple[str, object]], remedy: str) -> list[str]:
    info = ErrorInfo(code="capability_mismatch", state="resolve", message="m", remedy=remedy,
                     flags=[Flag(name=n, value=v) for n, v in flags])
    return explain(SimpleNamespace(status="failed", failure=info, first=lambda cls: None))


def test_only_the_flag_the_remedy_changes_is_the_flag_to_change():
    lines = _lines([("--attention-backend", "flashinfer"), ("--device", "cpu"), ("--model", "/x/llama.json")],
                   "set --attention-backend to one of: torch_native")
    assert "flag to change: --attention-backend = 'flashinfer'" in lines
    assert "flag --device = 'cpu'" in lines and "flag --model = '/x/llama.json'" in lines
    assert sum(ln.startswith("flag to change:") for ln in lines) == 1


def test_a_flag_named_inside_another_is_not_taken_for_it():
    """``--cuda-graph-max-bs`` in the remedy does not make ``--cuda-graph-bs`` (a prefix of its name elsewhere) or
    ``--max-reqs`` flags to change; a whole-word match only."""
    lines = _lines([("--cuda-graph-bs", "1 2"), ("--max-reqs", 8), ("--cuda-graph-max-bs", 300)],
                   "set --cuda-graph-max-bs 8")
    assert "flag to change: --cuda-graph-max-bs = 300" in lines
    assert "flag --cuda-graph-bs = '1 2'" in lines and "flag --max-reqs = 8" in lines


def test_every_flag_is_to_change_when_the_remedy_names_none():
    lines = _lines([("--rank", 0), ("--world-size", 2)], "start every rank, or raise --dist-timeout")
    assert "flag to change: --rank = 0, --world-size = 2" in lines


def test_notices_break_at_stderrs_width(monkeypatch, capsys):
    from pipeline.cli.output import print_stderr_lines

    monkeypatch.setenv("COLUMNS", "40")
    note = ("notice: --world-size 2 outside torchrun: this process runs rank 0 alone (no rank group, the rank "
            "agreement is skipped)")
    print_stderr_lines([note])
    err = capsys.readouterr().err.splitlines()
    assert len(err) > 1 and all(len(ln) <= 40 for ln in err), err
    assert " ".join(" ".join(err).split()) == note
