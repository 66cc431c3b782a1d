"""Planning one forward batch for the FlashInfer backend: the host-side indptr / last-page-len metadata and the page
ids gathered on the device (:mod:`pipeline.backends.kv_indices`), then ``plan()`` on every layer kind's wrapper —
outside any CUDA graph, once per batch. :class:`FlashInferPlanning` is a mixin of
:class:`pipeline.backends.flashinfer.FlashInferBackend` (it reads ``req_pool``, ``page_size``, ``kinds`` and ``fp8``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline.backends.base import ForwardBatch
from pipeline.backends.kv_indices import gather_kv_indices, host_page_meta


class FlashInferPlanning:
    """``page_table`` / ``plan_decode`` / ``plan_extend`` of :class:`~pipeline.backends.flashinfer.FlashInferBackend`."""

    req_pool: Any
    page_size: int
    kinds: list
    fp8: bool
    extend_ragged: bool

    def page_table(self, req_pool_indices: torch.Tensor, seq_lens: list[int],
                   seq_lens_dev: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """(kv_indptr [B+1] int32 CPU, kv_indices [P] int32 device, last_page_len [B] int32 CPU).

        ``seq_lens`` (host ints) give the host metadata (:func:`kv_indices.host_page_meta`);
        ``seq_lens_dev`` (the same lengths on the pool's device, e.g. ``ForwardBatch.seq_lens``;
        copied from ``seq_lens`` when absent) feeds the one-launch device gather
        (:func:`kv_indices.gather_kv_indices`), written into ``out`` when given (a CUDA-graph buffer).
        """
        r2t = self.req_pool.req_to_token
        indptr, last, total = host_page_meta(seq_lens, self.page_size)
        if not isinstance(seq_lens_dev, torch.Tensor) or seq_lens_dev.device != r2t.device:
            seq_lens_dev = torch.tensor(seq_lens, dtype=torch.int32).to(r2t.device, non_blocking=True)
        rows = req_pool_indices if req_pool_indices.device == r2t.device else req_pool_indices.to(r2t.device)
        indices = gather_kv_indices(r2t, rows, seq_lens_dev, total, self.page_size, out=out)
        return indptr, indices, last

    def plan_decode(self, kinds_wrappers: list[tuple[Any, Any, str]], req_pool_indices: torch.Tensor,
                    seq_lens: list[int], seq_lens_dev: Optional[torch.Tensor] = None,
                    indices_out: Optional[torch.Tensor] = None) -> None:
        """Plan every kind's decode wrapper for one batch (outside any CUDA graph).

        ``kinds_wrappers``: (kind wrappers, wrapper, class) with class ``"decode"``, ``"prefill"``
        (sink kinds) or ``"mla"`` (see :meth:`KindWrappers.decode_wrapper`).
        """
        indptr, indices, last = self.page_table(req_pool_indices, seq_lens, seq_lens_dev, indices_out)
        qo = kv_lens = None
        for kw, w, cls in kinds_wrappers:
            k = kw.kind
            if cls == "decode":
                w.plan(indptr=indptr, indices=indices, last_page_len=last, **kw.decode_kw)
                kw.active, kw.mode = w, "decode"
                continue
            qo = torch.arange(len(seq_lens) + 1, dtype=torch.int32) if qo is None else qo
            if cls == "mla":
                kv_lens = torch.tensor(seq_lens, dtype=torch.int32) if kv_lens is None else kv_lens
                kw.plan(w, qo, indptr, indices, kv_lens, causal=False)
                continue
            w.plan(qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=indices, paged_kv_last_page_len=last,
                   head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v, page_size=self.page_size, causal=False,
                   **kw.plan_kw)
            kw.active, kw.mode = w, "decode"

    def plan_extend(self, fb: ForwardBatch) -> None:
        """Plan every kind for an extend batch (ragged if no request has a cached prefix)."""
        ext = _host_ints(fb.extend_seq_lens_cpu, fb.extend_seq_lens)
        pre = _host_ints(fb.extend_prefix_lens_cpu, fb.extend_prefix_lens)
        qo = torch.zeros(len(ext) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(ext, dtype=torch.int32), 0, out=qo[1:])
        # an fp8 cache is read back as stored (paged) for the new tokens too, never from the ragged k/v
        self.extend_ragged = not any(pre) and not self.fp8
        paged_args = None
        seq = [p + e for p, e in zip(pre, ext)]
        for kw in self.kinds:
            k = kw.kind
            if not kw.mla and self.extend_ragged and kw.ragged is not None:
                kw.ragged.plan(qo_indptr=qo, kv_indptr=qo, head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v,
                               causal=True, **kw.plan_kw)
                kw.active, kw.mode = kw.ragged, "ragged"
                continue
            if paged_args is None:
                paged_args = self.page_table(fb.req_pool_indices, seq, fb.seq_lens)
            indptr, indices, last = paged_args
            if kw.mla:
                kw.plan(kw.wrapper, qo, indptr, indices, torch.tensor(seq, dtype=torch.int32), causal=True)
                continue
            dims = dict(head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v, causal=True, **kw.plan_kw)
            kw.paged.plan(qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=indices,
                          paged_kv_last_page_len=last, page_size=self.page_size, **dims)
            kw.active, kw.mode = kw.paged, "paged"


def _host_ints(host: Any, device: torch.Tensor) -> list[int]:
    """Host lengths as a list: ours are lists, sglang's ``seq_lens_cpu`` is a CPU tensor; read the
    device tensor (a sync) only when the engine gave none."""
    if host is None or len(host) == 0:
        return device.tolist()
    return host.tolist() if isinstance(host, torch.Tensor) else list(host)
