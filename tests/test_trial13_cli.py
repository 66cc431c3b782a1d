"""Trial 13's command-line findings 4-9: remedies that are true, one check for a flag and its variable, values
shown as given, help text in full, README commands that end quietly."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.platforms.profiles import names as profile_names


def _json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value", ["bogus", "torch,bogus", "Foo,bar"])
def test_installed_remedy_is_true_and_readable(value):
    """Finding 4: ``plan --installed bogus`` suggested ``--installed ''``, which a GPU profile then refused (exit 3,
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


def _ns(**kw):
    import argparse

    return argparse.Namespace(**{**dict(world_size=1, rank=0, decode_steps=3), **kw})


def test_large_model_notice_suggests_fewer_layers_than_in_use():
    """Finding 5: ``run --model deepseek-v3.json`` (default 2 layers, 5.9 GiB) said "--num-layers 2 verifies the same
    layer kinds in seconds": the count already in use. The notice names a count below the one in use (run's
    default, else the fewest with one layer of each kind) with its estimate, or says it is already the fewest."""
    from conftest import CONFIGS
    from pipeline.cli.run import run_notices
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    def notice(cfg: str, layers: int) -> str:
        req = SetupRequest(args=AttentionArgs(), model=load_model_spec(CONFIGS / cfg), device="cpu")
        return " ".join(run_notices(_ns(), req, layers, False))

    v3 = notice("deepseek-v3.json", 2)
    assert v3.startswith("2 attention layers need about 5.9 GiB")
    assert "--num-layers 2" not in v3 and "--num-layers 1 verifies the same layer kinds with about 2.9 GiB" in v3
    assert notice("deepseek-v3.json", 1) == ""  # 2.9 GiB: below the notice's 4 GiB
    from pipeline.cli.run import _fewer

    v3_spec = load_model_spec(CONFIGS / "deepseek-v3.json")
    assert _fewer(v3_spec, 1, "bfloat16") == "1 is already the fewest attention layers that include every layer kind " \
                                            "of this model"
    assert "--num-layers 2 verifies the same layer kinds with about 0.8 GiB" in notice("llama-3.1-8b.json", 32)
    # Gemma-3 needs 6 leading layers for both kinds: 7 suggests 6, never fewer than cover both kinds
    g3 = notice("gemma-3-12b-it.json", 40)
    assert "--num-layers 6 verifies" in g3


@pytest.mark.parametrize("name,flag,value", [
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "-5"),
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "abc"),
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "0"),
    ("SGLANG_ZBAL_LOCAL_MEM_SIZE", "--zbal-local-mem-size", "-1"),
])
@pytest.mark.parametrize("command", ["plan", "run", "warmup"])
def test_env_size_passes_the_flags_check(name, flag, value, command, monkeypatch):
    """Finding 6: ``SGLANG_FLASHINFER_WORKSPACE_SIZE=-5`` (or ``abc``) was exit 3 ``invalid_value`` while
    ``--flashinfer-workspace-size -5`` is exit 2 ``out_of_domain``; README: an environment value "passes the same
    check as the flag". Now the same refusal as the flag's, naming the variable, with a remedy that passes."""
    from conftest import run_main

    flag_err = _json(run_main(command, flag, value, "--json"))["error"] if value.lstrip("-").isdigit() else None
    monkeypatch.setenv(name, value)
    proc = run_main(command, "--json")
    assert proc.returncode == 2
    err = _json(proc)["error"]
    assert err["code"] == "out_of_domain" and err["state"] == "args"
    assert err["flags"][0]["name"] == name and err["message"].startswith(f"{name}=")
    if flag_err is not None:  # the flag with that value: the same code and domain
        assert (flag_err["code"], flag_err["allowed"]) == (err["code"], err["allowed"])
    assert f"unset {name}" in err["remedy"] and "else" not in err["remedy"].split(")")[0]


def test_a_bad_model_file_keeps_its_code_as_readme_now_says():
    """Finding 6 (second half): README's pipe paragraph said "a bad --model is still 2", but a --model that reads
    and is not JSON has always been ``model_config_malformed``, exit 3 (a refused configuration; a nested-bracket
    file is pinned at 3); only an unreadable one is 2. The code stays, README says which is which."""
    from conftest import ROOT, run_main

    assert run_main("plan", "--model", str(ROOT / "examples/configs/README.md")).returncode == 3
    assert run_main("plan", "--model", str(ROOT / "no-such-config.json")).returncode == 2
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "a bad `--model` is still 2" not in readme
    assert "a `--model` that cannot be read — `config_unreadable` — is still 2" in readme
    assert "`model_config_malformed`, e.g. not JSON — still 3" in readme


@pytest.mark.parametrize("typed,near", [("rnu", "run"), ("inpsect", "inspect"), ("foo", None)])
def test_unknown_command_shows_what_was_typed_and_the_nearest(typed, near):
    """Finding 7: ``attn-setup foo`` / ``rnu`` printed ``field command = (no value)`` though a value was given, and
    no "did you mean" (run's flags have one)."""
    from conftest import run_main

    proc = run_main(typed)
    assert proc.returncode == 2
    assert f"command = {typed!r}" in proc.stderr and "(no value)" not in proc.stderr
    assert ("did you mean" in proc.stderr) is (near is not None)
    if near:
        assert f"did you mean {near!r}?" in proc.stderr
    err = _json(run_main(typed, "--json"))["error"]
    assert err["flags"] == [{"name": "command", "value": typed}]


def test_an_empty_string_is_shown_as_typed_and_a_missing_value_as_none_typed():
    """Finding 7: ``--log-file ''`` and ``plan --installed ''`` showed ``(no value)``; an empty string given is
    ``''``. A flag typed without any value (``--log-file`` last, a missing LOG, an unknown flag) keeps
    ``(no value)``."""
    from conftest import run_main

    proc = run_main("run", "--log-file", "")
    assert proc.returncode == 2 and "--log-file = ''" in proc.stderr
    proc = run_main("plan", "--installed", "")
    assert proc.returncode == 3 and "--installed = ''" in proc.stderr and "(no value)" not in proc.stderr
    assert "--log-file = (no value)" in run_main("run", "--log-file").stderr
    assert "LOG = (no value)" in run_main("replay").stderr
    assert "--bogus = (no value)" in run_main("run", "--bogus").stderr


def test_run_help_shows_every_field_doc_whole():
    """Finding 8: ``run --help`` cut ``--cuda-graph-max-bs``'s help at its docstring's first line ("… else min(the
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


class _ClosedPipe:
    """A stdout whose reader left after the first write (``| head -3``)."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        import io

        raise io.UnsupportedOperation("fileno")


def test_events_table_ends_quietly_when_the_reader_leaves(monkeypatch):
    """Finding 9: ``python3 -m pipeline.core.events | head -3`` (README) ended in a BrokenPipeError traceback; it now
    ends quietly with 0, as the CLI's commands do."""
    import runpy
    import sys
    import warnings

    pipe = _ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the module is already imported: runpy says so
        with pytest.raises(SystemExit) as ei:
            runpy.run_module("pipeline.core.events", run_name="__main__")
    assert ei.value.code == 0 and pipe.writes == 1


def test_config_readme_points_at_modules_that_exist():
    """Finding 9: examples/configs/README.md named ``pipeline.model_spec.load_model_spec`` and ``LAYER_RULES`` in
    ``pipeline/model_spec.py`` (both moved to ``pipeline/core/``, issue 15): every module path it names exists."""
    from conftest import ROOT

    text = (ROOT / "examples" / "configs" / "README.md").read_text()
    for path in re.findall(r"`(pipeline/[\w/.]+\.py)`", text):
        assert (ROOT / path).is_file(), path
    for dotted in re.findall(r"`(pipeline(?:\.\w+)+)`", text):
        module, _, attr = dotted.rpartition(".")
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), dotted
        assert f"def {attr}" in (ROOT / (module.replace(".", "/") + ".py")).read_text(), dotted
    assert "`LAYER_RULES` in `pipeline/core/layer_rules.py`" in text
    assert "LAYER_RULES: dict" in (ROOT / "pipeline" / "core" / "layer_rules.py").read_text()
    assert "--dtype auto` gives float16" in text  # gpt-oss: no torch_dtype (finding 1)
