"""Verification harness: run a real batch through a built backend and compare with the reference (docs/internals.md)."""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Optional, Sequence

import msgspec
import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer
from pipeline.backends.memory import (dequantize_kv, KVPool, layer_kv_scales, make_draft_batch, make_forward_batch,
    PageAllocator, quantize_kv, ReqToTokenPool, torch_dtype)
from pipeline.backends.speculative import SpecInfo
from pipeline.core.contracts import ForwardMode, LayerKind, ModelSpec, SetupRequest, SpeculativeParams
from pipeline.core.dtypes import norm_dtype
from pipeline.core.errors import BuildError
from pipeline.memory.pools import NEW_LENS, PREFIX_LENS
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.spec_batches import accept_path, next_branches, path_to, random_path, random_tree


class _Case:
    """One layer kind under test: its layer, q gain and the un-paged K/V history per request."""

    def __init__(self, kind: LayerKind, kv_pool: KVPool, device: torch.device, gen: torch.Generator) -> None:
        lid = kind.layer_ids[0] if kind.layer_ids else 0
        want = (kind.num_kv_heads, kind.head_dim_qk), (kind.num_kv_heads, kind.head_dim_v)
        have = ((tuple(kv_pool.k_buffer[lid].shape[1:]), tuple(kv_pool.v_buffer[lid].shape[1:]))
                if lid < len(kv_pool.k_buffer) else None)
        if have != want:
            raise BuildError(f"KV pool layer {lid} has dims {have}, the model's {kind.kind} layers need {want}",
                             code="verify_pool_mismatch", flags=[("layer_id", lid)],
                             remedy="build the KV pool from the model's layer kinds")
        sinks = None
        if kind.has_sinks:
            sinks = (torch.randn(kind.num_heads, generator=gen) + 2.0).to(device)
        self.kind = kind
        self.layer = AttentionLayer(layer_id=lid, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                                    head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                                    sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks,
                                    is_mla=kind.is_mla, attention_chunk_size=kind.attention_chunk_size)
        self.q_gain = 1.0
        if kind.logit_softcap is not None:
            self.q_gain = kind.logit_softcap / (math.sqrt(kind.head_dim_qk) * kind.scaling)
        self.k_hist: dict[int, list[torch.Tensor]] = {}
        self.v_hist: dict[int, list[torch.Tensor]] = {}
        self.draft: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # draft-token slot -> its stored (K, V)

    def accept(self, row: int, prefix: int, path: Sequence[int]) -> None:
        """After target verify: request ``row``'s history keeps its first ``prefix`` tokens and the tree tokens on
        ``path`` (root first), as the pool does (:func:`pipeline.runtime.spec_batches.accept_path`)."""
        for hist in (self.k_hist, self.v_hist):
            h = torch.cat(hist[row])
            hist[row] = [torch.cat([h[:prefix], h[[prefix + i for i in path]]])]

    def notes(self) -> list[str]:
        k, out = self.kind, []
        if k.logit_softcap is not None:
            out.append(f"softcap {k.logit_softcap}: q x{self.q_gain:.3g} so scores reach the cap")
        return out


def _inputs(case: _Case, n: int, dtype: torch.dtype, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv] (MLA: v = the latent part of k)."""
    L = case.layer
    q = (torch.randn(n, L.num_heads, L.head_dim, generator=gen) * case.q_gain).to(dtype)
    k = torch.randn(n, L.num_kv_heads, L.head_dim, generator=gen).to(dtype)
    if L.is_mla:
        v = k[..., : L.v_head_dim].clone()
    else:
        v = torch.randn(n, L.num_kv_heads, L.v_head_dim, generator=gen).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def _ancestors_mask(parents: Sequence[int], prefix: int) -> torch.Tensor:
    """[n, prefix + n] bool: every tree token sees the prefix, itself and its ancestors — from the paths to the root
    (:func:`pipeline.runtime.spec_batches.path_to`), not from the backends' mask builder."""
    n = len(parents)
    mask = torch.zeros((n, prefix + n), dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        mask[i, [prefix + j for j in path_to(parents, i)]] = True
    return mask


def _reference(case: _Case, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, q_pos: torch.Tensor,
               k_pos: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    L = case.layer
    return reference_attention(q.cpu(), kk, vv, q_positions=q_pos, scale=L.scaling, window=L.sliding_window,
                               softcap=L.logit_softcap, sinks=None if L.sinks is None else L.sinks.cpu(),
                               chunk=L.attention_chunk_size, k_positions=k_pos, mask=mask)


def _check_case_step(case: _Case, backend: AttentionBackend, fb, rows: Sequence[int], new: Sequence[int],
                     dtype: torch.dtype, gen: torch.Generator) -> list[float]:
    """Run one layer of one step; returns the per-request relative errors (draft decode: the worst branch of each
    request). A target-verify step appends the whole tree to each request's history (:meth:`_Case.accept` keeps the
    accepted path afterwards); a draft-decode step keeps its tokens apart, by slot."""
    pool, dev = fb.token_to_kv_pool, fb.token_to_kv_pool.device
    t = fb.num_tokens
    q, k, v = _inputs(case, t, dtype, dev, gen)
    out = backend.forward(q, k, v, case.layer, fb, save_kv_cache=True)
    L = case.layer
    out = out.reshape(t, L.num_heads, L.v_head_dim).cpu()
    ks, vs = layer_kv_scales(pool, L.layer_id)
    f64 = torch.float64
    k_st = dequantize_kv(quantize_kv(k, pool.dtype, ks), ks, f64).cpu()
    v_st = dequantize_kv(quantize_kv(v, pool.dtype, vs), vs, f64).cpu()
    if fb.is_draft_decode():
        return _check_draft(case, fb, rows, q, out, k_st, v_st)
    errs, start = [], 0
    for b, (row, n) in enumerate(zip(rows, new)):
        sl = slice(start, start + n)
        hist_k, hist_v = case.k_hist.setdefault(row, []), case.v_hist.setdefault(row, [])
        prefix = sum(x.shape[0] for x in hist_k)
        hist_k.append(k_st[sl])
        hist_v.append(v_st[sl])
        kk, vv = torch.cat(hist_k), torch.cat(hist_v)
        if fb.is_target_verify():
            parents = fb.spec_info.parents[b]
            q_pos = torch.tensor([prefix + len(path_to(parents, i)) - 1 for i in range(n)])
            ref = _reference(case, q[sl], kk, vv, q_pos, torch.cat([torch.arange(prefix), q_pos]),
                             _ancestors_mask(parents, prefix))
        else:
            ref = _reference(case, q[sl], kk, vv, torch.arange(prefix, prefix + n))
        errs.append(rel_err(out[sl], ref))
        start += n
    return errs


def _check_draft(case: _Case, fb, rows: Sequence[int], q: torch.Tensor, out: torch.Tensor, k_st: torch.Tensor,
                 v_st: torch.Tensor) -> list[float]:
    """Draft decode: branch ``(b, j)`` against the request's history and its own draft tokens (by slot)."""
    slots = fb.spec_info.draft_slots.cpu()
    topk = slots.shape[1]
    for i, slot in enumerate(slots[:, :, -1].reshape(-1).tolist()):
        case.draft[slot] = (k_st[i: i + 1], v_st[i: i + 1])
    errs = []
    for b, row in enumerate(rows):
        hist_k, hist_v = torch.cat(case.k_hist[row]), torch.cat(case.v_hist[row])
        worst = 0.0
        for j in range(topk):
            r = b * topk + j
            mine = [case.draft[int(x)] for x in slots[b, j]]
            kk = torch.cat([hist_k] + [m[0] for m in mine])
            vv = torch.cat([hist_v] + [m[1] for m in mine])
            ref = _reference(case, q[r: r + 1], kk, vv, torch.tensor([kk.shape[0] - 1]))
            e = rel_err(out[r: r + 1], ref)
            worst = e if not e <= worst else worst
        errs.append(worst)
    return errs


VERIFY_WINDOW = 7
VERIFY_CHUNK = 8  # requests reach 26 tokens: chunk boundaries at 8, 16, 24 fall inside prefixes and new tokens
_Q_DTYPES = ("bfloat16", "float16", "float32")


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Outcome of verifying one instance: ``max_rel_err`` (worst ``max|out - ref| / max|ref|``, ``inf`` for NaN/inf),
    ``passed`` = ``max_rel_err <= tol``."""

    role: str
    backend: str
    max_rel_err: float
    passed: bool
    tol: float
    detail: str
    duration_ms: float = 0.0  # wall time of this instance's check (set by verify_built)


def _torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = norm_dtype(str(dtype))
    if name not in _Q_DTYPES:
        raise BuildError(f"verification dtype {dtype!r} is not supported", code="verify_dtype",
                         flags=[("dtype", dtype)], allowed=list(_Q_DTYPES), remedy="use bfloat16, float16 or float32")
    return torch_dtype(name)


# Allowed max|out - ref| / max|ref| per q dtype, for every KV dtype (the reference reads the dequantized stored K/V):
# fp32 1e-4, bf16/fp16 1e-2 (FlashInfer fp8 measured <= 6.9e-3, benchmarks/RESULTS.md).
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}


def tolerance(dtype: Any, kv_dtype: Any = None) -> float:
    """Allowed relative error for q/output ``dtype``: :data:`TOLERANCE` (fp32 1e-4, bf16/fp16 1e-2) for every
    ``kv_dtype``, as the reference reads the dequantized stored K/V."""
    name = str(_torch_dtype(dtype)).replace("torch.", "")
    return TOLERANCE[name]


def _steps(rows: Sequence[int], decode_steps: int, spec: Optional[SpeculativeParams] = None,
           draft: bool = False) -> list[tuple[str, ForwardMode, list[int], list[int]]]:
    """The batch's steps: prefix extend, extend, decodes; with ``spec`` a target verify of trees after the first decode,
    or a draft extend and ``spec.num_steps`` draft-decode steps of ``spec.topk`` branches."""
    b = len(rows)
    pre = [(r, p) for r, p in zip(rows, PREFIX_LENS[:b]) if p > 0]
    steps = [("prefix-extend", ForwardMode.EXTEND, [r for r, _ in pre], [p for _, p in pre])] if pre else []
    ext = ForwardMode.DRAFT_EXTEND if spec is not None and draft else ForwardMode.EXTEND
    steps.append(("draft-extend" if ext is ForwardMode.DRAFT_EXTEND else "extend", ext, list(rows), list(NEW_LENS[:b])))
    decodes = [(f"decode#{i}", ForwardMode.DECODE, list(rows), [1] * b) for i in range(decode_steps)]
    if spec is None:
        return steps + decodes
    if draft:
        steps += [(f"draft-decode#{i}", ForwardMode.DRAFT_DECODE, list(rows), [spec.topk] * b)
                  for i in range(spec.num_steps)]
        return steps + decodes
    trees = [1] + [spec.num_draft_tokens] * (b - 1) if b > 1 else [spec.num_draft_tokens]
    return steps + decodes[:1] + [("target-verify", ForwardMode.TARGET_VERIFY, list(rows), trees)] + decodes[1:]


def _spec_batch(mode: ForwardMode, rows: list[int], new: list[int], alloc: PageAllocator, kv_pool: KVPool,
                spec: Optional[SpeculativeParams], gen: torch.Generator, branches: list[Any]) -> Any:
    """The step's ForwardBatch: random trees for target verify (EAGLE-shaped: ``spec``'s top-k and steps), the next
    branches of a draft round for draft decode (``branches[0]``: the previous step's slots), else a plain batch."""
    if mode is ForwardMode.TARGET_VERIFY:
        trees = [random_tree(n, spec.topk, spec.num_steps, gen) for n in new]
        info = SpecInfo(topk=spec.topk, num_draft_tokens=spec.num_draft_tokens, parents=trees)
        return make_forward_batch(mode, rows, new, alloc, kv_pool, spec_info=info)
    if mode is ForwardMode.DRAFT_DECODE:
        branches[0], _ = next_branches(branches[0], rows, spec.topk, alloc, gen)
        return make_draft_batch(rows, branches[0], alloc, kv_pool)
    return make_forward_batch(mode, rows, new, alloc, kv_pool)


def _accept(fb: Any, rows: list[int], alloc: PageAllocator, kv_pool: KVPool, cases: list[_Case],
            gen: torch.Generator) -> None:
    """After a target-verify step: keep a random accepted path of every request's tree, in the pool and in each
    case's history."""
    for row, parents, prefix in zip(rows, fb.spec_info.parents, fb.extend_prefix_lens_cpu):
        path = random_path(parents, gen)
        accept_path(alloc, kv_pool, row, prefix, path)
        for case in cases:
            case.accept(row, prefix, path)


def verify_backend(backend: AttentionBackend, *, role: str, name: str, model: Optional[ModelSpec],
                   req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, torch_device: str | torch.device,
                   dtype: Any, seed: int = 0, decode_steps: int = 3,
                   layer_kinds: Optional[Sequence[LayerKind]] = None, notes: Sequence[str] = (),
                   spec: Optional[SpeculativeParams] = None, draft: bool = False) -> VerifyResult:
    """Verify one instance on the engine's pools (batch: docs/internals.md); returns :class:`VerifyResult`.

    ``model``'s ``layer_kinds()`` (or ``layer_kinds``, then ``model`` may be None) are tested with each kind's own
    window, softcap, scale and sinks. Rows ``0..B-1`` (B <= 5) of ``req_to_token`` are used and zeroed after. ``notes``:
    appended to the detail. ``spec``/``draft``: add speculative steps (:func:`_steps`). Raises :class:`BuildError` when
    the pools cannot hold the batch or mismatch the model; backend errors propagate.
    """
    qdtype, tol = _torch_dtype(dtype), tolerance(dtype, kv_pool.dtype)
    device = torch.device(torch_device)
    gen = torch.Generator().manual_seed(seed)
    if layer_kinds is None and model is None:
        raise BuildError("verify_backend needs a model or layer_kinds", code="verify_no_model",
                         flags=[("model", None)], remedy="pass the served ModelSpec")
    kinds = list(layer_kinds) if layer_kinds is not None else model.layer_kinds()
    cases = [_Case(kind, kv_pool, device, gen) for kind in kinds]
    rows = list(range(min(len(PREFIX_LENS), req_to_token_pool.max_reqs)))
    alloc = PageAllocator(req_to_token_pool, kv_pool.size, kv_pool.page_size, seed=seed)
    steps = _steps(rows, decode_steps, spec, draft)
    try:
        worst, where = _run_steps(backend, steps, cases, alloc, kv_pool, spec, qdtype, gen)
    finally:
        for r in rows:
            alloc.free(r)
            req_to_token_pool.req_to_token[r].zero_()
    notes = list(dict.fromkeys([*notes, *(n for c in cases for n in c.notes())]))
    scaled = sorted({layer_kv_scales(kv_pool, c.layer.layer_id) for c in cases} - {(1.0, 1.0)})
    if scaled:
        notes.append("k_scale/v_scale " + ", ".join(f"{k:g}/{v:g}" for k, v in scaled))
    detail = (f"{len(cases)} kind(s) x {len(steps)} steps x {len(rows)} reqs, "
              f"prefix {list(PREFIX_LENS[:len(rows)])}, new {list(NEW_LENS[:len(rows)])}, "
              f"page_size {kv_pool.page_size}, kv {str(kv_pool.dtype).replace('torch.', '')}")
    spec_steps = [label for label, mode, _, _ in steps if mode not in (ForwardMode.EXTEND, ForwardMode.DECODE)]
    if spec_steps:
        detail += (f", {spec.algorithm} steps {spec.num_steps} top-k {spec.topk} draft tokens {spec.num_draft_tokens}"
                   f" ({', '.join(spec_steps)})")
    detail += f"; worst at {where}"
    if notes:
        detail += "; " + "; ".join(notes)
    return VerifyResult(role=role, backend=name, max_rel_err=worst, passed=worst <= tol, tol=tol, detail=detail)


def _run_steps(backend: AttentionBackend, steps: list, cases: list[_Case], alloc: PageAllocator, kv_pool: KVPool,
               spec: Optional[SpeculativeParams], qdtype: torch.dtype, gen: torch.Generator) -> tuple[float, str]:
    """Every step through every case; the worst error and where (``kind/step/reqN``). A target-verify step is
    followed by each request's accepted path (:func:`_accept`)."""
    worst, where, branches = 0.0, "", [None]
    for label, mode, srows, new in steps:
        fb = _spec_batch(mode, srows, new, alloc, kv_pool, spec, gen, branches)
        backend.init_forward_metadata(fb)
        for case in cases:
            for row, err in zip(srows, _check_case_step(case, backend, fb, srows, new, qdtype, gen)):
                if not err <= worst:  # also catches NaN
                    worst, where = (err if err == err else math.inf), f"{case.kind.kind}/{label}/req{row}"
        if mode is ForwardMode.TARGET_VERIFY:
            _accept(fb, srows, alloc, kv_pool, cases, gen)
    return worst, where


def verify_all(instances: Iterable[tuple[str, str, AttentionBackend]], **kwargs: Any) -> list[VerifyResult]:
    """:func:`verify_backend` for each ``(role, name, backend)``; ``kwargs`` are passed through."""
    return [verify_backend(backend, role=role, name=name, **kwargs) for role, name, backend in instances]


def verification_model(model: ModelSpec, window: int = VERIFY_WINDOW,
                       chunk: int = VERIFY_CHUNK) -> tuple[ModelSpec, list[str]]:
    """``(model, changes)``: ``model`` with its sliding window capped at ``window`` and attention chunk at ``chunk``
    (the requests hold <= 26 tokens); ``(model, [])`` when nothing needs capping."""
    changes, notes = {}, []
    if model.sliding_window is not None and model.sliding_window > window:
        changes["sliding_window"] = window
        notes.append(f"sliding window {model.sliding_window}->{window}")
    if model.attention_chunk_size is not None and model.attention_chunk_size > chunk:
        changes["attention_chunk_size"] = chunk
        notes.append(f"attention chunk {model.attention_chunk_size}->{chunk}")
    if not changes:
        return model, []
    note = ", ".join(notes) + ": instances built for verification from that spec"
    return msgspec.structs.replace(model, **changes), [note]


def verify_built(backends: Any, request: SetupRequest, *, pools: Optional[dict[str, Any]] = None,
                 decode_steps: int = 3, seed: int = 0) -> list[VerifyResult]:
    """Verify a build the way it runs: every planned instance, then the top wrapper if it is not one. ``pools`` default
    ``backends.pools``. When :func:`verification_model` changes the spec the plan is rebuilt from it
    (:func:`pipeline.setup.instances.build_like`) and closed afterwards. Roles as in the plan plus ``<mode>.wrapper``.
    Raises what :func:`verify_backend` or a factory raises."""
    from pipeline.setup.instances import build_like
    from pipeline.core.dtypes import model_dtype

    served = request.served_model
    pools = pools if pools is not None else backends.pools
    spec = backends.resolution.speculative if backends.resolution is not None else None
    model, notes = verification_model(served)
    built = backends if model is served else build_like(backends, request, model, pools)
    try:
        targets = [(i.role, i.backend, built.instances[i.role]) for i in backends.plan.instances]
        if built.attn_backend is not built.instances.get(backends.plan.instances[0].role):
            targets.append((f"{backends.plan.mode.value}.wrapper", type(built.attn_backend).__name__,
                            built.attn_backend))
        out = []
        for role, name, b in targets:
            t0 = time.perf_counter()
            r = verify_backend(b, role=role, name=name, model=model, req_to_token_pool=pools["req_to_token_pool"],
                               kv_pool=pools["kv_pool"], torch_device=backends.torch_device,
                               dtype=model_dtype(request.args, served), seed=seed, decode_steps=decode_steps,
                               notes=notes, spec=spec, draft=request.is_draft_worker)
            out.append(msgspec.structs.replace(r, duration_ms=(time.perf_counter() - t0) * 1e3))
        return out
    finally:
        if built is not backends:
            for b in built.instances.values():
                b.close()

