"""CUDA-graph capture and replay emulated on the CPU, to test a runner's and a backend's graph metadata without a GPU.

:func:`emulate_graphs` patches :mod:`pipeline.runtime.cuda_graphs` so that ``capture_graph(fn)`` runs ``fn`` once and
returns a graph whose ``replay()`` runs ``fn`` again and copies its results into the tensors the capture returned —
what a real replay does: the same kernels over the same fixed-address buffers, writing the same output memory. So a
replay is right only if ``init_forward_metadata_replay_cuda_graph`` refreshed the backend's buffers (a stale tree mask
or token table gives the old batch's answer). The CUDA memory queries return zeros. Real capture runs on the H200
(tests/gpu/test_speculative_gpu.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class EmulatedGraph:
    """A captured step: ``replay()`` re-runs it into the captured outputs."""

    def __init__(self, fn: Callable[[], Any], out: Any) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new, aux = self.fn()
        self.out[0].copy_(new)
        for a, b in zip(self.out[1], aux):
            a.copy_(b)


def emulate_graphs(monkeypatch: Any) -> None:
    """Patch the capture primitives and CUDA memory queries of :mod:`pipeline.runtime.cuda_graphs` (see the module
    docstring)."""
    import pipeline.runtime.cuda_graphs as cg

    def capture(fn: Callable[[], Any], pool: Any = None, stream: Any = None) -> tuple[EmulatedGraph, Any]:
        out = fn()
        return EmulatedGraph(fn, out), out

    monkeypatch.setattr(cg, "capture_graph", capture)
    monkeypatch.setattr(cg, "capture_stream", lambda device: None)
    monkeypatch.setattr(cg, "_graph_pool_bytes", lambda torch_, pool: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))


def replays_match_eager(runner: Any, stack: Any, eager: Any, alloc: Any, kv: Any, gen: torch.Generator,
                        dtype: torch.dtype, steps: int = 2) -> list[float]:
    """Three requests (rows 1, 3, 4: a batch padded to the captured 4) extend eagerly, then ``steps`` batches of the
    runner's mode — new random trees of ``num_draft_tokens`` or the next draft branches each time — replay; returns
    each replay's ``rel_err`` against the same step run eagerly through ``eager`` (the attention updates, out - in)."""
    from pipeline.backends.memory import make_draft_batch, make_forward_batch
    from pipeline.backends.speculative import SpecInfo
    from pipeline.core.contracts import ForwardMode
    from pipeline.runtime.reference import rel_err
    from pipeline.runtime.spec_batches import next_branches, random_tree

    spec, rows, hidden = runner.spec, [1, 3, 4], stack.hidden
    fb = make_forward_batch(ForwardMode.EXTEND, rows, [9, 5, 12], alloc, kv)
    eager.init_forward_metadata(fb)
    stack.forward(torch.randn(26, hidden, generator=gen).to(dtype), fb, eager)
    prev, errs = None, []
    for _ in range(steps):
        if runner.mode is ForwardMode.TARGET_VERIFY:
            n = spec.num_draft_tokens
            info = SpecInfo(topk=spec.topk, num_draft_tokens=n,
                            parents=[random_tree(n, spec.topk, spec.num_steps, gen) for _ in rows])
            fb = make_forward_batch(runner.mode, rows, [n] * len(rows), alloc, kv, spec_info=info)
        else:
            prev, _ = next_branches(prev, rows, spec.topk, alloc, gen)
            fb = make_draft_batch(rows, prev, alloc, kv)
        assert runner.can_run(fb)
        h = torch.randn(fb.num_tokens, hidden, generator=gen).to(dtype)
        replayed, _ = runner.replay(h, fb)
        eager.init_forward_metadata(fb)
        want, _ = stack.forward(h, fb, eager)
        errs.append(rel_err(replayed - h.float(), want - h.float()))
    return errs
