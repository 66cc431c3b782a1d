"""Wording: only flags in inspect's "flag to change" line, the LOG argument
labelled as an argument, ``--device`` shown as written, a remedy for a device type with no platform that names the
ones there are, and ``graph --json``'s failure in the command line's words with every key README lists.
In-process through ``pipeline.cli.main``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.cli import main
from pipeline.cli.inspect import explain
from pipeline.core.errors import ErrorInfo, Flag

from conftest import user_docs  # noqa: E402
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("names", [
    ["--mem-fraction", "limit_bytes"], ["MASTER_ADDR", "--rank"], ["LOG"], ["limit_bytes"],
    ["--max-reqs", "--max-context-len", "limit_bytes"], ["num_attention_heads", "SGLANG_FLASHINFER_WORKSPACE_SIZE"],
])
def test_flag_to_change_lists_only_flags(names):
    """Every entry of the error shows once: flags on the "flag to change" line, every other name on its own
    labelled line (env, field, arg)."""
    info = ErrorInfo(code="x", state="args", flags=[Flag(name=n, value=1) for n in names], message="m")
    run = SimpleNamespace(status="failed", failure=info, first=lambda cls: None)
    lines = explain(run)
    change = [ln for ln in lines if ln.startswith("flag to change: ")]
    flags = [n for n in names if n.startswith("--")]
    assert change == ([f"flag to change: {', '.join(f'{n} = 1' for n in flags)}"] if flags else [])
    for n in names:
        if not n.startswith("--"):
            assert sum(bool(re.fullmatch(rf"(env|field|arg) {re.escape(n)} = 1", ln)) for ln in lines) == 1, lines


def test_inspect_of_a_pool_refusal_changes_only_the_flag(tmp_path, capsys):
    """A reported case: ``run --mem-fraction 1.0`` refused for memory; inspect names --mem-fraction as the flag to
    change and limit_bytes apart."""
    log = tmp_path / "r.jsonl"
    assert main(["run", "--device", "cpu", "--mem-fraction", "1.0", "--log-file", str(log), "--json"]) == 3
    capsys.readouterr()
    main(["inspect", str(log)])
    out = capsys.readouterr().out
    change = re.search(r"flag to change: ([^\n]*)", out).group(1)
    assert change == "--mem-fraction = 1.0" and re.search(r"field limit_bytes = \d+", out), out


def test_a_directory_as_log_is_labelled_the_log_argument(tmp_path, capsys):
    """``inspect DIR``: the LOG argument is labelled ``arg``, not ``env``."""
    (tmp_path / "attn-setup-logs").mkdir()
    assert main(["inspect", str(tmp_path / "attn-setup-logs")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^  arg +LOG =", err, re.M) and "env    LOG" not in err, err


def test_graph_json_words_the_failure_with_flags_and_readme_lists_its_keys(tmp_path, capsys):
    """``graph --json`` of a failed ``--attention-backend fa3`` run: the failure names the flag, and every key of
    the object is in README's list for it."""
    log = tmp_path / "r.jsonl"
    assert main(["run", "--device", "cpu", "--attention-backend", "fa3", "--log-file", str(log), "--json"]) == 3
    capsys.readouterr()
    assert main(["graph", str(log), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    message = out["path"]["failure"]["message"]
    assert "--attention-backend fa3" in message and "attention_backend=" not in message, message
    listed = re.search(r"`--json` prints `\{(ok, machine, [^`]*)\}`", user_docs()).group(1)
    top = re.sub(r"\[[^\]]*\]|\{[^}]*\}", "", listed)  # the top-level keys, not the nested ones
    assert set(out) == {k.split(":")[0].strip() for k in top.split(",") if k.strip()}, (sorted(out), top)


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
