"""Bad input found by adversarial testing: each is a typed error with the right exit code, never a traceback."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest

from conftest import CONFIGS, ROOT
from pipeline.cli import main


def _run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out.strip().splitlines()
    return code, (json.loads(out[-1]) if out else {})


def _config(tmp_path, **override):
    data = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    data.update(override)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(data))
    return str(p)


@pytest.mark.parametrize("template", ["{nope}.jsonl", "x/{.jsonl", "x/{run_id!r:>9}.jsonl", "x/{run_id.__class__}.j"])
def test_log_file_accepts_only_run_id_and_rank(capsys, tmp_path, template):
    """Unknown placeholders, format specs and unbalanced braces in --log-file: usage error naming it."""
    code, out = _run(capsys, "run", "--device", "cpu", "--json", "--log-file", str(tmp_path / template))
    assert code == 2 and out["error"]["flags"][0]["name"] == "--log-file"


def test_log_file_directory_is_a_usage_error(capsys, tmp_path):
    """A directory as --log-file: exit 2, not IsADirectoryError."""
    code, out = _run(capsys, "run", "--device", "cpu", "--json", "--log-file", str(tmp_path))
    assert code == 2 and "directory" in out["error"]["message"]


@pytest.mark.parametrize("run_id", ["../../etc/x", "a\nb", "-x", "a/b"])
def test_odd_run_ids_are_refused(capsys, tmp_path, monkeypatch, run_id):
    """ATTN_SETUP_RUN_ID names files: path separators, '..' and control characters are refused."""
    monkeypatch.setenv("ATTN_SETUP_RUN_ID", run_id)
    code, out = _run(capsys, "run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"))
    assert code == 2 and out["error"]["flags"][0]["name"] == "ATTN_SETUP_RUN_ID"


@pytest.mark.parametrize("flags,code,name", [
    (["--max-reqs", "0"], 2, "--max-reqs"),
    (["--max-context-len", "0"], 2, "--max-context-len"),
    (["--page-size", "16", "--num-token-slots", "1000"], 3, "--num-token-slots"),
    (["--decode-steps", "-1"], 2, "--decode-steps"),
    (["--cuda-graph-bs", "4", "4", "8"], 2, "--cuda-graph-bs"),
    (["--speculative-eagle-topk", "4"], 3, "--speculative-eagle-topk"),
    (["--device", "cuda"], 3, "--device"),
])
def test_explicit_values_are_checked_not_replaced(capsys, tmp_path, flags, code, name):
    """An explicit value is refused with its flag (as the command line spells it), never silently replaced by a
    default or rounded."""
    got, out = _run(capsys, "run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "l.jsonl"), *flags)
    assert got == code and name in [f["name"] for f in out["error"]["flags"]] and out["error"]["remedy"]


def test_device_refusal_is_logged(capsys, tmp_path):
    """A device refused before the runner starts still leaves a run_failed record in the log."""
    log = tmp_path / "l.jsonl"
    _run(capsys, "run", "--device", "cuda", "--json", "--log-file", str(log))
    assert '"event":"run_failed"' in log.read_text()


@pytest.mark.parametrize("override,path", [
    (dict(num_hidden_layers=10 ** 9), "$.num_hidden_layers"),
    (dict(head_dim=10 ** 6), "$.head_dim"),
    (dict(head_dim=127), "$.head_dim"),
    (dict(qk_rope_head_dim=64, qk_nope_head_dim=128), "$.kv_lora_rank"),
])
def test_absurd_or_partial_configs_are_refused_at_load(capsys, tmp_path, override, path):
    """Huge sizes, an odd head dim, MLA dims without kv_lora_rank: exit 3 at the JSON path, no hang."""
    code, out = _run(capsys, "plan", "--device-profile", "cpu", "--json", "--model", _config(tmp_path, **override))
    assert code == 3 and out["error"]["json_path"] == path


def test_deeply_nested_json_is_malformed_not_a_crash(capsys, tmp_path):
    """100 000 nested brackets: model_config_malformed, exit 3."""
    p = tmp_path / "deep.json"
    p.write_text("[" * 100000 + "]" * 100000)
    code, out = _run(capsys, "plan", "--device-profile", "cpu", "--json", "--model", str(p))
    assert code == 3 and out["error"]["code"] == "model_config_malformed"


def test_more_sm_groups_than_sms_is_refused(capsys):
    """PD-mux with more SM groups than the GPU has SMs: refused at resolve naming both."""
    code, out = _run(capsys, "plan", "--device-profile", "h100", "--installed", "torch,triton,flashinfer-python",
                     "--enable-pdmux", "--sm-group-num", "100000", "--json")
    assert code == 3 and {"--sm-group-num", "device.sm_count"} <= {f["name"] for f in out["error"]["flags"]}


def test_unwritable_outputs_are_usage_errors(capsys, tmp_path):
    """inspect --perfetto into a directory, and graph -o / --perfetto under a file (a folder that cannot be made):
    exit 2 naming the flag."""
    golden = str(CONFIGS.parent.parent / "tests" / "data" / "golden" / "ok_tbo.jsonl")
    assert main(["inspect", golden, "--json", "--perfetto", str(tmp_path)]) == 2
    (tmp_path / "file").write_text("x")
    assert main(["graph", "-o", str(tmp_path / "file" / "g.mmd")]) == 2
    assert "-o" in capsys.readouterr().err
    assert main(["inspect", golden, "--json", "--perfetto", str(tmp_path / "file" / "sub" / "p.json")]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"][0]["name"] == "--perfetto" and "is not a folder" in err["message"]


def test_every_output_path_flag_creates_missing_folders(capsys, tmp_path):
    """One rule for --log-file, --perfetto, --metrics-file and graph -o: missing folders are created (--log-file created them while --perfetto refused), and the file is written there."""
    from pipeline.cli.startup import check_startup_flags

    golden = str(CONFIGS.parent.parent / "tests" / "data" / "golden" / "ok_tbo.jsonl")
    out = tmp_path / "a" / "b"
    assert main(["inspect", golden, "--json", "--perfetto", str(out / "p.json")]) == 0
    assert json.loads((out / "p.json").read_text())["traceEvents"]
    assert main(["graph", golden, "-o", str(tmp_path / "c" / "g.mmd")]) == 0
    assert "stateDiagram-v2" in (tmp_path / "c" / "g.mmd").read_text()
    check_startup_flags(argparse.Namespace(slow_phase_s=None, metrics_file=str(tmp_path / "d" / "m.prom")))
    assert (tmp_path / "d").is_dir()
    from pipeline.core.eventlog import EventLog

    log = EventLog("r", 0, str(tmp_path / "e" / "f" / "l.jsonl"))
    log.close()
    assert (tmp_path / "e" / "f" / "l.jsonl").exists()


def test_library_rejects_a_non_request():
    """build_attention_backends(None) is a typed usage error, not an AttributeError."""
    from pipeline import build_attention_backends
    from pipeline.core.errors import UsageError

    with pytest.raises(UsageError) as ei:
        build_attention_backends(None)
    assert ei.value.info.allowed == ["SetupRequest"]


class _HeadOne(io.StringIO):
    """A reader that leaves after the first line, as ``| head -1`` does: later writes meet a closed pipe."""

    def write(self, text: str) -> int:
        if "\n" in self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)

    def flush(self) -> None:
        if "\n" in self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("argv,code", [
    (["backends"], 0),
    (["backends", "--json"], 0),
    (["plan", "--device-profile", "h200", "--attention-backend", "flashinfr"], 2),
    (["plan", "--device-profile", "h200"], 0),
])
def test_a_reader_leaving_early_keeps_the_exit_code(argv, code, monkeypatch):
    """``attn-setup backends | head -1`` exited 1 (a closed pipe was a failure); the exit code is the command's,
    whether or not the reader stayed for the whole report."""
    out = _HeadOne()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(argv) == code
    assert sys.stdout is out   # restored for the caller


GOLDEN = str(ROOT / "tests" / "data" / "golden")


@pytest.mark.parametrize("argv,code", [
    (["backends"], 0),
    (["plan", "--device-profile", "h200"], 0),
    (["plan", "--device-profile", "cpu", "--attention-backend", "flashinfer"], 3),
    (["plan", "--device-profile", "cpu", "--max-reqs", "0"], 2),
    (["inspect", GOLDEN + "/h200_flashinfer.jsonl"], 0),
    (["inspect", GOLDEN + "/failed_unknown_backend.jsonl"], 1),
    (["inspect", "/nonexistent.jsonl"], 2),
    (["replay", GOLDEN + "/h200_flashinfer.jsonl"], 0),
    (["replay", "/nonexistent.jsonl"], 2),
    (["graph", GOLDEN + "/failed_unknown_backend.jsonl", "--json"], 0),
    (["graph", "/nonexistent.jsonl", "--json"], 2),
])
def test_a_reader_leaving_both_streams_keeps_the_exit_code(argv, code, monkeypatch):
    """``attn-setup … 2>&1 | head -1``: stdout and stderr are one pipe, closed after the first line. A refusal's error
    block (stderr) met the closed pipe and the command exited 1, whatever its own code; now every subcommand ends with
    its own code, a failure's included, and both streams are restored for the caller."""
    pipe = _HeadOne()
    monkeypatch.setattr(sys, "stdout", pipe)
    monkeypatch.setattr(sys, "stderr", pipe)
    assert main(argv) == code
    assert sys.stdout is pipe and sys.stderr is pipe
