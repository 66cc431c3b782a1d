"""Environment variables that look like ours: a warning naming the known one, nothing refused."""

from __future__ import annotations

import functools
import json
import string

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_main
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.settings import KNOWN_ENV_VARS, LOOKALIKE_DISTANCE, _edit_distance, env_lookalikes

ALPHA = string.ascii_uppercase + "_0123456789"


def _osa(a: str, b: str) -> int:
    """Reference: optimal string alignment distance by plain memoised recursion (no shared code)."""
    @functools.lru_cache(maxsize=None)
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        best = min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
        if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
            best = min(best, d(i - 2, j - 2) + 1)
        return best
    return d(len(a), len(b))


@settings(max_examples=300, deadline=None)
@given(st.text(ALPHA, max_size=12), st.text(ALPHA, max_size=12))
def test_distance_matches_the_reference(a, b):
    want = _osa(a, b)
    assert _edit_distance(a, b, 3) == min(want, 4)


def _edits(name: str, rnd: st.DataObject, n: int) -> str:
    for _ in range(n):
        i = rnd.draw(st.integers(0, len(name) - 1))
        op = rnd.draw(st.sampled_from(["ins", "del", "sub", "swap"]))
        c = rnd.draw(st.sampled_from(ALPHA))
        name = {"ins": name[:i] + c + name[i:], "del": name[:i] + name[i + 1:], "sub": name[:i] + c + name[i + 1:],
                "swap": name[:i] + name[i + 1:i + 2] + name[i:i + 1] + name[i + 2:]}[op]
    return name


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KNOWN_ENV_VARS), st.integers(1, LOOKALIKE_DISTANCE), st.data())
def test_a_typo_of_a_known_name_is_flagged_with_it(known, n, data):
    """Random edits of a known name: flagged exactly when the reference distance to the nearest known name is
    at most LOOKALIKE_DISTANCE, naming a known name at that distance."""
    typo = _edits(known, data, n)
    got = env_lookalikes({typo: "1"})
    if typo in KNOWN_ENV_VARS or typo.startswith("ATTN_SETUP_SECRET_"):
        assert got == []
    else:
        nearest = min(_osa(typo, k) for k in KNOWN_ENV_VARS)  # overlapping edits can cost more than n
        if nearest > LOOKALIKE_DISTANCE:
            assert got == []
        else:
            assert len(got) == 1 and got[0][0] == typo and _osa(typo, got[0][1]) == nearest


@pytest.mark.parametrize("name,known", [
    ("sglang_flashinfer_workspace_size", "SGLANG_FLASHINFER_WORKSPACE_SIZE"),  # other case: Linux keeps them apart
    ("SGLNG_ZBAL_LOCAL_MEM_SIZE", "SGLANG_ZBAL_LOCAL_MEM_SIZE"),
    ("ATTN_SETUP_RUNID", "ATTN_SETUP_RUN_ID"),
    ("ATTN_SETUP_SLOW_PHASE", "ATTN_SETUP_SLOW_PHASE_S"),
    ("SGLANG_TORCH_PROFILER_DIR", None),  # sglang's own variable, far from ours
    ("ATTN_SETUP_SECRET_TOKEN", None), ("PATH", None), ("SGLANG_ZBAL_LOCAL_MEM_SIZE", None),
])
def test_examples(name, known):
    assert env_lookalikes({name: "1"}) == ([(name, known)] if known else [])


def test_run_warns_and_still_runs(tmp_path, monkeypatch):
    """The typo'd variable is logged as env_var_lookalike and named on stderr; the run itself succeeds."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZ", "1000")
    log = tmp_path / "a.jsonl"
    p = run_main("run", "--device", "cpu", "--json", "--num-layers", "1", "--decode-steps", "0", "--log-file", str(log))
    assert p.returncode == 0 and json.loads(p.stdout)["ok"]
    recs = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    (w,) = [r for r in recs if isinstance(r, ev.EnvVarLookalike)]
    assert (w.name, w.known) == ("SGLANG_FLASHINFER_WORKSPACE_SIZ", "SGLANG_FLASHINFER_WORKSPACE_SIZE")
    assert "did you mean SGLANG_FLASHINFER_WORKSPACE_SIZE?" in p.stderr
