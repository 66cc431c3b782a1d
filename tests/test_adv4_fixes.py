"""The adversarial tester's fourth pass (s13plan): each finding's command, in-process, before and after its fix.

1. ``plan`` with a top of 2**31-1 refuses in seconds and bounded memory (the graphs' lower bound and the remedies
   never list the batch series), and a command's ``internal_error`` names no log where none is written.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from plan_remedies import follow_every_alternative, plan

BIG = "2147483647"


def _plan(argv: list[str], installed: bool) -> tuple[int, dict]:
    """``plan --json`` on the h200 profile, with FlashInfer and Triton assumed installed or the default packages."""
    import json

    from conftest import run_main

    if installed:
        return plan(argv)
    proc = run_main("plan", "--json", "--device-profile", "h200", *argv)
    return proc.returncode, json.loads(proc.stdout)


def _measured(argv: list[str], installed: bool) -> tuple[int, dict, float, int]:
    """:func:`_plan`'s exit code and JSON, its seconds (untraced) and tracemalloc's peak bytes (a second call)."""
    t0 = time.perf_counter()
    rc, out = _plan(argv, installed)
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        assert _plan(argv, installed) == (rc, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return rc, out, seconds, peak


@pytest.mark.parametrize("top", ["100000000", "2147483647"])
@pytest.mark.parametrize("installed", [False, True])
def test_plan_refuses_a_huge_top_in_seconds_and_bounded_memory(monkeypatch, installed, top):
    """The finding: ``--max-reqs 2147483647 --cuda-graph-max-bs 2147483647`` built ~268M batch sizes (10+ GB) in the
    graphs' lower bound (at 1e8: 4.2 s and 1.3 GB); now refused in seconds with a peak under 200 MB — the pools'
    refusal with the default packages, FlashInfer's workspace with it installed —, and every alternative of the
    remedy then plans ok."""
    argv = ["--max-reqs", top, "--cuda-graph-max-bs", top]
    rc, out, seconds, peak = _measured(argv, installed)
    assert seconds < 5 and peak < 200 * 2**20, (seconds, peak)
    err = out["error"]
    assert rc == 3 and err["code"] == ("workspace_too_small" if installed else "pool_exceeds_memory"), err
    assert "--cuda-graph-max-bs 8192" in err["remedy"], err["remedy"]
    if installed:
        assert len(follow_every_alternative(argv, err["remedy"], monkeypatch)) == 1
        return
    assert err["state"] == "init-memory-pool" and "--disable-cuda-graph" in err["remedy"], err
    assert err["remedy"].split(", or ") == [
        "lower --max-reqs (at most 11865653 rows at this context length) and set --cuda-graph-max-bs 8192",
        "lower --max-reqs (at most 29301301 rows at this context length) and set --disable-cuda-graph"], err["remedy"]
    for fixed in (["--max-reqs", "11865653", "--cuda-graph-max-bs", "8192"],
                  ["--max-reqs", "29301301", "--disable-cuda-graph"]):
        rc, out = _plan(fixed, False)
        assert rc == 0 and out["ok"], out


def test_the_series_is_never_listed_and_agrees_with_the_list():
    """:class:`BatchSeries`: length, indexing, bisection and sum in O(1), equal to the listed series."""
    import bisect

    from pipeline.memory.pools import remedy_tops
    from states.build_mode import BatchSeries, series_sum

    for top in (1, 3, 8, 15, 16, 17, 24, 1000):
        listed = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 8))
        s = BatchSeries(top)
        assert list(s) == listed and len(s) == len(listed) and series_sum(s) == sum(listed)
        assert [s[i] for i in range(-len(s), len(s))] == listed * 2 and s[:3] == listed[:3]
        assert remedy_tops(s) == listed[:-1]
    huge = BatchSeries(2**31 - 1)
    assert len(huge) == 268435458 and huge[-1] == 2147483640 and huge[4] == 16
    assert series_sum(huge) == 15 + 268435454 * (16 + 2147483640) // 2
    assert bisect.bisect_left(huge, 8193) == 1027 and remedy_tops(huge)[-1] == 8192


def test_an_internal_error_of_plan_names_no_log(monkeypatch):
    """plan writes no log: its internal_error remedy says so (it said "the log holds the full event"), and a
    MemoryError says the process ran out of memory."""
    import pipeline.cli.plan as plan_cli

    def boom(ns):
        raise MemoryError()

    monkeypatch.setattr(plan_cli, "_decide", boom)
    rc, out = plan([])
    err = out["error"]
    assert rc == 1 and err["code"] == "internal_error" and err["message"] == "MemoryError: ", err
    assert err["remedy"].startswith("the process ran out of host memory") and "log" not in err["remedy"]

    def bug(ns):
        raise RuntimeError("x")

    monkeypatch.setattr(plan_cli, "_decide", bug)
    rc, out = plan([])
    assert rc == 1 and out["error"]["remedy"] == ("This is a bug or an environment failure (no log holds it); "
                                                 "report it with the command line")


@pytest.mark.parametrize("logged", [True, False])
def test_error_info_from_points_at_the_log_only_when_logged(logged):
    """run's failures (written to its log) keep "the log holds the full event"."""
    from pipeline.core.errors import error_info_from

    info = error_info_from(ValueError("v"), "resolve", logged=logged)
    assert info.code == "internal_error" and ("the log holds the full event" in info.remedy) is logged


# -- 2. a {run_id} --log-file is checked for path_conflict with the run id it gets -------------------------------
def _run_json(*argv: str) -> tuple[int, dict]:
    import json

    from conftest import run_main

    proc = run_main("run", "--device", "cpu", "--json", *argv)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_run_id_log_file_over_the_model_config_is_a_path_conflict(tmp_path, monkeypatch):
    """The finding: ``ATTN_SETUP_RUN_ID=myrun … --model conf/myrun.json --log-file 'conf/{run_id}.json'`` was rc 0
    with 37 JSON lines appended to the config; now exit 2 ``path_conflict`` naming both flags, the config as it was."""
    from conftest import ROOT

    conf = tmp_path / "conf"
    conf.mkdir()
    model = conf / "myrun.json"
    model.write_bytes((ROOT / "examples/configs/llama-3.1-8b.json").read_bytes())
    before = model.read_bytes()
    monkeypatch.setenv("ATTN_SETUP_RUN_ID", "myrun")
    rc, out = _run_json("--model", str(model), "--log-file", str(conf / "{run_id}.json"))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict" and err["state"] == "args", err
    assert [f["name"] for f in err["flags"]] == ["--log-file", "--model"] and err["flags"][0]["value"] == str(model)
    assert err["remedy"] == "pass a different path to --log-file"
    assert model.read_bytes() == before and sorted(p.name for p in conf.iterdir()) == ["myrun.json"]


def test_a_run_id_log_file_over_the_metrics_file_is_a_path_conflict(tmp_path, monkeypatch):
    """``ATTN_SETUP_RUN_ID=m2 … --log-file 'conf/{run_id}.jsonl' --metrics-file conf/m2.jsonl``: the log was replaced
    by OpenMetrics text; now refused before anything is written."""
    monkeypatch.setenv("ATTN_SETUP_RUN_ID", "m2")
    rc, out = _run_json("--log-file", str(tmp_path / "{run_id}.jsonl"), "--metrics-file", str(tmp_path / "m2.jsonl"))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict", err
    assert [f["name"] for f in err["flags"]] == ["--log-file", "--metrics-file"]
    assert err["remedy"] == "pass a different path to --metrics-file" and list(tmp_path.iterdir()) == []


def test_a_run_id_known_only_when_the_run_starts_is_checked_before_the_log_opens(tmp_path, monkeypatch):
    """A run id not in the environment (a fresh one, a rank group's) is filled in as the run starts; the conflict
    check runs again then, before the log opens: nothing written, exit 2 ``path_conflict``."""
    import pipeline.core.eventlog as eventlog

    monkeypatch.delenv("ATTN_SETUP_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(eventlog, "new_run_id", lambda: "fresh")
    metrics = tmp_path / "fresh.rank0.jsonl"
    rc, out = _run_json("--log-file", str(tmp_path / "{run_id}.rank{rank}.jsonl"), "--metrics-file", str(metrics))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict", err
    assert err["flags"] == [{"name": "--log-file", "value": str(metrics)}, {"name": "--metrics-file",
                                                                           "value": str(metrics)}]
    assert list(tmp_path.iterdir()) == []


# -- 3. a --mem-fraction pool must hold run's verification batches ----------------------------------------------
def test_a_mem_fraction_below_the_verification_batches_is_refused_and_its_remedy_runs_ok(tmp_path):
    """The finding: ``--mem-fraction 1e-300`` was refused with "cover 49152 bytes" (2 slots), and following it
    (2.1e-6, 53080 bytes) loaded the model and failed verification with ``kv_pool_exhausted``. Now the refusal
    counts the 72 slots the verification batches need, as ``--mem-bytes``'s does, names a fraction, and that runs ok;
    the finding's 2.1e-6 is refused before the model loads."""
    import re

    for frac in ("1e-300", "2.1e-6"):
        rc, out = _run_json("--mem-fraction", frac, "--log-file", str(tmp_path / f"{frac}.jsonl"))
        err = out["error"]
        assert rc == 3 and err["code"] == "pool_budget_too_small" and err["state"] == "args", err
        assert "72 token slots (the verification batches with --decode-steps 3)" in err["message"]
        assert "(622592 bytes in all)" in err["message"] and err["allowed"] == [">= 622592 bytes"]
    m = re.fullmatch(r"raise --mem-fraction to (\S+) or more \(it then covers 622592 bytes\), or lower --max-reqs "
                     r"or --max-context-len", err["remedy"])
    assert m, err["remedy"]
    rc, out = _run_json("--mem-fraction", m.group(1), "--log-file", str(tmp_path / "ok.jsonl"))
    assert rc == 0 and out["ok"] and out["error"] is None, out["error"]


def test_fraction_covering_is_the_smallest_three_digit_fraction():
    from pipeline.memory.pools import budget_from_fraction, fraction_covering

    for need, total, allocated in [(622592, 25_280_000_000, 0), (1, 10, 0), (10, 10, 0), (5, 100, 50),
                                   (123456789, 141_000_000_000, 17_000_000_000)]:
        f = fraction_covering(need, total, allocated)
        assert budget_from_fraction(f, total, allocated) >= need
        m, e = f"{f:.2e}".split("e")
        lower = float(f"{round(float(m) * 100) - 1}e{int(e) - 2}")
        assert lower <= 0 or int(lower * total) - allocated < need, (need, total, f)
    assert fraction_covering(11, 10) is None and fraction_covering(5, 0) is None and fraction_covering(10, 10) == 1.0


# -- 4. rope_theta in a documented range ------------------------------------------------------------------------
def _llama_with(**keys) -> dict:
    import json

    from conftest import ROOT

    return {**json.loads((ROOT / "examples/configs/llama-3.1-8b.json").read_text()), **keys}


@pytest.mark.parametrize("theta", [1e-300, 1e-40, 1e-20, 0.5, 1, 1.0000001e30, 1e300])
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_rope_theta_outside_its_range_is_refused_naming_the_key(theta, where):
    """The finding: 1e-300, 1e-40 and 1e-20 were accepted, then verification failed blaming the backend. Now a
    ModelConfigError at the key's JSON path, with the value, the range and the remedy."""
    from pipeline.core.errors import ModelConfigError
    from pipeline.core.model_spec import load_model_spec

    cfg = _llama_with(rope_theta=theta) if where == "top" else {
        **{k: v for k, v in _llama_with().items() if k not in ("rope_theta", "rope_scaling")},
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    with pytest.raises(ModelConfigError) as e:
        load_model_spec(cfg)
    info = e.value.info
    assert info.code == "model_config_invalid" and info.allowed == ["a number in (1, 1e+30]"]
    assert info.json_path == ("$.rope_theta" if where == "top" else "$.rope_parameters.rope_theta")
    assert [(f.name, f.value) for f in info.flags] == [("rope_theta", float(theta))]
    assert "must be in (1, 1e+30] (RoPE's base" in info.message and "config.json" in info.remedy


@pytest.mark.parametrize("theta", [1.0001, 100, 10000, 500000.0, 3580165449.0, 1e30])
def test_published_rope_thetas_are_accepted(theta):
    from pipeline.core.model_spec import load_model_spec

    assert load_model_spec(_llama_with(rope_theta=theta)).rope_theta == float(theta)


def test_run_refuses_a_rope_theta_of_1e_20_before_loading(tmp_path):
    """The CLI: exit 3 ``model_config_invalid`` in state args (it was ``verification_failed``, exit 1)."""
    import json

    model = tmp_path / "m.json"
    model.write_text(json.dumps(_llama_with(rope_theta=1e-20)))
    rc, out = _run_json("--model", str(model), "--log-file", str(tmp_path / "l.jsonl"))
    assert rc == 3 and out["error"]["code"] == "model_config_invalid" and out["error"]["state"] == "args", out
    assert out["error"]["json_path"] == "$.rope_theta"


# -- 5. a secret equal to ordinary text does not break replay ----------------------------------------------------
def _replay_json(*logs: str) -> tuple[int, dict]:
    import json

    from conftest import run_main

    proc = run_main("replay", "--json", *logs)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def secret_traces(tmp_path_factory):
    """One good CPU run per secret that matches ordinary log text (in-process, like the tester's)."""
    from conftest import run_main

    d, out = tmp_path_factory.mktemp("secret"), {}
    mp = pytest.MonkeyPatch()
    try:
        for secret in ("torch_native", "cpu", "a"):
            mp.setenv("ATTN_SETUP_SECRET_TOK", secret)
            log = d / f"{secret}.jsonl"
            assert run_main("run", "--device", "cpu", "--json", "--log-file", str(log)).returncode == 0
            out[secret] = str(log)
    finally:
        mp.undo()
    return out


def test_a_redacted_decision_is_compared_around_the_marker(secret_traces):
    """The finding: ``ATTN_SETUP_SECRET_TOK=torch_native`` made replay report ``DIVERGED … recorded '<redacted>'``
    (exit 1) on a good run; now the fields holding the marker are compared around it and listed."""
    rc, out = _replay_json(secret_traces["torch_native"])
    assert rc == 0 and out["same"] and out["divergence"] is None, out
    run = out["runs"][0]
    assert run["redacted"] == ["resolve.prefill", "resolve.decode", "build-mode.instances", "annotate.names"]
    assert len(run["checked"]) == 19 and run["stopped"] == ""


@pytest.mark.parametrize("secret,fields", [
    ("cpu", ["device"]),
    ("a", ["args.kv_cache_dtype", "args.dtype", "model.model_type", "model.architectures.0", "model.dtype"])])
def test_a_redacted_request_is_request_redacted_not_trace_unreadable(secret_traces, secret, fields):
    """``=cpu`` / ``=a`` redact the recorded request's device or dtypes and names: that trace was
    ``trace_unreadable``; it reads fine and holds no usable request: exit 2 ``request_redacted`` naming the fields."""
    rc, out = _replay_json(secret_traces[secret])
    err = out["error"]
    assert rc == 2 and err["code"] == "request_redacted", err
    assert {"name": "fields", "value": fields} in err["flags"] and "redacted because a secret" in err["message"]
    assert err["remedy"].startswith("use secrets that do not occur in ordinary values")


def test_matches_around_redaction():
    from pipeline.observe.replay import matches_around_redaction as m

    assert m("<redacted>", "torch_native") and m("torch_n<redacted>tive", "torch_native")
    assert m({"a": ["x<redacted>", 1]}, {"a": ["xy", 1]})
    assert not m("torch_n<redacted>tive", "triton") and not m("<redacted>", "") and not m("<redacted>", 3)
    assert not m({"a": "<redacted>"}, {"a": "x", "b": 1}) and not m(["<redacted>"], ["x", "y"])


# -- 6. inspect orders one launch's records by file position, not wall clock --------------------------------------
def _clock_stepped_back(tmp_path, shift_ns: int = -3600 * 10**9, first: int = 10):
    """``cli_run_ok.jsonl`` with the ``ts_ns`` of its records ``first``+ moved by ``shift_ns`` (a clock step)."""
    import json

    from conftest import ROOT

    lines = (ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl").read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        d = json.loads(line)
        d["ts_ns"] += shift_ns if i >= first else 0
        out.append(json.dumps(d))
    path = tmp_path / "clockback.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def test_inspect_survives_a_wall_clock_step_back(tmp_path):
    """The finding: records 10+ an hour back made ``attention`` appear twice, one copy ``incomplete``; the states
    are now those of the unshifted trace, the run ok."""
    import json

    from conftest import ROOT, run_main

    good = ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"
    want = json.loads(run_main("inspect", "--json", str(good)).stdout)["runs"][0]
    proc = run_main("inspect", "--json", str(_clock_stepped_back(tmp_path)))
    run = json.loads(proc.stdout)["runs"][0]
    assert proc.returncode == 0 and run["ok"] and run["status"] == "ok", run["status"]
    assert [(s["state"], s["outcome"]) for s in run["runner_states"]] == [
        ("init-distributed", "ok"), ("load-model", "ok"), ("init-memory-pool", "ok"), ("attention", "ok"),
        ("capture-cuda-graphs", "skipped"), ("ready", "ok")]
    assert [s["state"] for s in run["states"]] == [s["state"] for s in want["states"]]


def test_inspect_diff_keeps_runner_ready_after_a_clock_step(tmp_path):
    """``inspect --diff`` of the trace against its clock-stepped copy lost ``runner:ready``; now every state."""
    from conftest import ROOT, run_main

    good = ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"
    import json

    proc = run_main("inspect", "--diff", str(good), str(_clock_stepped_back(tmp_path)), "--json")
    assert proc.returncode == 0, proc.stderr
    states = json.loads(proc.stdout)["diff"]["ranks"][0]["states"]
    assert {"machine": "runner", "state": "ready", "a_ms": 0.0, "b_ms": 0.0, "delta_ms": 0.0} in states
    assert all(s["delta_ms"] == 0.0 for s in states) and len(states) == 12, states


def test_pieces_of_one_launch_in_two_files_still_merge_in_time_order(tmp_path):
    """A log split in two files, passed tail first: the pieces join by their first records' time, lines once."""
    import json

    from conftest import ROOT, run_main

    lines = (ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl").read_text().splitlines(keepends=True)
    head, tail = tmp_path / "head.jsonl", tmp_path / "tail.jsonl"
    head.write_text("".join(lines[:20]))
    tail.write_text("".join(lines[12:]))  # overlapping copies
    run = json.loads(run_main("inspect", "--json", str(tail), str(head)).stdout)["runs"][0]
    want = json.loads(run_main("inspect", "--json", str(ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"))
                      .stdout)["runs"][0]
    assert run["ok"] and run["runner_states"] == want["runner_states"] and run["states"] == want["states"]


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
    rc, out = _run_json("--log-file", str(tmp_path / "l.jsonl"))
    err = out["error"]
    assert rc == 2 and err["flags"] == [{"name": "ATTN_SETUP_DIST_TIMEOUT", "value": raw}], err
    assert err["message"] == f"ATTN_SETUP_DIST_TIMEOUT='{raw}' must be a number of seconds in (0, 86400]"
    assert err["remedy"] == ("export ATTN_SETUP_DIST_TIMEOUT=60, or unset it (60 s), or pass --dist-timeout 60")
    if raw == "inf":
        monkeypatch.setenv("ATTN_SETUP_DIST_TIMEOUT", "60")
        assert _run_json("--log-file", str(tmp_path / "l.jsonl"))[0] == 0


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
