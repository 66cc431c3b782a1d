"""A corpus of bad inputs (tests/data/bad_inputs/cases.json), each with its right outcome.

``cases`` with ``command`` ``run`` (default) or ``plan`` go through ``attn-setup <command> --json``
with their ``env`` and must exit with README's code (1 the start failed, 2 usage / unreadable or
irregular file, 3 configuration refused, 130 interrupted), print one ErrorInfo with a message and a
remedy, and name the JSON path (config files) or the flag; cases that must succeed (exit 0) say so,
and where a case writes a log, what ``inspect`` must then say about it. Every error, as ``--json`` prints it and
as the human block shows it, speaks the command line's words (:func:`cli_words.check_cli_error`). ``read`` cases go through all
four log readers (inspect text and ``--json``, ``--perfetto``, replay, graph) with each one's
expected exit code and error code. ``library``: each a library call that must raise the typed error
with the same fields. Run in-process through ``pipeline.cli.main`` for speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import pytest

from cli_words import check_cli_error, rendered
from conftest import CONFIGS
from pipeline.cli import main

DATA = Path(__file__).resolve().parent / "data" / "bad_inputs"
GOLDEN = DATA.parent / "golden"
CORPUS = json.loads((DATA / "cases.json").read_text())
CASES = CORPUS["cases"]
LIBRARY = CORPUS["library"]
RUN_CASES = [c for c in CASES if c.get("command", "run") != "read"]
READ_CASES = [c for c in CASES if c.get("command") == "read"]


def test_corpus_is_large_enough():
    names = [c["name"] for c in CASES + LIBRARY]
    assert len(CASES) >= 150 and len(LIBRARY) >= 20 and len(set(names)) == len(names)
    assert {c.get("command", "run") for c in CASES} == {"run", "plan", "read"}
    files = {p.stem for p in DATA.glob("*.json")} - {"cases"}
    used = {Path(a.split("/", 1)[1]).stem for c in CASES for a in c.get("argv", []) if a.startswith("{data}/")}
    assert files <= used, files - used
    logs = {p.name for p in (DATA / "traces").glob("*.jsonl")}
    used_logs = {Path(c["log"]).name for c in READ_CASES if c["log"].startswith("{data}/traces/")}
    assert logs <= used_logs, logs - used_logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(s: str, tmp_path: Path) -> str:
    return s.format(data=DATA, configs=CONFIGS, tmp=tmp_path, golden=GOLDEN) if "{" in s else s


def _check_error(err: dict, case: dict) -> None:
    assert err["message"] and err["remedy"], err
    if case.get("code"):
        assert err["code"] == case["code"], err
    if "json_path" in case:
        assert err["json_path"] == case["json_path"], err
    if case.get("flag"):
        assert case["flag"] in [f["name"] for f in err["flags"]], err["flags"]
    if case.get("state"):  # the state the error names, in ErrorInfo.state and in its message
        assert err["state"] == case["state"] and "in state failed" not in err["message"], err
    if case.get("remedy_has"):
        assert case["remedy_has"] in err["remedy"], err["remedy"]
    if case.get("remedy_is"):  # the whole remedy: each way said once
        assert err["remedy"] == case["remedy_is"], err["remedy"]


def _setup(case: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in case.get("unset", []):
        monkeypatch.delenv(var, raising=False)
    port = str(_free_port())
    for k, v in case.get("env", {}).items():
        monkeypatch.setenv(k, v.replace("{free_port}", port))
    if case.get("setup") == "fifo":
        os.mkfifo(tmp_path / "fifo")
    point = case.get("interrupt")
    if point:  # a real SIGINT, delivered to this process at that point (as Ctrl-C would)
        import pipeline.runtime.verify
        import pipeline.runtime.model
        import pipeline.setup.context

        def interrupting(target: object, name: str, when=lambda *a: True) -> None:
            real = getattr(target, name)

            def wrapper(*a, **k):
                if when(*a):
                    signal.raise_signal(signal.SIGINT)
                return real(*a, **k)

            monkeypatch.setattr(target, name, wrapper)

        target = {"load-model": (pipeline.runtime.model, "AttentionStack"),
                  # the setup machine's first record in npu-lazy-mem (the run's, not the preflight's decision)
                  "npu-lazy-mem": (pipeline.setup.context.SetupContext, "emit", lambda ctx, *a: ctx.state == point),
                  "verification": (pipeline.runtime.verify, "verify_built")}[point]
        interrupting(*target)


@pytest.mark.parametrize("case", RUN_CASES, ids=[c["name"] for c in RUN_CASES])
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    _setup(case, tmp_path, monkeypatch)
    argv = [_fmt(a, tmp_path) for a in case["argv"]]
    command = case.get("command", "run")
    head = (["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl")] if command == "run"
            else [command, "--json"])
    code = main([*head, *argv])
    out = json.loads(capsys.readouterr().out)
    err = out.get("error")  # a plan that succeeds prints no error key
    assert code == case["exit"], err
    if case.get("warning"):  # a warning the output must carry: its code and what it is about
        assert any(w["code"] == case["warning"] for w in out["warnings"]), out["warnings"]
    if case["exit"] == 0:
        assert out["ok"] is True and err is None
    else:
        assert out["ok"] is False
        _check_error(err, case)
        check_cli_error(err, command, rendered(err, capsys))  # the command line's words, JSON and human
    logs = [p for p in tmp_path.glob("*.jsonl") if p.stat().st_size]
    if case["exit"] in (2, 3):
        assert not any(b'"backend_built"' in p.read_bytes() for p in logs)
    want = case.get("log")
    if want is not None:  # the log it wrote, read back
        assert len(logs) == 1
        got = main(["inspect", str(logs[0]), "--json"])
        report = json.loads(capsys.readouterr().out)
        assert got == want["inspect"] and report["skipped_lines"] == 0, report
        (run,) = report["runs"]
        if run["failure"] is not None:  # inspect words it as run --json did
            check_cli_error(run["failure"], command)
            if run["failure"]["code"] == err["code"]:
                assert run["failure"]["remedy"] == err["remedy"] and run["failure"]["flags"] == err["flags"]
        main(["inspect", str(logs[0])])
        text = capsys.readouterr().out
        assert not re.search(r"\bNone\b", text), text
        assert run["status"] == want["status"]
        last = json.loads(logs[0].read_bytes().splitlines()[-1])
        assert last["event"] == "command_finished" and last["exit_code"] == case["exit"]
        if want.get("failure"):
            assert run["failure"]["code"] == want["failure"]


def _expect(spec: object) -> tuple[int, str | None]:
    return (spec, None) if isinstance(spec, int) else (spec[0], spec[1])


@pytest.mark.parametrize("case", READ_CASES, ids=[c["name"] for c in READ_CASES])
def test_bad_log(case, tmp_path, capsys, monkeypatch):
    """Every reader on the log: its exit code, and for an error its code (and the flag, when named)."""
    _setup(case, tmp_path, monkeypatch)
    log = _fmt(case["log"], tmp_path)
    calls = {"inspect": ["inspect", log, "--json"], "inspect_text": ["inspect", log],
             "perfetto": ["inspect", log, "--json", "--perfetto", str(tmp_path / "p.json")],
             "replay": ["replay", log, "--json"], "graph": ["graph", log, "-o", str(tmp_path / "g.mmd")]}
    assert set(case["expect"]) == set(calls), "every case names the outcome of every reader"
    for name, argv in calls.items():
        want, code = _expect(case["expect"][name])
        got = main(argv)
        cap = capsys.readouterr()
        assert got == want, (name, cap.out[-2000:], cap.err[-2000:])
        assert "internal_error" not in cap.out + cap.err and "Traceback" not in cap.err
        if "--json" in argv:
            obj = json.loads(cap.out)
            if obj.get("error"):
                check_cli_error(obj["error"], argv[0])
            if code is not None:
                assert obj["error"]["code"] == code, (name, obj["error"])
                if case.get("flag"):
                    assert case["flag"] in [f["name"] for f in obj["error"]["flags"]]
            elif name == "inspect" and want in (0, 1):
                assert obj.get("skipped_lines", 0) == case.get("skipped_lines", 0)
                if "statuses" in case:
                    assert [r["status"] for r in obj["runs"]] == case["statuses"]
        if name == "perfetto" and want in (0, 1):
            assert isinstance(json.loads((tmp_path / "p.json").read_bytes())["traceEvents"], list)


def _value(v):
    """``"10**N"`` in the corpus stands for that integer (JSON has no literal for it)."""
    if isinstance(v, str) and re.fullmatch(r"10\*\*[0-9]+", v):
        return 10 ** int(v[4:])
    if isinstance(v, str):
        return v.format(data=DATA) if v.startswith("{") else v
    if isinstance(v, list):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v


def _call(case, llama, tmp_path):
    import structlog

    from pipeline import AttentionArgs, SetupRequest, build_attention_backends, load_model_spec
    from pipeline.core.contracts import PoolFacts
    from pipeline.runtime.runner import Runner, RunnerConfig

    kw = _value(case["kwargs"])
    small = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=256)
    structlog.configure(processors=[structlog.testing.LogCapture()])  # keep the test output quiet
    call = case["call"]
    if call == "SetupRequest":  # "args" given as a dict: the AttentionArgs it spells
        args = {"args": AttentionArgs(**kw.pop("args"))} if isinstance(kw.get("args"), dict) else {}
        return SetupRequest(**{"model": llama, **kw, **args})
    if call == "AttentionArgs":
        return AttentionArgs(**kw)
    if call == "PoolFacts":
        return PoolFacts(**kw)
    if call == "load_model_spec":
        cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
        return load_model_spec({**cfg, **kw})
    if call == "build_attention_backends":
        pool = PoolFacts(**kw.pop("pool")) if "pool" in kw else small
        return build_attention_backends(SetupRequest(model=llama, device="cpu", pool=pool), **kw)
    if call == "Runner":
        return Runner(RunnerConfig(request=SetupRequest(model=llama, device="cpu", pool=small)), **kw)
    if call == "RunnerConfig":
        return RunnerConfig(request=SetupRequest(model=llama, device="cpu", pool=small), **kw)
    assert call == "closed_backend"
    from pipeline.backends.memory import PageAllocator, make_forward_batch
    from pipeline.core.contracts import ForwardMode

    tbo = kw.get("enable_two_batch_overlap", False)  # sglang's TBO needs an EP all-to-all (or attention DP)
    args = AttentionArgs(enable_two_batch_overlap=tbo, moe_a2a_backend="deepep" if tbo else "none")
    out = build_attention_backends(SetupRequest(args=args, model=llama, device="cpu", pool=small))
    held = list(out.instances.values())[-1]  # an engine's own reference (a TBO child with TBO)
    alloc = PageAllocator(out.pools["req_to_token_pool"], small.num_token_slots, 1)
    fb = make_forward_batch(ForwardMode.DECODE, [0], [1], alloc, out.pools["kv_pool"])
    out.close()
    if kw["method"] == "init_forward_metadata":
        return held.init_forward_metadata(fb)
    layer = next(iter(llama.layer_kinds()))
    return getattr(held, kw["method"])(None, None, None, layer, fb)


@pytest.mark.parametrize("case", LIBRARY, ids=[c["name"] for c in LIBRARY])
def test_bad_library_input(case, llama, tmp_path):
    """The library raises the typed error (code, flag / JSON path, remedy) with the corpus's exit code."""
    from pipeline.core.errors import AttnSetupError

    with pytest.raises(AttnSetupError) as e:
        _call(case, llama, tmp_path)
    import msgspec

    assert e.value.exit_code == case["exit"], e.value
    _check_error(msgspec.to_builtins(e.value.info), case)
