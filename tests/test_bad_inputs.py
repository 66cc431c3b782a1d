"""A corpus of bad inputs (tests/data/bad_inputs/cases.json), each through the CLI or the library.

``cases``: each through ``attn-setup run --json`` (or ``command``, e.g. ``plan``) with its ``env``.
Every case must exit with README's code (1 start failed, 2 usage/unreadable file, 3 configuration
refused), print one ErrorInfo with a message and a remedy, and name the JSON path (config files) or
the flag. ``library``: each a library call that must raise the typed error with the same fields.
Run in-process through ``pipeline.cli.main`` for speed.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from conftest import CONFIGS
from pipeline.cli import main

DATA = Path(__file__).resolve().parent / "data" / "bad_inputs"
CORPUS = json.loads((DATA / "cases.json").read_text())
CASES = CORPUS["cases"]
LIBRARY = CORPUS["library"]


def test_corpus_is_large_enough():
    names = [c["name"] for c in CASES + LIBRARY]
    assert len(CASES) >= 90 and len(LIBRARY) >= 20 and len(set(names)) == len(names)
    files = {p.stem for p in DATA.glob("*.json")} - {"cases"}
    used = {Path(a).stem for c in CASES for a in c["argv"] if a.startswith("{data}/")}
    assert files <= used, files - used


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_error(err: dict, case: dict) -> None:
    assert err["message"] and err["remedy"], err
    if case.get("code"):
        assert err["code"] == case["code"], err
    if "json_path" in case:
        assert err["json_path"] == case["json_path"], err
    if case.get("flag"):
        assert case["flag"] in [f["name"] for f in err["flags"]], err["flags"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    for var in case.get("unset", []):
        monkeypatch.delenv(var, raising=False)
    port = str(_free_port())
    for var, value in case.get("env", {}).items():
        monkeypatch.setenv(var, value.replace("{free_port}", port))
    argv = [a.format(data=DATA, configs=CONFIGS) if a.startswith("{") else a for a in case["argv"]]
    command = case.get("command", "run")
    head = (["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl")] if command == "run"
            else [command, "--json"])
    code = main([*head, *argv])
    out = json.loads(capsys.readouterr().out)
    err = out["error"]
    assert code == case["exit"], err
    assert out["ok"] is False
    _check_error(err, case)
    assert not any(p.stat().st_size and b'"backend_built"' in p.read_bytes() for p in tmp_path.glob("*.jsonl"))


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
    from pipeline.contracts import PoolFacts
    from pipeline.runner import Runner, RunnerConfig

    kw = _value(case["kwargs"])
    small = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=256)
    structlog.configure(processors=[structlog.testing.LogCapture()])  # keep the test output quiet
    call = case["call"]
    if call == "SetupRequest":
        return SetupRequest(**{"model": llama, **kw})
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
    assert call == "closed_backend"
    from pipeline.memory import PageAllocator, make_forward_batch
    from pipeline.contracts import ForwardMode

    args = AttentionArgs(enable_two_batch_overlap=kw.get("enable_two_batch_overlap", False))
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
    from pipeline.errors import AttnSetupError

    with pytest.raises(AttnSetupError) as e:
        _call(case, llama, tmp_path)
    import msgspec

    assert e.value.exit_code == case["exit"], e.value
    _check_error(msgspec.to_builtins(e.value.info), case)
