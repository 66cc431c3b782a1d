"""A CLI that explains itself: help, abbreviations, --version, backends, stderr, -v, run's output."""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from pipeline.backends import registry
from pipeline.cli import build_parser, field_docs, human_line, main
from pipeline.core.contracts import AttentionArgs


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_attention_field_has_a_doc():
    """Each AttentionArgs field has a one-line doc in the Struct's Fields section (the --help text)."""
    docs = field_docs(AttentionArgs)
    assert set(docs) == set(AttentionArgs.__struct_fields__), set(AttentionArgs.__struct_fields__) ^ set(docs)
    assert all(len(d) > 10 for d in docs.values())


@pytest.mark.parametrize("command", sorted(_subparsers(build_parser())))
def test_every_flag_has_help_with_its_default(command):
    """Every option of every subcommand has help; each that takes a value states its default; closed sets list choices."""
    sub = _subparsers(build_parser())[command]
    helptext = sub.format_help()
    for action in sub._actions:
        if not action.option_strings or action.option_strings[0] in ("-h", "--help"):
            continue
        assert action.help, action.option_strings
        if action.nargs != 0 and not action.required:  # takes a value and may be left out
            fmt, shown = sub._get_formatter(), copy.copy(action)
            shown.help = fmt._get_help_string(action)
            rendered = fmt._expand_help(shown)
            assert "default" in rendered.lower(), (command, action.option_strings, rendered)
    if command in ("run", "plan", "warmup"):
        for name in AttentionArgs.__struct_fields__:
            assert "--" + name.replace("_", "-") in helptext
        assert "choices: fa3, flashinfer, torch_native, triton" in " ".join(helptext.split())
        assert "choices: auto, bfloat16" in " ".join(helptext.split())  # kv_cache_dtype / dtype


@pytest.mark.parametrize("argv,hint", [
    (["plan", "--device", "cpu"], "--device-profile"),      # was taken as --device-profile
    (["run", "--js"], "--json"),                            # was taken as --json, then errors came as text
    (["run", "--attention", "triton"], "--attention-backend"),
    (["inspect", "--perf", "x.json", "x.jsonl"], "--perfetto"),
])
def test_abbreviations_are_refused_with_the_full_name(capsys, argv, hint):
    """allow_abbrev is off: a prefix of a flag is a usage error whose remedy names the flag."""
    code = main(argv + ["--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "usage" and hint in out["error"]["remedy"]


@pytest.mark.parametrize("argv", [["run", "--json", "--page-size", "x"], ["--json", "run"], ["run", "--json", "--nope"],
                                  ["inspect", "--json"], ["plan", "--json", "--device-profile"]])
def test_usage_errors_are_json_with_json(capsys, argv):
    """With --json anywhere on the line, argparse's usage errors are one JSON ErrorInfo on stdout too."""
    code = main(argv)
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    want = "out_of_domain" if "x" in argv else "usage"  # a value of the wrong type is the flag's domain's error
    assert code == 2 and out["ok"] is False and out["error"]["code"] == want and cap.err == ""


def test_version(capsys):
    """--version prints the package version (pyproject's) and exits 0."""
    from pipeline import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"attn-setup {__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(__version__)}"$', pyproject, re.M)


@pytest.mark.parametrize("name", ["H200", " h200 ", "Rtx-Pro-6000", "AUTO"])
def test_profile_names_are_case_insensitive(capsys, name, monkeypatch):
    """--device-profile H200 is h200 (and a refusal names what was typed)."""
    from pipeline.platforms import profiles

    monkeypatch.setattr(profiles, "detect", lambda: profiles.PROFILES["cpu"])
    assert main(["plan", "--json", "--device-profile", name]) == 0
    dev = json.loads(capsys.readouterr().out)["device"]
    want = profiles.PROFILES[name.strip().lower()] if name.strip().lower() != "auto" else profiles.PROFILES["cpu"]
    assert dev["name"] == want.name
    assert main(["plan", "--json", "--device-profile", "H900"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["flags"][0]["value"] == "H900"


def test_backends_json_lists_every_backend_with_its_record(capsys):
    """`backends --json`: every registered backend, its full capability record, installed per package."""
    from pipeline.backends import packages, registry
    from pipeline.backends.packages import installed_by_metadata
    from pipeline.backends.records import PACKAGES

    assert main(["backends", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [b["name"] for b in out["backends"]] == registry.names()
    for b in out["backends"]:
        cap = registry.get(b["name"]).capability
        assert b["archs"] == cap.archs and b["features"] == cap.features and b["devices"] == cap.devices
        have = installed_by_metadata(tuple(cap.packages))
        assert b["package_status"] == {p: bool(v) for p, v in have.items()}
        assert b["package_versions"] == {p: v or None for p, v in have.items()}
        assert b["supported_versions"] == {p: p + PACKAGES[p][1] for p in cap.packages}
        assert b["installed"] == all(v and packages.is_supported(p, v) for p, v in have.items())
    assert out["known_unavailable"]["trtllm_mha"]


def test_backends_table(capsys):
    """`backends` (human): one row per backend with installed yes/no and the missing package."""
    assert main(["backends"]) == 0
    text = capsys.readouterr().out
    for name in registry.names():
        assert name in text
    assert "installed" in text


def test_docs_page_matches_the_capability_records():
    """docs/backends.md is generated from the records; regenerate it when a record changes."""
    from pipeline.cli.backends import markdown

    page = (ROOT / "docs" / "backends.md").read_text()
    assert page == markdown(), "docs/backends.md drifted: python3 -m pipeline.cli backends --markdown > docs/backends.md"


def test_no_raw_log_line_before_the_formatted_error(capsys, tmp_path):
    """A failed run prints its headline and the formatted error on stderr and no structlog line (the log file has
    the events)."""
    log = tmp_path / "l.jsonl"
    code = main(["run", "--device", "cpu", "--log-file", str(log), "--attention-backend", "triton"])
    err = capsys.readouterr().err
    head, rest = err.lstrip().split("\n", 1)
    assert code == 3 and head.startswith("attn-setup run failed (exit 3) in state resolve: capability_mismatch"), err
    rule, error = rest[rest.index("attn-setup run failed (exit 3) ─"):].split("\n", 1)  # the rule, then the error
    assert error.startswith("error [capability_mismatch]"), err
    assert "run_failed" not in err and "feature_downgraded" not in err and "schema_version" not in err
    assert b'"run_failed"' in log.read_bytes()


def test_verbose_prints_short_human_lines(capsys, tmp_path):
    """-v: every event as one short line on stderr (rounded ms, no JSON record); the file keeps the JSON."""
    log = tmp_path / "l.jsonl"
    code = main(["-v", "run", "--device", "cpu", "--log-file", str(log), "--num-layers", "1", "--decode-steps", "1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(err) == len(records)
    for line, rec in zip(err, records):
        assert rec["event"] in line and len(line) <= 240 and "ts_ns" not in line and "schema_version" not in line
        assert re.match(r"\d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR) ", line), line
    ms = [m for line in err for m in re.findall(r"duration_ms=(\S+)", line)]
    assert ms and all(re.fullmatch(r"\d+\.\dms", m) for m in ms)


def test_human_line_shortens_nested_values():
    """Large dicts/lists are counted, floats rounded: a -v line stays short."""
    line = human_line(None, "info", {"event": "run_started", "state": "device-init", "outcome": "ok",
                                     "ts_ns": 1_700_000_000_123_000_000, "request": {str(i): i for i in range(40)},
                                     "elapsed_s": 12.3456, "max_rel_err": 0.000123456})
    assert "request={40 keys}" in line and "elapsed_s=12.3s" in line and "max_rel_err=0.000123" in line


def test_run_human_output_names_the_model_and_nests_the_setup_states(capsys, tmp_path):
    """run (human): the model line, sizes in KiB/MiB, a timeline with the setup states under attention in order,
    each skip once and nothing on stderr."""
    code = main(["run", "--device", "cpu", "--log-file", str(tmp_path / "l.jsonl"), "--num-layers", "1",
                 "--decode-steps", "1", "--draft-worker", "--draft-model", str(ROOT / "examples/configs/qwen3-8b.json")])
    cap = capsys.readouterr()
    out = cap.out
    assert code == 0 and cap.err == ""
    flat = " ".join(out.split())  # lines are wrapped at words to the console's width
    assert flat.count("CUDA graphs need a CUDA device; this run is on cpu") == 1
    assert re.search(r"model: llama \(LlamaForCausalLM\) from \S+llama-3\.1-8b\.json; draft worker serving the draft "
                     r"model: qwen3 \(Qwen3ForCausalLM\) from \S+qwen3-8b\.json, 1 attention layer built \(layer 0\) of 36", flat), out
    assert re.search(r"KV pool: 1024 token slots x [\d.]+ KiB = [\d.]+ MiB", flat)
    rows = re.findall(r"│ ((?:  └ )?[a-z-]+) +│ (\w+)", out.split("startup summary")[0])  # the timeline table
    assert "startup summary" in out
    order = [r[0] for r in rows if r[0].strip("└ ") in (
        "init-distributed", "load-model", "init-memory-pool", "attention", "device-init", "resolve", "build-mode",
        "npu-lazy-mem", "annotate", "done", "capture-cuda-graphs", "ready")]
    assert order == ["init-distributed", "load-model", "init-memory-pool", "attention", "  └ device-init",
                     "  └ resolve", "  └ build-mode", "  └ npu-lazy-mem", "  └ annotate", "  └ done",
                     "capture-cuda-graphs", "ready"]
    assert " bytes," not in out  # workspace sizes in B/KiB/MiB


@pytest.fixture(scope="module")
def two_logs(tmp_path_factory):
    """An ok run (--json output kept) and a run refused in resolve, each with its own log."""
    import contextlib
    import io

    import structlog

    d = tmp_path_factory.mktemp("logs")
    logs, outs = [], []
    for i, extra in enumerate([[], ["--attention-backend", "triton"]]):
        logs.append(str(d / f"l{i}.jsonl"))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["run", "--device", "cpu", "--json", "--log-file", logs[-1], "--num-layers", "1", "--decode-steps", "0",
                  *extra])
        outs.append(json.loads(buf.getvalue()))
    structlog.reset_defaults()
    return logs, outs


def test_run_json_keeps_bytes(two_logs):
    """--json keeps workspace sizes in bytes (ints)."""
    out = two_logs[1][0]
    assert out["ok"] and all(isinstance(w["bytes"], int) for w in out["plan"]["workspaces"])


def test_graph_runner_machine_from_several_logs(capsys, tmp_path, two_logs):
    """graph takes several logs and draws the runner machine with the run's path (--machine runner)."""
    logs = two_logs[0]
    for fmt in (".mmd", ".dot"):
        out = tmp_path / f"g{fmt}"
        assert main(["graph", *logs, "--machine", "runner", "-o", str(out)]) == 0
        text = out.read_text()
        for s in ("init-distributed", "load-model", "init-memory-pool", "attention", "capture-cuda-graphs", "ready"):
            assert s in text
    cls = dict(re.findall(r"class ([A-Z_]+) s_(\w+)", (tmp_path / "g.mmd").read_text()))
    assert cls["READY"] == "taken" and cls["FAILED"] == "default"  # the refused run never entered the runner
    assert 'READY [label="ready", fillcolor="honeydew"' in (tmp_path / "g.dot").read_text()
    setup = tmp_path / "s.mmd"
    assert main(["graph", *logs, "-o", str(setup)]) == 0
    cls = dict(re.findall(r"class ([A-Z_]+) s_(\w+)", setup.read_text()))
    assert cls["RESOLVE"] == "failed"  # the first failed run across both logs: refused in resolve
    capsys.readouterr()


def test_runner_example_prints_results_and_imports_no_cli(capsys, tmp_path, monkeypatch):
    """examples/runner_example.py prints its results (a few lines, no log events) and imports nothing from pipeline.cli*."""
    path = ROOT / "examples" / "runner_example.py"
    tree = ast.parse(path.read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and (m.startswith("pipeline.cli") or m == "pipeline.cli.output") for m in mods), mods
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path), "cpu"])
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert out.err == "" and 4 <= len(lines) <= 6, lines
    assert lines[0].startswith("backends: torch_native / torch_native")
    err = float(re.search(r"update: ([\d.e+-]+)", out.out).group(1))
    assert 0 < err < 1e-2 and "runner state: ready" in out.out
    assert Path(tmp_path / "attn-setup-logs" / "runner_example.jsonl").stat().st_size > 0


def test_run_help_shows_every_field_doc_whole():
    """``run --help`` cut ``--cuda-graph-max-bs``'s help at its docstring's first line ("… else min(the
    request pool's (default: unset)"). Every field's doc is read whole (continuation lines included) and shown."""
    from pipeline.cli.flags import field_docs
    from pipeline.core.contracts import AttentionArgs

    docs = field_docs(AttentionArgs)
    assert set(docs) == set(AttentionArgs.__struct_fields__)
    for name, doc in docs.items():
        assert doc.count("(") == doc.count(")"), (name, doc)
    import argparse

    from pipeline.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    text = " ".join(sub.format_help().split())
    assert "else min(the request pool's rows, sglang's default for the device's memory" in text
    for doc in docs.values():
        assert " ".join(doc.split()) in text
