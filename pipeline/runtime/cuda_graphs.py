"""CUDA graphs: capture the attention stack's decode step (or a speculative step) per batch size, replay it later.

As sglang's ``CudaGraphRunner``: fixed-address inputs for the largest batch, the backend's ``init_cuda_graph_state``,
then per size (largest first, one pool) capture metadata, a side-stream warm-up and the capture. A replay copies the
batch in, pads it to the next captured size (request row 0, the backend's fill ``seq_len``, KV slot 0), sets replay
metadata outside the graph and replays. Speculative workers capture their own step (target verify of
``num_draft_tokens`` rows, draft decode of ``topk`` rows per request). Which sizes: :mod:`states.build_mode`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import ConfigError
from pipeline.platforms.cuda import capture_graph, capture_stream


def _graph_pool_bytes(torch: Any, pool: Any) -> int:
    """Bytes of segments held by the private pool ``pool`` (``torch.cuda.memory_snapshot()``; all reserved bytes on a
    torch that does not name pools). Reserved-before/after misses them when the allocator frees cached blocks to make
    room."""
    segments = torch.cuda.memory_snapshot()
    if segments and "segment_pool_id" not in segments[0]:
        return int(torch.cuda.memory_reserved())
    want = _as_id(pool)
    return sum(int(s["total_size"]) for s in segments if _as_id(s["segment_pool_id"]) == want)


def _as_id(pool_id: Any) -> Any:
    """A memory-pool id comparable whether it came as a tuple (graph_pool_handle) or a list (a snapshot)."""
    return tuple(pool_id) if isinstance(pool_id, (tuple, list)) else pool_id


class DecodeGraphRunner:
    """Captured graphs of ``stack`` through ``backend`` for ``batch_sizes`` (requests). ``mode``: ``DECODE``,
    ``TARGET_VERIFY`` or ``DRAFT_DECODE`` (with ``spec``: ``tokens_per_req`` rows each); ``on_captured(bs, capture_ms)``
    after each capture; :attr:`step_device_bytes`: free memory before the buffers minus after the last capture;
    :attr:`capture_ms`: bs → ms (warm-up included)."""

    def __init__(self, stack: Any, backend: Any, req_to_token_pool: Any, kv_pool: Any,
                 batch_sizes: Sequence[int], mode: ForwardMode = ForwardMode.DECODE, spec: Any = None) -> None:
        import torch

        self.stack, self.backend, self.req_pool, self.kv_pool = stack, backend, req_to_token_pool, kv_pool
        self.mode, self.spec = mode, spec
        self.tokens_per_req = {ForwardMode.TARGET_VERIFY: getattr(spec, "num_draft_tokens", 1),
                               ForwardMode.DRAFT_DECODE: getattr(spec, "topk", 1)}.get(mode, 1)
        self.free_at_start = int(torch.cuda.mem_get_info()[0]) if kv_pool.device.type == "cuda" else 0
        self.step_device_bytes = 0
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        dev, n, rows = kv_pool.device, self.max_bs, self.max_bs * self.tokens_per_req
        self.fill = int(backend.get_cuda_graph_seq_len_fill_value())
        self.buf = {"hidden": torch.zeros(rows, stack.hidden, dtype=stack.dtype, device=dev),
                    "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                    "req_pool_indices": torch.zeros(n, dtype=torch.int64, device=dev),
                    "seq_lens": torch.full((n,), self.fill, dtype=torch.int32, device=dev),
                    "out_cache_loc": torch.zeros(rows, dtype=torch.int64, device=dev)}
        if mode is ForwardMode.TARGET_VERIFY:  # the tree tokens follow their prefix: extend fields
            self.buf["extend_prefix_lens"] = torch.zeros(n, dtype=torch.int32, device=dev)
            self.buf["extend_seq_lens"] = torch.full((n,), self.tokens_per_req, dtype=torch.int32, device=dev)
            self.buf["seq_lens"].fill_(self.tokens_per_req)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Any, list[Any]]] = {}
        self.capture_ms: dict[int, float] = {}
        self.graph_bytes: dict[int, int] = {}  # bytes each size's capture added to the graphs' private memory pool
        self.device_bytes: dict[int, int] = {}  # device free bytes before minus after each size's capture
        self.pool: Any = None
        self.stream: Any = None

    def _spec_info(self, bs: int, parents: Any = None, draft_slots: Any = None) -> Any:
        """The SpecInfo of a captured or replayed batch: trees (default chains) or draft slots (default one token
        per branch, in the padding slot)."""
        if self.mode is ForwardMode.DECODE:
            return None
        import torch

        from pipeline.backends.speculative import SpecInfo

        t, topk = self.tokens_per_req, getattr(self.spec, "topk", 1)
        if self.mode is ForwardMode.TARGET_VERIFY:
            return SpecInfo(topk=topk, num_draft_tokens=t, parents=parents or [list(range(-1, t - 1))] * bs)
        if draft_slots is None:
            draft_slots = torch.zeros((bs, topk, 1), dtype=torch.int64, device=self.kv_pool.device)
        return SpecInfo(topk=topk, num_draft_tokens=getattr(self.spec, "num_draft_tokens", 0), draft_slots=draft_slots)

    def _batch(self, bs: int, spec_info: Any = None) -> Any:
        from pipeline.backends.base import ForwardBatch

        b, rows = self.buf, bs * self.tokens_per_req
        seq_cpu = [self.fill] * bs if self.mode is not ForwardMode.TARGET_VERIFY else [self.tokens_per_req] * bs
        fb = ForwardBatch(forward_mode=self.mode, batch_size=bs, req_pool_indices=b["req_pool_indices"][:bs],
                          seq_lens=b["seq_lens"][:bs], out_cache_loc=b["out_cache_loc"][:rows],
                          positions=b["positions"][:rows], req_to_token_pool=self.req_pool,
                          token_to_kv_pool=self.kv_pool, seq_lens_cpu=seq_cpu,
                          spec_info=spec_info if spec_info is not None else self._spec_info(bs))
        if self.mode is ForwardMode.TARGET_VERIFY:
            fb.extend_prefix_lens, fb.extend_seq_lens = b["extend_prefix_lens"][:bs], b["extend_seq_lens"][:bs]
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [0] * bs, [self.tokens_per_req] * bs
        return fb

    def capture(self, on_captured: Optional[Callable[[int, float], None]] = None) -> None:
        """Capture every batch size, largest first (so smaller graphs reuse its memory pool)."""
        import torch

        self.backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.tokens_per_req)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(self.kv_pool.device)  # the process's one capture stream (see capture_graph)
        for bs in reversed(self.batch_sizes):
            t0 = time.perf_counter()
            before, free = _graph_pool_bytes(torch, self.pool), torch.cuda.mem_get_info()[0]
            fb = self._batch(bs)
            b, rows = self.buf, bs * self.tokens_per_req
            self.backend.init_forward_metadata_capture_cuda_graph(
                bs, rows, b["req_pool_indices"][:bs], b["seq_lens"][:bs], None, self.mode, fb.spec_info)
            step = lambda rows=rows, fb=fb: self.stack.forward(b["hidden"][:rows], fb, self.backend)  # noqa: E731
            g, out = capture_graph(step, pool=self.pool, stream=self.stream)
            torch.cuda.synchronize()
            self.graphs[bs], self.outputs[bs] = g, out
            self.capture_ms[bs] = (time.perf_counter() - t0) * 1e3
            self.graph_bytes[bs] = max(_graph_pool_bytes(torch, self.pool) - before, 0)
            self.device_bytes[bs] = int(free - torch.cuda.mem_get_info()[0])
            if on_captured is not None:
                on_captured(bs, self.capture_ms[bs])
        self.step_device_bytes = self.free_at_start - int(torch.cuda.mem_get_info()[0])

    def graph_bs(self, bs: int) -> int:
        """The smallest captured size >= ``bs``; ConfigError when ``bs`` exceeds every captured size."""
        for b in self.batch_sizes:
            if b >= bs:
                return b
        raise ConfigError(f"decode batch of {bs} exceeds the largest captured size {self.max_bs}",
                          code="invalid_value", flags=[("batch_size", bs), ("cuda_graph_max_bs", self.max_bs)],
                          remedy="raise cuda_graph_max_bs, or run this batch eagerly")

    def can_run(self, forward_batch: Any) -> bool:
        """Whether this batch fits a captured graph: the captured mode, at most the largest size, and (speculative)
        ``tokens_per_req`` rows per request (every tree of ``num_draft_tokens``; ``topk`` branches)."""
        fb = forward_batch
        if fb.forward_mode is not self.mode or fb.batch_size > self.max_bs or not self.graphs:
            return False
        if self.mode is ForwardMode.TARGET_VERIFY:
            return all(int(n) == self.tokens_per_req for n in (fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()))
        return fb.num_tokens == fb.batch_size * self.tokens_per_req

    def replay(self, hidden: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        """Replay the captured step for a real batch (B <= max captured size, ``hidden`` [rows, hidden_size]); returns
        copies of (output [rows, hidden], aux list)."""
        import torch

        fb, n = forward_batch, forward_batch.batch_size
        bs, b, t = self.graph_bs(n), self.buf, self.tokens_per_req
        rows, pad = n * t, bs * t
        b["hidden"][:rows].copy_(hidden)
        b["positions"][:rows].copy_(fb.positions)
        b["req_pool_indices"][:n].copy_(fb.req_pool_indices)
        b["seq_lens"][:n].copy_(fb.seq_lens)
        b["out_cache_loc"][:rows].copy_(fb.out_cache_loc)
        b["req_pool_indices"][n:bs].zero_()
        b["seq_lens"][n:bs].fill_(t if self.mode is ForwardMode.TARGET_VERIFY else self.fill)
        b["out_cache_loc"][rows:pad].zero_()
        b["positions"][rows:pad].zero_()
        seq_cpu = list(fb.seq_lens_cpu) + [t if self.mode is ForwardMode.TARGET_VERIFY else self.fill] * (bs - n)
        spec_info = self._replay_spec(fb, bs)
        if self.mode is ForwardMode.TARGET_VERIFY:
            b["extend_prefix_lens"][:n].copy_(fb.extend_prefix_lens)
            b["extend_prefix_lens"][n:bs].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(
            bs, b["req_pool_indices"][:bs], b["seq_lens"][:bs], sum(seq_cpu), None, self.mode, spec_info,
            torch.tensor(seq_cpu, dtype=torch.int32))
        self.graphs[bs].replay()
        out, aux = self.outputs[bs]
        return out[:rows].clone(), [a[:rows].clone() for a in aux]

    def _replay_spec(self, fb: Any, bs: int) -> Any:
        """The replayed batch's SpecInfo padded to ``bs`` requests (chains / branches in the padding slot)."""
        if self.mode is ForwardMode.DECODE:
            return None
        import torch

        n, info = fb.batch_size, fb.spec_info
        if self.mode is ForwardMode.TARGET_VERIFY:
            chain = list(range(-1, self.tokens_per_req - 1))  # the padding requests verify a chain
            return self._spec_info(bs, parents=list(info.parents) + [chain] * (bs - n))
        slots = info.draft_slots
        if bs > n:
            slots = torch.cat([slots, torch.zeros((bs - n, *slots.shape[1:]), dtype=slots.dtype, device=slots.device)])
        return self._spec_info(bs, draft_slots=slots)

    def close(self) -> None:
        """Drop the graphs, their outputs and the memory pool handle."""
        self.graphs, self.outputs, self.pool = {}, {}, None
