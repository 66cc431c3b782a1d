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
