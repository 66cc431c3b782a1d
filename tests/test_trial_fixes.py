"""Findings of new-user trial #1 that are not a corpus entry alone: remedies followed to success, file lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli import main


def _run(capsys, tmp_path, *argv):
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    return code, json.loads(capsys.readouterr().out)


def test_page_size_remedy_is_enough_when_followed(capsys, tmp_path):
    """--page-size 4096 with the default slots: the remedy names every slot verification needs (24576 with the
    default 3 decode steps), and following it runs to ok — it asked for 8192, then 24576, before (item 5)."""
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1")
    assert code == 3 and out["error"]["code"] == "pool_budget_too_small"
    slots = re.search(r"--num-token-slots (\d+)", out["error"]["remedy"]).group(1)
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1",
                     "--num-token-slots", slots)
    assert code == 0 and out["ok"], out["error"]


GOOD = Path(__file__).parent / "data" / "bad_inputs" / "traces" / "cli_run_ok.jsonl"


def _reader(name, tmp_path, *logs):  # argv of a reader command over ``logs``
    out = tmp_path / "g.mmd"
    return {"inspect": ["inspect", "--json", *logs], "replay": ["replay", "--json", *logs],
            "graph": ["graph", "-o", str(out), *logs]}[name]


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
@pytest.mark.parametrize("order", ["missing-last", "missing-first", "missing-alone"])
def test_a_missing_log_among_several_is_refused_naming_it(command, order, tmp_path, capsys):
    """`replay good nope` exited 0 without mentioning nope, `inspect good nope` exited 0: every named log must be
    readable, else exit 2 `trace_unreadable` naming it with the OS reason — as for a directory (item 6)."""
    nope = str(tmp_path / "nope.jsonl")
    logs = {"missing-last": [str(GOOD), nope], "missing-first": [nope, str(GOOD)], "missing-alone": [nope]}[order]
    assert main(_reader(command, tmp_path, *logs)) == 2
    text = capsys.readouterr()
    both = " ".join((text.out + text.err).split())  # the human error wraps at spaces to the console's width
    assert "trace_unreadable" in both and "No such file or directory" in both and nope in both


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
def test_readable_logs_still_read(command, tmp_path, capsys):
    assert main(_reader(command, tmp_path, str(GOOD), str(GOOD))) == 0


def _ns(**kw):
    import argparse

    base = dict(world_size=1, rank=0, decode_steps=3)
    return argparse.Namespace(**{**base, **kw})


def test_notices_before_a_slow_or_memory_hungry_run_and_a_lone_rank():
    """Item 8: `--num-layers 32` (13.6 GB peak measured) and `--decode-steps 100` are announced from the config;
    item 7: `--world-size 2` outside torchrun says that one rank runs alone. Defaults stay quiet."""
    from conftest import CONFIGS
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.runtime.model import AttentionStack
    from pipeline.core.model_spec import load_model_spec
    from pipeline.cli.run import run_notices, weight_bytes

    spec = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    req = SetupRequest(args=AttentionArgs(), model=spec, device="cpu")
    assert run_notices(_ns(), req, 2, False) == []
    (mem,) = run_notices(_ns(), req, 32, False)
    assert "12.5 GiB" in mem and "--num-layers 2" in mem        # 2.5 GiB bf16 + 10.0 GiB float64
    (steps,) = run_notices(_ns(decode_steps=100), req, 2, False)
    assert "--decode-steps 100" in steps
    (lone,) = run_notices(_ns(world_size=2, rank=1), req, 2, False)
    assert "torchrun --nproc-per-node 2" in lone and "rank 1 alone" in lone
    assert run_notices(_ns(world_size=2, rank=1), req, 2, True) == []
    # the estimate is the stack's own size (independent count: the built tensors), MLA included
    for cfg in ("llama-3.1-8b.json", "deepseek-v2-lite.json", "gpt-oss-20b.json"):
        s = load_model_spec(CONFIGS / cfg)
        import torch

        st = AttentionStack(s, dtype=torch.bfloat16, device="cpu", num_layers=1)
        no_sinks = st.param_bytes() - sum(L.sinks.numel() * L.sinks.element_size() for L in st.layers if L.sinks is not None)
        assert weight_bytes(s, 1, "bfloat16") == (no_sinks, no_sinks * 4)


def test_mem_fraction_remedy_names_a_share_that_fits_here(capsys, tmp_path):
    """`--mem-fraction 1.5` suggested "such as 0.8", which a CPU host refuses (item 9): a share too large for this
    host (1.0, inside the flag's domain; 1.5 is outside it, exit 2) is refused with a remedy naming the largest share
    in hundredths whose pools fit and hold the verification batches — checked by sizing (nothing is allocated):
    that share passes, the next hundredth up does not (unless it is the 0.9 cap)."""
    import argparse

    from pipeline.cli import build_parser
    from pipeline.cli.run import check_pool_for_checks, request_from
    from pipeline.core.errors import ConfigError
    from pipeline.platforms import platform_for

    code, out = _run(capsys, tmp_path, "--mem-fraction", "1.0")
    assert code == 3 and out["error"]["flags"][0]["name"] == "--mem-fraction"
    frac = float(re.search(r"--mem-fraction (0\.\d+)", out["error"]["remedy"]).group(1))
    ns = build_parser().parse_args(["run", "--device", "cpu", "--mem-fraction", str(frac)])
    assert isinstance(ns, argparse.Namespace)
    req, platform = request_from(ns, on_gpu=False), platform_for("cpu")
    check_pool_for_checks(ns, req, platform, 0)
    if frac < 0.9:
        from pipeline.memory.pools import remedy_margin
        from pipeline.platforms.cpu import host_available_bytes

        total = platform.device_facts(0).total_memory_bytes  # the remedy keeps a margin; host memory also moves
        ns.mem_fraction = round(frac + remedy_margin(host_available_bytes()) / total + 0.03, 2)
        with pytest.raises(ConfigError):
            check_pool_for_checks(ns, req, platform, 0)
