"""Raw errors become typed refusals: a NUL or a lone surrogate in any path flag of any command (in-process
``main(argv)``, the only way to pass them), a pool built with a size that is no size."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_main
from pipeline.core.errors import ConfigError

PATHS = [("run", "--log-file"), ("run", "--metrics-file"), ("run", "--model"), ("plan", "--model"),
         ("plan", "--draft-model"), ("warmup", "--model"), ("inspect", "LOG"), ("inspect", "--perfetto"),
         ("replay", "LOG"), ("graph", "--output"), ("graph", "LOG")]


@pytest.mark.parametrize("bad, code", [("a\x00b", "path_has_nul"), ("a\ud800b", "path_not_utf8"),
                                       ("a\udcffb", "path_not_utf8")], ids=["nul", "lone-surrogate", "undecodable"])
@pytest.mark.parametrize("command, flag", PATHS, ids=lambda x: x)
def test_a_bad_path_character_is_a_usage_error(tmp_path, command, flag, bad, code):
    log = tmp_path / "l.jsonl"
    log.write_text("")
    path = str(tmp_path / bad)
    argv = {"LOG": [command, path]}.get(flag, [command] + ([str(log)] if command in ("inspect", "replay") else [])
                                         + [flag, path])
    if command == "run":
        argv += ["--device", "cpu"]
    p = run_main(*argv, "--json")
    err = json.loads(p.stdout)["error"]
    assert p.returncode == 2 and err["code"] == code, (argv, p.stdout, p.stderr)
    assert err["flags"][0]["name"] == flag and "\\" in err["flags"][0]["value"]


@pytest.mark.parametrize("make", [
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).ReqToTokenPool(-1, 8, "cpu"),
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).ReqToTokenPool(2, 0, "cpu"),
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).ReqToTokenPool(2.5, 8, "cpu"),
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).KVPool(-4, 1, [(1, 8, 8)], torch.float32, "cpu"),
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).KVPool(4, 0, [(1, 8, 8)], torch.float32, "cpu"),
    lambda: __import__("pipeline.backends.memory", fromlist=["x"]).KVPool(4, 1, [(1, -8, 8)], torch.float32, "cpu"),
], ids=["reqs<0", "context=0", "reqs-float", "slots<0", "page=0", "dim<0"])
def test_a_pool_size_that_is_no_size_is_refused_typed(make):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.info.code == "invalid_value" and e.value.info.flags
