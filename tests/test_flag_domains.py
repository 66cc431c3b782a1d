"""Every flag of the domain table (pipeline/cli/flags.py), generated: values below, above and at its bounds,
values of the wrong type, NaN / infinities, empty text and unknown choices. Each out-of-domain value is exit 2
``out_of_domain`` naming the flag, the value and the domain, raised before a log is opened; each value at a bound
and each remedy's suggestion passes. In-process through ``pipeline.cli.main``."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from pipeline.cli import build_parser, main
from pipeline.cli.flags import FLAG_DOMAINS, FlagDomain, check_flags, domains_of
from pipeline.core.errors import InvalidValue
from conftest import ROOT, run_json
from pipeline.core.errors import UsageError

GOLDEN = ROOT / "tests" / "data" / "golden"
LOG = str(GOLDEN / "ok_default.jsonl")

BASE = {"run": ["run", "--device", "cpu"], "plan": ["plan", "--device-profile", "cpu"],
        "warmup": ["warmup", "--device", "cpu"], "inspect": ["inspect"], "replay": ["replay"], "graph": ["graph"]}
ROWS = [(cmd, fd) for fd in FLAG_DOMAINS for cmd in fd.commands]


def _num(v: float, kind: str) -> str:
    return str(int(v)) if kind == "int" else repr(float(v))


def bad_values(fd: FlagDomain) -> list[str]:
    """Text values outside ``fd``'s domain, as a user would type them."""
    d = fd.domain
    if d.kind in ("int", "float"):
        out = ["abc", ""] + (["1.5", "nan"] if d.kind == "int" else ["nan", "inf", "-inf"])
        if d.lo is not None:
            out.append(_num(d.lo if d.lo_open else d.lo - 1, d.kind))
        if d.hi is not None:
            out.append(_num(d.hi if d.hi_open else d.hi + 1, d.kind))
        return out
    if d.kind == "choice":
        return ["", "no-such-choice"]
    if d.kind == "text":
        return ["", "   "]
    if d.kind == "device":
        return ["", "tpu", "cuda:x", "cuda:\u00b2", " cpu", "cuda:1234567"]
    return ["nope", "torch,nope"]  # packages


def good_values(fd: FlagDomain) -> list[str]:
    """Values inside the domain: its bounds (closed ones exactly, open ones just inside), its choices, the
    remedy's example."""
    d = fd.domain
    out = [str(d.example)]
    if d.kind in ("int", "float"):
        if d.lo is not None:
            out.append(_num(d.lo, d.kind) if not d.lo_open else repr(d.lo + 1e-9))
        if d.hi is not None:
            out.append(_num(d.hi, d.kind) if not d.hi_open else repr(d.hi - 1e-9))
    elif d.kind == "choice":
        out += list(d.choices) + ([d.choices[0].upper()] if d.any_case else [])
    elif d.kind == "device":
        out += ["auto", "cpu", "CPU", "cuda", "CUDA:0", "gpu", "Gpu:1", "npu:3", "XPU"]
    elif d.kind == "packages":
        out += ["", "torch", "TORCH, Triton", "flashinfer"]
    return out


def argv_for(cmd: str, fd: FlagDomain, value: str, tmp) -> list[str]:
    """``cmd``'s command line with ``fd`` set to ``value`` (attached with ``=``: a value may start with '-')."""
    head = list(BASE[cmd])
    if cmd == "run":
        head += ["--log-file", str(tmp / "logs" / "{run_id}.jsonl")]
    if fd.flag == "LOG":
        return head + [value]
    if cmd in ("inspect", "replay") or (cmd == "graph" and fd.dest == "rank"):
        head.append(str(tmp / "x.jsonl"))
    if fd.dest == "rank" and cmd != "graph":
        head.append(f"--world-size={fd.domain.hi + 1:.0f}")  # the largest rank needs the largest world
    if fd.dest == "speculative_eagle_topk":
        head += ["--speculative-algorithm", "EAGLE"]
    return head + [f"{fd.flag}={value}"]


def _ids(rows):
    return [f"{cmd}{fd.flag}" for cmd, fd in rows]


@pytest.mark.parametrize("cmd,fd", ROWS, ids=_ids(ROWS))
def test_every_value_outside_the_domain_is_exit_2_naming_the_flag(cmd, fd, tmp_path, capsys):
    """Below, above, wrong type, NaN/inf, empty: exit 2 ``out_of_domain`` naming the flag and its domain; no log."""
    for value in bad_values(fd):
        code = main(argv_for(cmd, fd, value, tmp_path) + ["--json"])
        out = json.loads(capsys.readouterr().out)
        err = out["error"]
        assert code == 2 and err["code"] == "out_of_domain", (value, err)
        assert [f["name"] for f in err["flags"]][:1] == [fd.flag], (value, err)
        assert fd.flag in err["message"] and err["allowed"] and err["remedy"], err
        assert not (tmp_path / "logs").exists(), "refused before the log is opened"


@pytest.mark.parametrize("cmd,fd", ROWS, ids=_ids(ROWS))
def test_values_at_the_bounds_and_the_remedy_example_pass(cmd, fd, tmp_path):
    """Closed bounds exactly, open bounds just inside, every choice and the remedy's example pass the check."""
    parser = build_parser()
    for value in good_values(fd):
        ns = parser.parse_args(argv_for(cmd, fd, value, tmp_path))
        check_flags(ns)
        assert fd.domain.admits(getattr(ns, fd.dest)[0] if isinstance(getattr(ns, fd.dest), list)
                                else getattr(ns, fd.dest)), value


@pytest.mark.parametrize("cmd,fd", ROWS, ids=_ids(ROWS))
def test_the_remedy_is_true(cmd, fd, tmp_path, capsys):
    """The remedy drops the flag (when it has a default: leaving it out always passes) and/or names a value for
    it; the value named, put in place of the refused one, passes."""
    assert main(argv_for(cmd, fd, bad_values(fd)[-1], tmp_path) + ["--json"]) == 2
    remedy = json.loads(capsys.readouterr().out)["error"]["remedy"]
    assert ("drop " + fd.flag in remedy) == bool(fd.default), remedy
    named = re.search(rf"(?:e\.g\.|pass) {re.escape(fd.flag)} (\S+)", remedy)
    assert named is not None or fd.hint or fd.flag == "LOG", remedy
    if named is not None:
        value = named.group(1).rstrip(",;").strip("'")
        check_flags(build_parser().parse_args(argv_for(cmd, fd, value, tmp_path)))


def _value_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of a subcommand's parser that take a value (not --help, not the on/off switches)."""
    out = set()
    for a in parser._actions:
        if a.nargs == 0 or isinstance(a, argparse._HelpAction):
            continue
        out.add(next((o for o in a.option_strings if o.startswith("--")), "LOG" if a.dest == "logs" else a.dest))
    return out


def test_the_table_holds_every_flag_that_takes_a_value():
    """A new flag with a value cannot be added without its domain: every subcommand's are in the table."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for cmd, parser in sub.items():
        assert _value_flags(parser) == {fd.flag for fd in domains_of(cmd)}, cmd


@pytest.mark.parametrize("argv,says", [
    (["graph", "--rank", "3", "--json"], "no LOG was given"),
    (["graph", "--rank=-1", "--json"], "an integer in [0, "),
    (["graph", "--rank=-1", "x.jsonl", "--json"], "an integer in [0, "),
    (["plan", "--rank", "2", "--world-size", "2", "--json"], "below --world-size 2"),
])
def test_graph_and_setup_rank_refusals(argv, says, capsys):
    """``graph --rank N`` without a LOG, a negative rank, a rank not below --world-size: exit 2 saying why."""
    assert main(argv) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "out_of_domain" and says in err["message"] + " ".join(err["allowed"]), err
    assert err["flags"][0]["name"] == "--rank"


@pytest.mark.parametrize("value", ["2", "0", "-0.5", "nan", "inf", "1e999"])
def test_mem_fraction_outside_0_1_is_refused_before_the_log_opens(value, tmp_path, capsys):
    """``--mem-fraction`` outside (0, 1] (NaN and infinities too) is exit 2 before the log file is opened."""
    log = tmp_path / "run.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), f"--mem-fraction={value}"])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["flags"] == [{"name": "--mem-fraction", "value": str(float(value))
                                           if not math.isfinite(float(value)) else float(value)}]
    assert "(0, 1]" in err["allowed"][0] and not log.exists()


def test_human_error_names_flag_value_and_domain(capsys):
    """Without --json the refusal is one block on stderr: the flag, the value given, what is allowed, a remedy."""
    assert main(["plan", "--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "--page-size 0 is not allowed" in err and "an integer in [1, 4096]" in err and "remedy:" in err


def _typos(choice: str) -> list[str]:
    """``choice`` with one letter dropped, one doubled and two neighbours swapped (as a user mistypes)."""
    out = [choice[:i] + choice[i + 1:] for i in range(len(choice))] + [choice[:i] + choice[i] + choice[i:]
                                                                       for i in range(len(choice))]
    return out + [choice[:i] + choice[i + 1] + choice[i] + choice[i + 2:] for i in range(len(choice) - 1)]


CHOICE_ROWS = [(cmd, fd) for cmd, fd in ROWS if fd.domain.kind in ("choice", "packages")]


@pytest.mark.parametrize("cmd,fd", CHOICE_ROWS, ids=_ids(CHOICE_ROWS))
def test_a_mistyped_choice_gets_did_you_mean_the_nearest(cmd, fd, tmp_path):
    """Every choice flag: each one-letter typo of each choice that the domain refuses says "did you mean X?" with X
    a choice at least as near to the typo as the one mistyped (usually that one)."""
    import difflib

    parser = build_parser()
    for choice in fd.domain.choices:
        for typo in {t for t in _typos(choice) if t.strip() and not fd.domain.admits(t)}:
            with pytest.raises(InvalidValue) as e:
                check_flags(parser.parse_args(argv_for(cmd, fd, typo, tmp_path)))
            said = re.search(r"did you mean '([^']+)'\?", e.value.info.message)
            assert said is not None and said.group(1) in fd.domain.choices, (typo, e.value.info.message)

            def ratio(c: str) -> float:
                return difflib.SequenceMatcher(None, typo.lower(), c.lower()).ratio()

            assert ratio(said.group(1)) >= ratio(choice), (typo, said.group(1), choice)


def test_the_trial_backend_typo_names_flashinfer(capsys):
    """``run --attention-backend flashinfr``: exit 2 naming 'flashinfer'."""
    assert main(["run", "--attention-backend", "flashinfr", "--json"]) == 2
    assert "did you mean 'flashinfer'?" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_a_value_near_no_choice_gets_no_suggestion(capsys):
    """A value far from every choice lists the choices without guessing."""
    assert main(["run", "--attention-backend", "zzzzzz", "--json"]) == 2
    assert "did you mean" not in json.loads(capsys.readouterr().out)["error"]["message"]


@pytest.mark.parametrize("argv", [
    ["inspect", "-v", LOG], ["inspect", LOG, "-v"], ["replay", "-v", LOG], ["backends", "-v"],
    ["graph", "-v", LOG], ["backends", "--verbose"],
])
def test_verbose_after_the_subcommand_is_refused_with_its_reason(capsys, argv):
    """``inspect -v LOG``, ``replay -v LOG``, ``backends -v``, ``graph -v LOG --json``: exit 2 with the same refusal
    as ``attn-setup -v inspect`` (why the command has no events, ``attn-setup run -v``), not argparse's
    ``unrecognized arguments: -v``."""
    command = argv[0]
    assert main([*argv, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert "unrecognized" not in err["message"], err
    assert f"'attn-setup {command}' has none" in err["message"] and err["flags"] == [{"name": "-v", "value": True}]
    assert "drop -v" in err["remedy"] and f"see 'attn-setup {command} --help'" in err["remedy"]
    assert main(argv) == 2 and f"'attn-setup {command}' has none" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv", [
    ["inspect", "--json", "--device", "cpu", LOG], ["inspect", LOG, "--device", "cpu", "--json"],
    ["replay", "--device", "cpu", LOG, "--json"], ["graph", LOG, "--device", "cpu", "--json"],
])
def test_an_unknown_flag_is_named_with_the_value_that_followed_it(capsys, argv):
    """argparse took ``cpu`` for a LOG; the error still names ``--device`` with ``cpu`` (as ``plan --device cpu``
    does) and says which subcommands have ``--device``."""
    assert main(argv) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--device", "value": "cpu"}], err
    assert err["message"].endswith("unrecognized arguments: --device cpu"), err["message"]
    assert f"--device is a flag of attn-setup run and attn-setup warmup, not of attn-setup {argv[0]}" in err["remedy"]


def test_an_unknown_switch_before_a_flag_has_no_value(capsys):
    """The word after an unknown flag is its value only when it is not a flag itself."""
    assert main(["inspect", LOG, "--strict", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--strict", "value": ""}] and err["message"].endswith("arguments: --strict")
    assert main(["plan", "--device", "cpu", "--json"]) == 2  # plan's form is unchanged
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--device", "value": "cpu"}] and "did you mean --device-profile" in err["remedy"]


@pytest.mark.parametrize("name,flag,value", [
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "-5"),
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "abc"),
    ("SGLANG_FLASHINFER_WORKSPACE_SIZE", "--flashinfer-workspace-size", "0"),
    ("SGLANG_ZBAL_LOCAL_MEM_SIZE", "--zbal-local-mem-size", "-1"),
])
@pytest.mark.parametrize("command", ["plan", "run", "warmup"])
def test_env_size_passes_the_flags_check(name, flag, value, command, monkeypatch):
    """``SGLANG_FLASHINFER_WORKSPACE_SIZE=-5`` (or ``abc``) was exit 3 ``invalid_value`` while
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


@pytest.mark.parametrize("typed,near", [("rnu", "run"), ("inpsect", "inspect"), ("foo", None)])
def test_unknown_command_shows_what_was_typed_and_the_nearest(typed, near):
    """``attn-setup foo`` / ``rnu`` printed ``field command = (no value)`` though a value was given, and
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
    """``--log-file ''`` and ``plan --installed ''`` showed ``(no value)``; an empty string given is
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


def _json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


BIG = "2147483647"


# -- 7. nits: --json=1 in JSON, the dist timeout variable's remedy, ASCII-only numbers -------------------------------
def test_json_with_a_value_is_refused_in_json():
    """``plan --json=1`` printed a human error; it is the JSON error object, naming the switch and what it takes."""
    import json

    from conftest import run_main

    proc = run_main("plan", "--json=1")
    err = json.loads(proc.stdout)["error"]
    assert proc.returncode == 2 and err["code"] == "usage" and err["flags"] == [{"name": "--json", "value": "1"}]
    assert err["allowed"] == ["--json alone (a switch takes no value)"] and proc.stderr == ""
    assert err["remedy"].startswith("pass --json without =1")


@pytest.mark.parametrize("raw", ["inf", "nan", "0", "-1", "1e9"])
def test_a_bad_dist_timeout_variable_is_named_as_a_variable_and_its_remedy_runs(tmp_path, monkeypatch, raw):
    """``ATTN_SETUP_DIST_TIMEOUT=inf`` got "pass ATTN_SETUP_DIST_TIMEOUT 60" (a flag's wording, value null); now
    the variable as set and "export ATTN_SETUP_DIST_TIMEOUT=60", which then runs ok."""
    monkeypatch.setenv("ATTN_SETUP_DIST_TIMEOUT", raw)
    rc, out = run_json("run", "--log-file", str(tmp_path / "l.jsonl"))
    err = out["error"]
    assert rc == 2 and err["flags"] == [{"name": "ATTN_SETUP_DIST_TIMEOUT", "value": raw}], err
    assert err["message"] == f"ATTN_SETUP_DIST_TIMEOUT='{raw}' must be a number of seconds in (0, 86400]"
    assert err["remedy"] == ("export ATTN_SETUP_DIST_TIMEOUT=60, or unset it (60 s), or pass --dist-timeout 60")
    if raw == "inf":
        monkeypatch.setenv("ATTN_SETUP_DIST_TIMEOUT", "60")
        assert run_json("run", "--log-file", str(tmp_path / "l.jsonl"))[0] == 0


@pytest.mark.parametrize("flag,value", [("--max-reqs", "٣"), ("--max-reqs", "３"), ("--max-reqs", "8_0"),
                                        ("--cuda-graph-max-bs", "３"), ("--max-context-len", "1_024"),
                                        ("--page-size", "١")])
def test_integer_flags_take_ascii_digits_only(flag, value):
    """Python's int() took ``٣``, ``３`` and ``8_0``; a flag's integer is ASCII digits, else the flag's refusal."""
    import json

    from conftest import run_main

    proc = run_main("plan", "--json", flag, value)
    err = json.loads(proc.stdout)["error"]
    assert proc.returncode == 2 and err["code"] == "out_of_domain", err
    assert err["flags"] == [{"name": flag, "value": value}] and "invalid int value" in err["message"]


def test_ascii_numbers():
    from pipeline.core.numbers import ascii_float, ascii_int

    assert [ascii_int(s) for s in ("8", "+8", "-3", " 80 ", "007")] == [8, 8, -3, 80, 7]
    assert [ascii_float(s) for s in ("0.5", ".5", "5.", "1e-3", "-2E+2", "inf")] == [0.5, 0.5, 5.0, 1e-3, -200.0,
                                                                                      float("inf")]
    for bad in ("٣", "３", "8_0", "0x10", "", "1.5", "8\n"):
        with pytest.raises(ValueError):
            ascii_int(bad)
    for bad in ("٠.٥", "1_0.5", "0x1p3", "", "1e", "."):
        with pytest.raises(ValueError):
            ascii_float(bad)


@pytest.mark.parametrize("var", ["ATTN_SETUP_SLOW_PHASE_S", "ATTN_SETUP_DIST_TIMEOUT", "ATTN_SETUP_MAX_MEMORY_IMBALANCE"])
@pytest.mark.parametrize("text", ["٣", "３", "0_5"])
def test_the_variables_take_ascii_numbers_as_their_flags_do(var, text, monkeypatch):
    """``ATTN_SETUP_DIST_TIMEOUT=٣`` was taken as 3 s (Python's float() reads any Unicode digit), while
    ``--dist-timeout ٣`` is refused; each variable is now refused naming itself and the value as set."""
    from pipeline.observe.startup import slow_threshold
    from pipeline.setup.distributed import max_imbalance_from
    from pipeline.setup.rank_watch import timeout_from_env

    monkeypatch.setenv(var, text)
    read = {"ATTN_SETUP_SLOW_PHASE_S": lambda: slow_threshold(None),
            "ATTN_SETUP_DIST_TIMEOUT": lambda: timeout_from_env(60.0),
            "ATTN_SETUP_MAX_MEMORY_IMBALANCE": lambda: max_imbalance_from(None)}[var]
    with pytest.raises(UsageError) as e:
        read()
    assert e.value.exit_code == 2 and var in e.value.info.message and text in e.value.info.message


def test_a_blank_slow_phase_variable_is_unset_as_the_others(monkeypatch):
    from pipeline.observe.startup import slow_threshold
    from pipeline.setup.rank_watch import timeout_from_env

    monkeypatch.setenv("ATTN_SETUP_SLOW_PHASE_S", " ")
    monkeypatch.setenv("ATTN_SETUP_DIST_TIMEOUT", " ")
    assert slow_threshold(None) is None and timeout_from_env(60.0) == 60.0
