"""CUDA-graph state of the FlashInfer backends: fixed index buffers and per-batch-size wrappers.

FlashInfer's ``use_cuda_graph=True`` wrappers freeze the batch size and the *addresses* of their
indptr / indices / last-page-len buffers; ``plan()`` (outside the graph, before every replay)
rewrites their contents. As in sglang, one set of buffers sized for ``max_bs`` requests is
allocated once in ``init_cuda_graph_state`` and each captured batch size gets wrappers over
prefix slices of them. Padded slots (the engine pads a batch up to the captured size with
``seq_len = 1`` on request row 0, whose page 0 is reserved) are planned like real requests.
MLA kinds get a ``use_cuda_graph=True`` :class:`flashinfer.mla.BatchMLAPagedAttentionWrapper` per
batch size over the same buffers plus ``kv_len`` (sglang's flashinfer_mla backend does the same);
each such wrapper also allocates FlashInfer's own 8 MiB int workspace (and a pinned host copy).
"""

from __future__ import annotations

from typing import Any

import torch

# flashinfer.py (which imports this module) defines the backend and its per-kind wrappers: named here for
# the annotations only, so that this module does not import it back.
FlashInferBackend = KindWrappers = Any


class GraphState:
    """Buffers for ``max_bs`` requests of up to ``max_context_len`` tokens, and wrappers per bs.

    ``indptr`` [max_bs+1] int32, ``indices`` [max_bs * ceil(max_context_len / page_size)] int32,
    ``last_page_len`` [max_bs] int32, ``qo_indptr`` [max_bs+1] int32 (0..max_bs, for the prefill-
    class wrappers used by sink layers and the MLA wrappers), ``kv_len`` [max_bs] int32 (tokens per
    request, for the MLA wrappers); all on the KV pool's device.
    """

    def __init__(self, backend: "FlashInferBackend", max_bs: int, max_num_tokens: int) -> None:
        self.backend = backend
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        dev = backend.kv_pool.device
        pages = -(-backend.req_pool.max_context_len // backend.page_size)
        i32 = dict(dtype=torch.int32, device=dev)
        self.indptr = torch.zeros(max_bs + 1, **i32)
        self.indices = torch.zeros(max_bs * pages, **i32)
        self.last_page_len = torch.ones(max_bs, **i32)
        self.qo_indptr = torch.arange(max_bs + 1, **i32)
        self.kv_len = torch.ones(max_bs, **i32)
        self._by_bs: dict[int, list[tuple["KindWrappers", Any, str]]] = {}

    def buffers(self) -> list[torch.Tensor]:
        """The fixed-address tensors this state owns."""
        return [self.indptr, self.indices, self.last_page_len, self.qo_indptr, self.kv_len]

    def wrappers(self, bs: int) -> list[tuple["KindWrappers", Any, str]]:
        """(kind, wrapper, class) per layer kind for batch size ``bs`` (made on first use); class as in
        :meth:`~pipeline.backends.flashinfer.KindWrappers.decode_wrapper`."""
        if bs > self.max_bs:
            from pipeline.core.errors import ConfigError

            raise ConfigError(f"graph batch size {bs} exceeds the {self.max_bs} buffers were sized for",
                              flags=[("cuda_graph_max_bs", self.max_bs), ("bs", bs)],
                              remedy="raise cuda_graph_max_bs or capture a smaller batch")
        if bs not in self._by_bs:
            self._by_bs[bs] = [self._make(kw, bs) for kw in self.backend.kinds]
        return self._by_bs[bs]

    def _make(self, kw: "KindWrappers", bs: int) -> tuple["KindWrappers", Any, str]:
        b, fi = self.backend, self.backend.fi
        if kw.mla:
            w = b.mla_wrapper(kw.mla_backend, use_cuda_graph=True, qo_indptr=self.qo_indptr[: bs + 1],
                              kv_indptr=self.indptr[: bs + 1], kv_indices=self.indices, kv_len_arr=self.kv_len[:bs])
            return kw, w, "mla"
        bufs = dict(paged_kv_indptr_buf=self.indptr[: bs + 1], paged_kv_indices_buf=self.indices,
                    paged_kv_last_page_len_buf=self.last_page_len[:bs])
        if kw.sinks:
            w = b.sink_wrapper(kw.kind, kw.window_left, use_cuda_graph=True, qo_indptr_buf=self.qo_indptr[: bs + 1], **bufs)
            return kw, w, "prefill"
        _, cls = kw.decode_wrapper(bs, b.kv_dtype_name)
        tc = kw.decode_cc is None or kw.decode_wrapper(bs, b.kv_dtype_name)[0] is kw.decode_tc
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            b.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
            backend=b.prefill_backend if tc else "auto",
            paged_kv_indptr_buffer=bufs["paged_kv_indptr_buf"], paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=bufs["paged_kv_last_page_len_buf"])
        return kw, w, cls
