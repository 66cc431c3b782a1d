"""Accepted means runs, CPU side: every combination the records accept is built and verified.

The combinations, the acceptance question and the run are ``benchmarks/matrix_cells.py``'s (the GPU script
``benchmarks/accepted_matrix.py`` runs the same cells on the H200): backend × layer kind (full, window, softcap, sinks, chunked, MLA) × KV dtype
(``auto`` + the fp8 formats some record claims) × page size {1, 16, 64} × mode {normal, TBO, hybrid, PD-mux} ×
{eager, graph}, accepted or refused by :func:`pipeline.setup.build.decide_offline` (resolve + build-mode's checks, what
``plan`` asks), built through :func:`pipeline.build_attention_backends` and checked with
:func:`pipeline.runtime.verify.verify_built` against float64 attention. Two groups run here:

- ``cpu``: every registered backend decided on the ``cpu`` profile and run on this CPU (torch_native is what the
  records accept; PD-mux, hybrids and CUDA graphs are refused here, and counted);
- ``h200-interpreted``: every cell involving triton (alone, or as one half of a hybrid with torch_native) decided
  on the ``h200`` profile and run on CPU tensors, our Triton kernels under ``TRITON_INTERPRET=1`` (with the GPU's bf16 rounding, see
  :func:`matrix_cells.interpreter_rounding`). Its graph cells need a CUDA device: they are counted as
  ``needs_cuda`` and run in the GPU script.

Default run: a pairwise covering subset of each group's accepted eager cells (every pair of values of backend,
kind, KV dtype, page size and mode that the records accept together occurs in some cell; each head dim and head
count at least once), because the interpreter takes seconds per cell. ``ATTN_SETUP_MATRIX=full`` runs every
accepted cell (8 min on this shared 2-core machine). An accepted cell that fails is a failure here, never a skip.
``ATTN_SETUP_MATRIX_OUT=DIR`` writes each group's table (markdown) and rows (JSON) there.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import matrix_cells as M  # noqa: E402
from accepted_matrix import select  # noqa: E402

from pipeline.backends import registry  # noqa: E402
from pipeline.platforms.profiles import PROFILES  # noqa: E402

FULL = os.environ.get("ATTN_SETUP_MATRIX", "") == "full"
PAIR_AXES = ("backend", "kind", "kv", "page", "mode", "graph")
HAS_CUDA = torch.cuda.is_available()
# group -> (profile, backends enumerated, a backend every cell must involve)
GROUPS = {"cpu": ("cpu", None, None), "h200-interpreted": ("h200", ("triton", "torch_native"), "triton")}
DONE: dict[str, dict[str, M.Row]] = {g: {} for g in GROUPS}


@functools.lru_cache(maxsize=None)
def group_rows(group: str) -> tuple[M.Row, ...]:
    """Every cell of ``group``, decided (status ``accepted`` or ``refused``)."""
    from pipeline.backends.packages import installed_by_import

    profile, backends, must = GROUPS[group]
    cells = [c for c in M.cells(backends) if must is None or must in (c.prefill, c.decode)]
    return tuple(M.evaluate(cells, PROFILES[profile], installed_by_import()))


@functools.lru_cache(maxsize=None)
def selected(group: str) -> tuple[M.Row, ...]:
    """The accepted cells this run builds: all of them (``ATTN_SETUP_MATRIX=full``) or a pairwise covering."""
    return tuple(runnable(group) if FULL else M.covering(runnable(group), PAIR_AXES))


def runnable(group: str) -> list[M.Row]:
    """The accepted cells that can run here: the eager ones (graph cells need a CUDA device)."""
    return [r for r in group_rows(group) if r.accepted and r.cell.graph == "eager"]


def _ids(group: str) -> list:
    return [pytest.param(r.cell, id=r.cell.label) for r in selected(group)]


def _check(group: str, cell: M.Cell, **kw) -> None:
    row = M.run_cell(cell, **kw)
    DONE[group][cell.label] = row
    assert row.status == "passed", (cell.label, row.code, row.reason, row.max_rel_err, row.tol, row.detail,
                                    row.results)
    assert row.max_rel_err is not None and row.max_rel_err <= row.tol


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded():
    """Only errors from the library's structlog events (an unconfigured structlog prints every info event), and
    one torch thread: these tensors are tiny, and on a shared 2-core machine a second intra-op thread that is not
    scheduled made single cells take seconds instead of milliseconds."""
    import logging

    import structlog

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    structlog.configure(**saved)


@pytest.mark.parametrize("cell", _ids("cpu"))
def test_accepted_on_cpu_builds_and_verifies(cell):
    """An accepted cell on the cpu profile: built on this CPU, every instance within tolerance of float64."""
    _check("cpu", cell, device="cpu", decode_steps=M.DECODE_STEPS)


@pytest.mark.skipif(HAS_CUDA, reason="CUDA present: benchmarks/accepted_matrix.py --profile h200 runs these compiled")
# the kernels divide masked-out rows 0/0 and never store them; the interpreter warns about those lanes
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("cell", _ids("h200-interpreted"))
def test_accepted_on_h200_builds_and_verifies_interpreted(cell):
    """An accepted cell on the h200 profile, run on CPU tensors (Triton interpreted, one decode step)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on CPU machines"
    facts, platform, device = M.profile_facts("h200", "cpu")
    with M.interpreter_rounding():
        _check("h200-interpreted", cell, device=device, platform=platform, decode_steps=1)


def test_every_combination_is_decided_and_refusals_are_counted():
    """Each group holds the whole product; the cpu profile accepts exactly the cells of backends whose record lists
    cpu, never PD-mux or a CUDA graph (a hybrid only with two such backends), and every refusal other than the graph
    axis carries a remedy."""
    names = registry.names()
    kinds, kvs, pages, modes, graphs = (len(M.KINDS), len(M.kv_axis()), len(M.PAGE_SIZES), len(M.MODES),
                                        len(M.GRAPHS))
    per_backend = kinds * kvs * pages * graphs
    for group, (_, backends, must) in GROUPS.items():
        n = len(backends or names)
        rows = group_rows(group)
        # one backend per cell in the other modes, ordered pairs in hybrid; with `must`, the cells involving it
        want = n * (modes - 1) + n * (n - 1) if must is None else (modes - 1) + 2 * (n - 1)
        assert len(rows) == per_backend * want, group
        s = M.summary(rows)
        assert s["accepted"] + s["refused"] == s["cells"] and s["accepted"] > 0
    cpu = group_rows("cpu")
    on_cpu = {n for n in names if "cpu" in registry.get(n).capability.devices}
    assert {r.cell.backend for r in cpu if r.accepted} == on_cpu
    for r in cpu:
        if r.cell.graph == "graph" or r.cell.mode == "pdmux" or (r.cell.mode == "hybrid" and len(on_cpu) < 2):
            assert not r.accepted, r.cell.label
        if r.cell.graph == "graph" and r.cell.backend in on_cpu and r.cell.mode in ("normal", "tbo", "spec"):
            assert r.code == "graph_skipped" and "CUDA device" in r.reason, (r.cell.label, r.code, r.reason)
        if not r.accepted and not r.code.startswith("graph_"):
            assert r.has_remedy, (r.cell.label, r.code, r.reason)
    interp = group_rows("h200-interpreted")
    assert any(r.accepted and r.cell.graph == "graph" for r in interp)  # listed as needs_cuda here, run on the GPU


@pytest.mark.parametrize("group", list(GROUPS))
def test_covering_subset_covers_every_accepted_pair(group):
    """The default run's subset: every pair of axis values accepted together occurs together in it."""
    every = runnable(group)
    chosen = M.covering(every, PAIR_AXES)
    assert set(map(id, chosen)) <= set(map(id, every))

    def pairs(rows):
        out = set()
        for r in rows:
            v = [(a, r.cell.values()[a]) for a in PAIR_AXES]
            out |= {(x, y) for i, x in enumerate(v) for y in v[i + 1:]}
        return out

    assert pairs(chosen) == pairs(every)
    for axis in ("dims", "heads"):
        assert {r.cell.values()[axis] for r in chosen} == {r.cell.values()[axis] for r in every}, axis
    assert len(chosen) < len(every) or len(every) <= 1


def test_a_wrong_backend_fails_its_cell(monkeypatch):
    """The harness can fail: torch_native answering decode with zeros makes an accepted cell ``failed``."""
    from pipeline.backends.torch_native import TorchNativeBackend

    cell = M.Cell("torch_native", "torch_native", "full", "auto", 16, "tbo", "eager", (64, 64), (2, 2))
    monkeypatch.setattr(TorchNativeBackend, "forward_decode", lambda self, q, *a, **k: torch.zeros_like(q))
    row = M.run_cell(cell, device="cpu")
    assert row.status == "failed" and row.max_rel_err is not None and row.max_rel_err > row.tol
    assert not all(r["passed"] for r in row.results)


def test_a_graph_cell_that_captures_nothing_fails():
    """A graph cell passes only through replayed graphs: on CPU (no capture possible) it is ``failed``, not passed."""
    cell = M.Cell("torch_native", "torch_native", "full", "auto", 16, "normal", "graph", (64, 64), (2, 2))
    row = M.run_cell(cell, device="cpu")
    assert row.status == "failed" and "captured none" in row.reason, (row.code, row.reason)


def test_table_records_every_cell():
    """The table and summary of each group: every cell decided, the ones run with their error (this runs last, so
    the cells verified carry their results); ``ATTN_SETUP_MATRIX_OUT`` gets the files."""
    out_dir = os.environ.get("ATTN_SETUP_MATRIX_OUT")
    for group in GROUPS:
        picked = selected(group)
        rows = [DONE[group].get(r.cell.label, r) for r in select(group_rows(group), picked, picked, False)]
        s = M.summary(rows)
        assert s["failed"] == 0 and s["cells"] == len(group_rows(group))
        assert s["passed"] + s["needs_cuda"] + s["not_in_subset"] + sum(r.status == "accepted" for r in rows) \
            == s["accepted"]
        text = M.table(rows)
        assert text.count("\n") == s["accepted"] + 1
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, f"matrix-{group}.md").write_text(text + f"\n\n{json.dumps(s)}\n")
            Path(out_dir, f"matrix-{group}.json").write_text(json.dumps({"summary": s,
                                                                         "rows": [r.to_json() for r in rows]}))
