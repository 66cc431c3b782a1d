"""Device spellings: ``CUDA:0``, ``gpu``, ``Cpu`` are accepted as their canonical device, what the
user wrote is kept (``spelled_as``) in the request, the ``device_initialized`` record and ``run``'s report, and the
JSON of ``run``, ``plan`` and ``inspect`` shows ``device.type`` and ``device.arch``."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from pipeline.cli.flags import is_gpu_device
from pipeline.core.contracts import SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.validation import device_spelling
from conftest import ROOT
import re

GOLDEN = ROOT / "tests" / "data" / "golden"


@pytest.mark.parametrize("text,canonical,spelled", [
    ("cpu", "cpu", None), ("CPU", "cpu", "CPU"), ("Cpu", "cpu", "Cpu"), ("auto", "auto", None),
    ("AUTO", "auto", "AUTO"),
    ("cuda", "cuda", None), ("CUDA:0", "cuda:0", "CUDA:0"), ("gpu", "cuda", "gpu"), ("GPU:1", "cuda:1", "GPU:1"),
    ("Npu:3", "npu:3", "Npu:3"), ("xpu:0", "xpu:0", None), ("MUSA", "musa", "MUSA"),
])
def test_accepted_spellings_read_as_their_device(text, canonical, spelled):
    """Any letter case, and gpu for cuda: the canonical device, and the spelling when it differs."""
    got = device_spelling(text)
    assert got is not None and (got.canonical, got.spelled_as) == (canonical, spelled)


@pytest.mark.parametrize("text", ["", "tpu", "cuda:", "cuda:x", "cuda:\u00b2", " cpu", "cpu ", "cuda: 0",
                                  "cuda:1234567", "gpu0", None, 0])
def test_other_text_is_no_device(text):
    """Blanks, unknown types, indexes that are not ASCII digits (or longer than 6): no device."""
    assert device_spelling(text) is None


def test_the_request_keeps_the_spelling_that_matches_its_device(llama):
    """SetupRequest.device_spelled_as must spell ``device``; another device's spelling is refused."""
    assert SetupRequest(model=llama, device="cuda:0", device_spelled_as="CUDA:0").device_spelled_as == "CUDA:0"
    with pytest.raises(ConfigError) as e:
        SetupRequest(model=llama, device="cuda:1", device_spelled_as="CUDA:0")
    assert e.value.info.code == "invalid_value" and e.value.info.flags[0].name == "device_spelled_as"


@pytest.mark.parametrize("text,gpu", [("CUDA:0", True), ("gpu", True), ("Gpu:2", True), ("CPU", False)])
def test_gpu_spellings_are_gpus(text, gpu):
    """is_gpu_device reads every accepted spelling (``CUDA:0`` sizes its pools as a GPU run)."""
    assert is_gpu_device(text) is gpu


def _run(capsys, tmp_path, *flags):
    log = tmp_path / "run.jsonl"
    code = main(["run", "--num-layers", "1", "--decode-steps", "1", "--log-file", str(log), *flags])
    return code, capsys.readouterr(), log


def test_run_keeps_and_shows_the_spelling(capsys, tmp_path):
    """``run --device CPU``: runs on cpu; --json has device.type, device.arch and device.spelled_as; the log's
    device_initialized record and inspect keep it; the human report prints the device and the spelling."""
    code, cap, log = _run(capsys, tmp_path, "--device", "CPU", "--json")
    out = json.loads(cap.out)
    assert code == 0 and out["device"]["type"] == "cpu" and out["device"]["spelled_as"] == "CPU"
    assert "arch" in out["device"] and out["device"]["arch"] is None  # no compute capability on a CPU
    rec = next(json.loads(line) for line in log.read_text().splitlines() if '"device_initialized"' in line)
    assert rec["spelled_as"] == "CPU" and rec["facts"]["type"] == "cpu"
    assert main(["inspect", str(log), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["decisions"]["device"]["spelled_as"] == "CPU" and run["decisions"]["device"]["type"] == "cpu"
    assert main(["inspect", str(log)]) == 0 and "device: cpu" in (out := capsys.readouterr().out) and ", written as CPU" in out
    code, cap, _ = _run(capsys, tmp_path, "--device", "Cpu")
    assert code == 0 and "device: cpu" in cap.out and "written as Cpu" in cap.out


def test_canonical_spelling_records_none(capsys, tmp_path):
    """``--device cpu`` is what it means: spelled_as is null and the report says nothing about a spelling."""
    code, cap, log = _run(capsys, tmp_path, "--device", "cpu", "--json")
    out = json.loads(cap.out)
    assert code == 0 and out["device"]["spelled_as"] is None and '"spelled_as":null' in log.read_text()


def test_plan_json_has_device_type_and_arch(capsys):
    """plan --json's device has ``type`` and ``arch`` (sm90 for an H200 profile, None for cpu)."""
    assert main(["plan", "--json", "--device-profile", "h200", "--installed", "torch,triton"]) == 0
    dev = json.loads(capsys.readouterr().out)["device"]
    assert dev["type"] == "cuda" and dev["arch"] == "sm90"
    assert main(["plan", "--json", "--device-profile", "cpu"]) == 0
    dev = json.loads(capsys.readouterr().out)["device"]
    assert dev["type"] == "cpu" and dev["arch"] is None


def _device_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("device: ")]


def test_run_and_inspect_print_one_device_line(capsys, tmp_path):
    """``run`` and ``inspect`` of its log print the same ``device:`` line (it was ``device: cpu x86_64`` against
    ``device: cpu:0 x86_64 blas_init=False``); a GPU trace reads as README's ``device: cuda:0 NVIDIA H200 (sm90)``."""
    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "0", "--no-progress",
                 "--log-file", str(log)]) == 0
    ran = _device_lines(capsys.readouterr().out)
    assert main(["inspect", str(log)]) == 0
    seen = _device_lines(capsys.readouterr().out)
    assert len(ran) == 1 and ran == seen and "blas_init" not in ran[0], (ran, seen)
    assert main(["inspect", str(GOLDEN / "h200_fa3.jsonl")]) == 0
    assert _device_lines(capsys.readouterr().out) == ["device: cuda:0 NVIDIA H200 (sm90)"]


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_cuda(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("written", ["gpu:1", "GPU", "cuda:1", "Cuda"])
def test_device_is_shown_as_written(written, tmp_path, capsys):
    """``--device gpu:1`` on a CPU host: the error (printed and logged) shows ``gpu:1``, not the platform's 'cuda'."""
    log = tmp_path / "r.jsonl"
    assert main(["run", "--device", written, "--log-file", str(log), "--json"]) == 3
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "device_unavailable" and err["flags"] == [{"name": "--device", "value": written}]
    failed = [json.loads(ln) for ln in log.read_text().splitlines() if '"run_failed"' in ln]
    assert failed and failed[-1]["error"]["flags"][0]["value"] == written
    assert main(["warmup", "--device", written]) == 3
    assert re.search(rf"flag +--device = '{re.escape(written)}'", capsys.readouterr().err)


def test_a_device_with_no_platform_names_the_supported_types(tmp_path, capsys):
    """``--device mps``: no accelerator or plugin would help; the remedy names the device types there are."""
    assert main(["run", "--device", "mps", "--log-file", str(tmp_path / "r.jsonl"), "--json"]) == 3
    remedy = json.loads(capsys.readouterr().out)["error"]["remedy"]
    assert "cpu, cuda, musa, npu, xpu" in remedy and "torch plugin" not in remedy, remedy
