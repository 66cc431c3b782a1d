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


# -- an output written by name is whole or absent: a full disk (here: a file-size limit) leaves nothing behind ---
FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as ENOSPC on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["graph", "-o", "{out}.dot"], ["graph", "-o", "{out}.mmd"],
                                  ["graph", "{log}", "-o", "{out}.dot"], ["inspect", "{log}", "--perfetto", "{out}.json"]])
def test_an_output_that_cannot_be_written_leaves_no_file(tmp_path, argv):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    log = ROOT / "tests" / "data" / "bad_inputs" / "traces" / "cli_run_ok.jsonl"
    args = [a.format(out=tmp_path / "out", log=log) for a in argv]
    p = subprocess.run([sys.executable, "-c", FULL_DISK, *args, "--json"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and json.loads(p.stdout)["ok"] is False, (p.returncode, p.stdout, p.stderr)
    assert os.listdir(tmp_path) == []
