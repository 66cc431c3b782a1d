"""``plan`` of a named profile on a machine that lacks a backend's package says that the packages came from this
machine and which ``--installed`` value plans for a machine that has them (a CPU box's plan for an
H200 quietly answered ``triton``, its rejection lines saying ``pip install flashinfer-python``); following it, no
backend is rejected for a package."""

from __future__ import annotations

import json

from conftest import run_main

from pipeline.cli.plan import installed_note, plan_report
from pipeline.platforms.profiles import names as profile_names
import pytest
import re


def _report(profile: str, installed: dict[str, bool]) -> dict:
    from pipeline.cli.flags import build_parser
    from pipeline.cli.flags import request_from
    from pipeline.platforms.profiles import get

    device = get(profile)
    ns = build_parser().parse_args(["plan", "--device-profile", profile])
    ns.device = device.device_str
    return plan_report(request_from(ns, on_gpu=device.type != "cpu"), device, installed)


def test_the_note_names_what_is_missing_and_the_value_to_pass():
    installed = {"torch": True, "triton": True, "flashinfer-python": False}
    note = installed_note(_report("h200", installed), installed, "h200", None)
    assert note is not None
    assert "lacks flashinfer-python" in note and "fa3, flashinfer were rejected" in note
    value = note.rsplit("--installed ", 1)[1]
    assert value == "torch,triton,flashinfer"
    proc = run_main("plan", "--device-profile", "h200", "--installed", value, "--json")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and out["resolved"]["prefill"] == "flashinfer"
    reasons = [r for side in out["rejected"].values() for x in side for r in x["reasons"]]
    assert not any("is not installed" in r for r in reasons), reasons


def test_no_note_when_installed_is_given_for_this_machine_or_nothing_is_missing():
    lacking = {"torch": True, "triton": True, "flashinfer-python": False}
    rep = _report("h200", lacking)
    assert installed_note(rep, lacking, "h200", "torch,triton") is None       # the user said what is installed
    assert installed_note(rep, lacking, "auto", None) is None                 # this machine: installing is the fix
    full = {"torch": True, "triton": True, "flashinfer-python": True}
    assert installed_note(_report("h200", full), full, "h200", None) is None


def test_the_human_plan_prints_it_before_the_verdict(monkeypatch):
    from pipeline.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "installed_from", lambda flag: {"torch": True, "triton": True,
                                                                  "flashinfer-python": False})
    proc = run_main("plan", "--device-profile", "h200")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    text = " ".join(" ".join(lines).split())
    assert proc.returncode == 0 and lines[-1].strip() == "ok"
    assert "note: packages were read from this machine" in text and "--installed torch,triton,flashinfer" in text


def test_no_note_where_the_packages_would_not_help():
    """b200 (sm100): flashinfer and fa3 are refused for the arch too, so assuming every package would not bring them
    back; the note would be untrue and is not printed."""
    lacking = {"torch": True, "triton": True, "flashinfer-python": False}
    rep = _report("b200", lacking)
    assert any("is not installed" in reason for side in rep["rejected"].values() for r in side for reason in r["reasons"])
    assert installed_note(rep, lacking, "b200", None) is None


@pytest.mark.parametrize("value", ["bogus", "torch,bogus", "Foo,bar"])
def test_installed_remedy_is_true_and_readable(value):
    """``plan --installed bogus`` suggested ``--installed ''``, which a GPU profile then refused (exit 3,
    capability_mismatch), in a garbled sentence. The remedy's value now plans on every profile."""
    from conftest import run_main

    for profile in profile_names():
        err = _json(run_main("plan", "--installed", value, "--device-profile", profile, "--json"))["error"]
        assert err["code"] == "out_of_domain"
        remedy = err["remedy"]
        assert "the names of the list" not in remedy
        assert re.search(r"'(bogus|Foo)'.* (is not a package|are not packages) a plan reads", remedy), remedy
        fixed = re.search(r"pass --installed (\S+) to plan", remedy).group(1)
        assert fixed == "torch,triton,flashinfer"
        assert run_main("plan", "--installed", fixed, "--device-profile", profile).returncode == 0, profile


def _json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flag, word", [("torch==2.13.0,torch==2.11.0", "torch more than once"),
                                        ("torch,TORCH", "torch more than once"),
                                        ("torch,,triton", "empty entry")])
def test_installed_names_each_package_once(flag, word, capsys):
    """``--installed`` naming a package twice kept one of the two silently; an empty entry passed unnoticed. Both
    are usage errors (exit 2) naming the flag; ``''`` (nothing installed) is no usage error."""
    from pipeline.cli import main

    assert main(["plan", "--installed", flag]) == 2
    err = capsys.readouterr().err
    assert word in err and "--installed" in err
    assert main(["plan", "--installed", ""]) != 2  # nothing installed: refused for that (3), not a usage error
