"""``plan`` refuses what ``run`` refuses from its flags alone — a ``--max-context-len`` shorter than the longest
verification request, a ``--num-token-slots`` below the verification batches' slots — and its pool remedy names no
value ``run`` would refuse for them (before: ``plan --max-context-len 13`` said ok, which ``run`` refused at its
flags; a pool remedy named ``--max-context-len`` at most 13 tokens). The minimums are ``run``'s own: both commands
read :mod:`pipeline.memory.pools`, and the runtime's batch modules report the same numbers."""

from __future__ import annotations

import math
import re

import pytest

from conftest import run_main
from plan_remedies import plan, set_flag

from pipeline.core.errors import ConfigError
from pipeline.memory.pools import CHUNK_LENS, EXTEND_LENS, NEW_LENS, PREFIX_LENS, check_needs


def _run_minimums(max_reqs: int, page: int) -> tuple[int, int]:
    """(slots, context) ``run`` requires for these flags, from the RunnerConfig it builds, checked against the two
    check batches counted here (whole pages per request at 3 decode steps, plus the reserved page 0)."""
    from pipeline.cli.flags import build_parser
    from pipeline.cli.flags import request_from
    from pipeline.cli.run import runner_config

    ns = build_parser().parse_args(["run", "--device", "cpu", "--max-reqs", str(max_reqs), "--page-size", str(page)])
    cfg = runner_config(ns, request_from(ns, on_gpu=False))
    batches = [list(zip(a, b))[:max_reqs] for a, b in ((PREFIX_LENS, NEW_LENS), (EXTEND_LENS, CHUNK_LENS))]
    slots = max(page * (1 + sum(math.ceil((x + y + 3) / page) for x, y in rows)) for rows in batches)
    assert cfg.min_token_slots == slots
    assert cfg.min_context_len == max(x + y + 3 for rows in batches for x, y in rows)
    return cfg.min_token_slots, cfg.min_context_len


@pytest.mark.parametrize("max_reqs,page", [(1, 1), (2, 16), (3, 1), (8, 1), (8, 64), (256, 16)])
def test_plan_and_run_agree_on_the_shortest_context(max_reqs, page):
    slots, ctx = _run_minimums(max_reqs, page)
    assert (slots, ctx) == (check_needs(max_reqs, page).slots, check_needs(max_reqs).context)
    argv = ["--max-reqs", str(max_reqs), "--page-size", str(page)]
    rc, out = plan(set_flag(argv, "--max-context-len", str(ctx - 1)))
    assert rc == 3 and out["error"]["code"] == "invalid_value", out["error"]
    assert out["error"]["allowed"] == [f">= {ctx}"]
    assert f"--max-context-len {ctx} or more" in out["error"]["remedy"]
    rc, out = plan(set_flag(argv, "--max-context-len", str(ctx)))
    assert rc == 0, out.get("error")


@pytest.mark.parametrize("max_reqs,page", [(8, 1), (8, 16), (8, 64), (2, 16)])
def test_plan_refuses_token_slots_run_refuses(max_reqs, page):
    slots, _ = _run_minimums(max_reqs, page)
    floor = max(2 * page, -(-slots // page) * page)
    argv = ["--max-reqs", str(max_reqs), "--page-size", str(page)]
    rc, out = plan(set_flag(argv, "--num-token-slots", str(floor - page)))
    assert rc == 3 and out["error"]["code"] == "pool_budget_too_small", out["error"]
    assert f"--num-token-slots {floor} or more" in out["error"]["remedy"]
    rc, out = plan(set_flag(argv, "--num-token-slots", str(floor)))
    assert rc == 0, out.get("error")
    # run refuses one page less too (its pool sizing, before anything is built)
    from pipeline.memory.pools import size_pools

    with pytest.raises(ConfigError) as e:
        size_pools([], 1, "bfloat16", page_size=page, max_reqs=max_reqs, max_context_len=64,
                   num_token_slots=floor - page, min_slots=slots)
    assert e.value.info.code == "pool_budget_too_small"


def test_the_pool_remedy_names_no_context_run_refuses():
    """req_to_token of 2**31 - 1 rows at 30 tokens (240 GiB) on the h200 profile: the remedy used to offer
    ``--max-context-len`` at most 13 tokens, which run refuses (its verification needs 26). Now every alternative it
    names plans ok."""
    argv = ["--max-reqs", "2147483647", "--max-context-len", "30", "--disable-cuda-graph"]
    rc, out = plan(argv)
    assert rc == 3 and out["error"]["code"] == "pool_exceeds_memory", out["error"]
    remedy = out["error"]["remedy"]
    ways = re.findall(r"lower (--[\w-]+) \(at most (\d+)", remedy)
    assert ways, remedy
    for flag, value in ways:
        if flag == "--max-context-len":
            assert int(value) >= check_needs(2147483647).context, remedy
        rc, fixed = plan(set_flag(argv, flag, value))
        assert rc == 0, (flag, value, fixed.get("error"))


def test_plan_has_no_decode_steps_and_says_whose_default():
    proc = run_main("plan", "--device-profile", "h200", "--max-context-len", "13")
    assert proc.returncode == 3
    text = " ".join(proc.stderr.split())   # the terminal's line breaks out
    assert "the longest verification request of `attn-setup run` reaches with its default --decode-steps 3" in text
