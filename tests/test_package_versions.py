"""Installed package versions outside the supported ranges are refused at resolve (``package_version_unsupported``).

The ranges are written out here from docs/install.md (FlashInfer exactly 0.7.2, sglang 0.5.23's pin; torch 2.11
through 2.15; triton 3.6 through 3.9), not read from the code. Versions are faked by patching the one metadata
reader (:func:`pipeline.backends.packages.metadata_version`), which ``plan`` and a run both go through.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from conftest import run_main
from pipeline.backends import packages
from pipeline.core import events as ev
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import CapabilityMismatch, ConfigError
from pipeline.core.eventlog import EventLog
from pipeline.platforms.fake import FakePlatform
from pipeline.platforms.profiles import PROFILES
from pipeline.setup.build import build_attention_backends
from states import resolve

GOOD = {"torch": "2.13.0+cpu", "triton": "3.9.0", "flashinfer-python": "0.7.2"}
H200 = msgspec.structs.replace(PROFILES["h200"], source="test")


@pytest.mark.parametrize("dist,version,ok", [
    ("flashinfer-python", "0.7.2", True), ("flashinfer-python", "0.7.2+cu130", True),
    ("flashinfer-python", "0.7.2.post1", False), ("flashinfer-python", "0.6.13", False),
    ("flashinfer-python", "0.7.4", False), ("flashinfer-python", "0.7.2rc1", False),
    ("torch", "2.11.0+cu130", True), ("torch", "2.13.0+cpu", True), ("torch", "2.14.1", True),
    ("torch", "2.15.0", True),
    ("torch", "2.10.2", False), ("torch", "2.16.0", False), ("torch", "2.12.0.dev20260101", False),
    ("torch", "2.11.0a0+gitabc", False), ("triton", "3.6.0", True), ("triton", "3.9.0", True),
    ("triton", "3.5.1", False), ("triton", "3.10.0", False), ("torch", "not a version", False),
])
def test_supported_ranges(dist, version, ok):
    """Each end of each range is in, the next release out either side; pre-releases and nightlies are out."""
    assert packages.is_supported(dist, version) is ok
    assert packages.unsupported(dist, version) == (None if ok else version)


def test_presence_without_a_version_is_not_checked():
    """False (absent) and True (assumed by ``plan --installed``, or a trace recorded before versions) pass through."""
    assert packages.unsupported("flashinfer-python", True) is None
    assert packages.unsupported("flashinfer-python", False) is None


def _decide(args: AttentionArgs, llama, versions: dict) -> object:
    return resolve.decide(args, llama, H200, is_draft_worker=False, installed=versions)


def test_auto_skips_flashinfer_at_an_unsupported_version(llama):
    """FlashInfer 0.6.13 installed: auto-selection goes on to triton; flashinfer and fa3 are rejected naming the
    installed and the supported versions and the pip command that installs the supported one."""
    res = _decide(AttentionArgs(), llama, {**GOOD, "flashinfer-python": "0.6.13"})
    assert (res.pair.prefill, res.pair.decode) == ("triton", "triton")
    reasons = {r.backend: r.reasons for r in res.rejected["decode"]}
    want = ("package 'flashinfer-python' is 0.6.13, a version attn-setup does not support (it supports "
            "flashinfer-python==0.7.2: pip install 'flashinfer-python==0.7.2')")
    assert reasons["flashinfer"] == [want] and want in reasons["fa3"]
    assert _decide(AttentionArgs(), llama, GOOD).pair.decode == "flashinfer"


def test_explicit_choice_at_an_unsupported_version_is_refused_by_name(llama):
    """--attention-backend flashinfer with 0.6.13: package_version_unsupported in resolve (exit 3), the flags and the
    message name both versions; the remedy's first alternative (the pip pin) and its second (another backend) each
    resolve once applied."""
    versions = {**GOOD, "flashinfer-python": "0.6.13"}
    with pytest.raises(CapabilityMismatch) as ei:
        _decide(AttentionArgs(attention_backend="flashinfer"), llama, versions)
    info = ei.value.info
    assert (info.code, info.state, ei.value.exit_code) == ("package_version_unsupported", "resolve", 3)
    flags = {f.name: f.value for f in info.flags}
    assert flags["unsupported_package"] == "flashinfer-python"
    assert flags["installed_version"] == "flashinfer-python 0.6.13"
    assert flags["supported_versions"] == "flashinfer-python==0.7.2"
    assert "0.6.13" in info.message and "flashinfer-python==0.7.2" in info.message
    assert info.remedy == ("pip install 'flashinfer-python==0.7.2' (then attention_backend='flashinfer' serves it), "
                           "or set attention_backend to one of: torch_native, triton")
    assert info.allowed == ["torch_native", "triton"]
    assert _decide(AttentionArgs(attention_backend="flashinfer"), llama, GOOD).pair.decode == "flashinfer"
    for other in info.allowed:
        assert _decide(AttentionArgs(attention_backend=other), llama, versions).pair.decode == other


def test_a_missing_package_keeps_its_code(llama):
    """A missing FlashInfer is still what it was (capability_mismatch, 'is not installed'): only a version outside
    the range is package_version_unsupported."""
    with pytest.raises(CapabilityMismatch) as ei:
        _decide(AttentionArgs(attention_backend="flashinfer"), llama, {**GOOD, "flashinfer-python": False})
    assert ei.value.info.code == "capability_mismatch" and "is not installed" in ei.value.info.message


def test_torch_out_of_range_refuses_every_backend_with_the_pin(llama):
    """torch 2.10 on a CPU: no backend serves (each needs torch); the error names 2.10.2 and the supported range, and
    the remedy installs the supported torch (tried: with it assumed, the request resolves)."""
    cpu = msgspec.structs.replace(PROFILES["cpu"], source="test")
    versions = {"torch": "2.10.2", "triton": False, "flashinfer-python": False}
    with pytest.raises(ConfigError) as ei:
        resolve.decide(AttentionArgs(), llama, cpu, is_draft_worker=False, installed=versions)
    info = ei.value.info
    assert info.state == "resolve" and "2.10.2" in info.message and "torch>=2.11,<2.16" in info.message
    assert "install torch>=2.11,<2.16" in info.remedy, info.remedy
    with pytest.raises(CapabilityMismatch) as ei:
        resolve.decide(AttentionArgs(attention_backend="torch_native"), llama, cpu, is_draft_worker=False,
                       installed=versions)
    assert ei.value.info.code == "package_version_unsupported"
    assert "install torch>=2.11,<2.16 and set attention_backend='torch_native'" in ei.value.info.remedy
    assert resolve.decide(AttentionArgs(attention_backend="torch_native"), llama, cpu, is_draft_worker=False,
                          installed={**versions, "torch": True}).pair.decode == "torch_native"


def test_a_run_refuses_before_anything_is_built(llama):
    """build_attention_backends on a (faked) H200, flashinfer chosen, 0.6.13 installed: refused in resolve, no pool,
    workspace or backend made; the trace's run_started records the version resolve checked."""
    req = SetupRequest(args=AttentionArgs(attention_backend="flashinfer"), model=llama,
                       pool=PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=64), device="cuda:0")
    log = EventLog("v")
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, platform=FakePlatform(H200, "cpu"), log=log,
                                 installed={**GOOD, "flashinfer-python": "0.6.13"})
    assert ei.value.info.code == "package_version_unsupported" and ei.value.info.state == "resolve"
    assert not any(isinstance(r, (ev.BackendBuilt, ev.ResourcesReleased)) for r in log.records)
    started = next(r for r in log.records if isinstance(r, ev.RunStarted))
    assert started.packages["flashinfer-python"] == "0.6.13"


@pytest.fixture
def old_torch(monkeypatch):
    """The metadata reader answers torch 2.10.2 (what ``pip install torch==2.10.2`` would leave)."""
    real = packages.metadata_version
    monkeypatch.setattr(packages, "metadata_version", lambda d: "2.10.2" if d == "torch" else real(d))


def test_plan_and_run_refuse_alike(old_torch, tmp_path):
    """``plan`` (metadata) and ``run --device cpu`` (import, versions from the same metadata) give the same refusal:
    exit 3, the same code, message and remedy; plan's human output shows the versions it read and hides the
    package entries that are no flag."""
    plan = run_main("plan", "--device-profile", "auto", "--attention-backend", "torch_native", "--json")
    run = run_main("run", "--device", "cpu", "--attention-backend", "torch_native", "--json",
                   "--log-file", str(tmp_path / "t.jsonl"))
    assert plan.returncode == run.returncode == 3
    p, r = json.loads(plan.stdout)["error"], json.loads(run.stdout)["error"]
    assert p["code"] == r["code"] == "package_version_unsupported"
    assert (p["message"], p["remedy"]) == (r["message"], r["remedy"])
    human = run_main("plan", "--device-profile", "auto", "--attention-backend", "torch_native")
    assert human.returncode == 3 and "2.10.2" in human.stdout + human.stderr
    assert "installed_version" not in human.stdout + human.stderr


def test_plan_json_reports_the_versions_it_checked():
    """``plan --json``: ``installed`` says present or not, ``package_versions`` which version resolve checked (null
    for one assumed by --installed)."""
    out = json.loads(run_main("plan", "--device-profile", "auto", "--json").stdout)
    assert out["installed"]["torch"] is True
    assert out["package_versions"]["torch"] == packages.metadata_version("torch")
    out = json.loads(run_main("plan", "--device-profile", "h200", "--installed", "torch,flashinfer", "--json").stdout)
    assert out["installed"] == {"torch": True, "triton": False, "flashinfer-python": True}
    assert out["package_versions"] == {"torch": None, "triton": None, "flashinfer-python": None}


def test_planning_another_profile_notes_this_machines_version(monkeypatch):
    """``plan --device-profile h200`` on a machine with FlashInfer 0.6.13: the note says the packages came from this
    machine (which has flashinfer-python 0.6.13) and which --installed value plans for an H200 that has them."""
    from pipeline.cli.plan import installed_note

    real = packages.metadata_version
    monkeypatch.setattr(packages, "metadata_version", lambda d: "0.6.13" if d == "flashinfer-python" else real(d))
    installed = packages.installed_by_metadata()
    rep = json.loads(run_main("plan", "--device-profile", "h200", "--json").stdout)
    note = installed_note(rep, installed, "h200", None)
    assert note is not None and "lacks flashinfer-python 0.6.13" in note, note
    value = note.rsplit("--installed ", 1)[1]
    out = json.loads(run_main("plan", "--device-profile", "h200", "--installed", value, "--json").stdout)
    assert out["resolved"]["decode"] == "flashinfer"
