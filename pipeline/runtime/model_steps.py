"""Steps through a ready runner, checked against the float64 dense reference of the stack.

:func:`verify_model_steps` drives the runner's attention stack the way an engine does: an extend of
new requests, an extend of more tokens on their cached prefixes (chunked prefill), then
``decode_steps`` decode steps — each decode replayed from a CUDA graph when the runner captured
one, else eager. Inputs are random hidden states (seeded); pages are handed out scrambled.
After every step each request's outputs are compared with
:func:`pipeline.runtime.stack_reference.reference_forward_rounded` over its whole history: float64 math that
rounds to the stack's dtype where the stack does, so the stack's own bf16/fp16 rounding — which
compounds through layers and decode steps — is not blamed on the backend, and the tolerance holds
at any step count. Metric: ``max|Δout − Δref| / max|Δref|`` per request, where ``Δ`` is the
stack's update to the residual stream (output minus input), so the input's own magnitude cannot
hide an attention error; the worst request is reported per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.core.contracts import ForwardMode
from pipeline.backends.memory import PageAllocator, dequantize_kv, layer_kv_scales, make_forward_batch
from pipeline.runtime.stack_reference import reference_forward_rounded
from pipeline.runtime.reference import rel_err

__all__ = ["StepCheck", "verify_model_steps", "slots_needed", "EXTEND_LENS", "CHUNK_LENS"]

EXTEND_LENS = (5, 9, 2, 7)
CHUNK_LENS = (3, 1, 4, 2)


@dataclass(frozen=True)
class StepCheck:
    """One step's outcome: label, mode, batch size, whether replayed from a graph, worst error, tolerance."""

    step: str
    mode: str
    batch_size: int
    graph: bool
    max_rel_err: float
    tol: float

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.tol


def _tol(dtype: torch.dtype) -> float:
    """The compute dtype's tolerance (as :data:`pipeline.runtime.verify.TOLERANCE`): the reference reads the K/V the
    pool holds, so the KV-cache dtype (bf16, fp16, fp8) is part of the input, not an error, and loosens nothing."""
    return 1e-4 if dtype is torch.float32 else 1e-2


def slots_needed(max_reqs: int, page_size: int, decode_steps: int = 3) -> int:
    """Token slots :func:`verify_model_steps` allocates (whole pages per request, plus the reserved page 0)."""
    b = min(len(EXTEND_LENS), max_reqs)
    return page_size * (1 + sum(-(-(e + c + decode_steps) // page_size) for e, c in zip(EXTEND_LENS[:b], CHUNK_LENS[:b])))


def context_needed(max_reqs: int, decode_steps: int = 3) -> int:
    """Tokens the longest request of :func:`verify_model_steps` reaches (the ``max_context_len`` it needs)."""
    b = min(len(EXTEND_LENS), max_reqs)
    return max(x + y for x, y in zip(EXTEND_LENS[:b], CHUNK_LENS[:b])) + decode_steps


def verify_model_steps(runner: Any, *, decode_steps: int = 3, seed: int = 0) -> list[StepCheck]:
    """Run extend, chunked extend and decode steps through a ready ``runner``; see the module docstring.

    Uses ``req_to_token`` rows ``0..B-1`` (B = min(4, max_reqs)) and frees them afterwards.
    Tolerance: 1e-4 for float32 stacks, 1e-2 for bf16/fp16 (the residual stream is float32),
    against a reference rounded like the stack (so the tolerance bounds the attention kernel's own
    error, independent of ``decode_steps`` and depth);
    every layer of the reference attends over the K/V the pool holds (dequantized; any KV dtype), so the
    tolerance does not depend on the KV dtype or the context length; a ``kv-cache-write`` check is appended
    when the pool's K/V differ from the reference's recomputation by more than a step of the coarser dtype.
    The stack is causal, so each request's reference is computed once, over its whole history,
    after the last step. Raises BuildError when the pools are too small.
    """
    stack, pools = runner.stack, runner.pools
    req_pool, kv = pools["req_to_token_pool"], pools["kv_pool"]
    gen = torch.Generator().manual_seed(seed)
    b = min(len(EXTEND_LENS), req_pool.max_reqs)
    rows = list(range(b))
    alloc = PageAllocator(req_pool, kv.size, kv.page_size, seed=seed)
    hist: dict[int, list[torch.Tensor]] = {r: [] for r in rows}
    steps = [("extend", ForwardMode.EXTEND, list(EXTEND_LENS[:b])), ("chunked-extend", ForwardMode.EXTEND,
                                                                       list(CHUNK_LENS[:b]))]
    steps += [(f"decode#{i}", ForwardMode.DECODE, [1] * b) for i in range(decode_steps)]
    outs: list[tuple[str, ForwardMode, list[int], bool, list[tuple[torch.Tensor, torch.Tensor]]]] = []
    try:
        for label, mode, new in steps:
            fb = make_forward_batch(mode, rows, new, alloc, kv)
            x = torch.randn(sum(new), stack.hidden, generator=gen).to(kv.device, stack.dtype)
            out, _aux, graphed = runner.forward(x, fb)
            per_req, start = [], 0
            for r, n in zip(rows, new):
                hist[r].append(x[start:start + n].cpu())
                per_req.append((x[start:start + n].double().cpu(), out[start:start + n].double().cpu()))
                start += n
            outs.append((label, mode, new, graphed, per_req))
        stored = {r: _stored_kv(stack, kv, req_pool, r, sum(x.shape[0] for x in hist[r])) for r in rows}
    finally:
        for r in rows:
            alloc.free(r)
            req_pool.req_to_token[r].zero_()
    return _compare(stack, kv.dtype, rows, hist, stored, outs, b)


def _stored_kv(stack: Any, kv: Any, req_pool: Any, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stack layer, the K/V the pool holds for request ``row`` (positions ``0..length-1``): dequantized, f64, CPU."""
    slots = req_pool.req_to_token[row, :length].to(torch.int64)
    out = []
    for L in stack.layers:
        ks, vs = layer_kv_scales(kv, L.layer_id)
        out.append((dequantize_kv(kv.get_key_buffer(L.layer_id)[slots], ks, torch.float64).cpu(),
                    dequantize_kv(kv.get_value_buffer(L.layer_id)[slots], vs, torch.float64).cpu()))
    return out


def _compare(stack: Any, kv_dtype: torch.dtype, rows: list[int], hist: dict[int, list[torch.Tensor]],
             stored: dict[int, Any], outs: list[Any], b: int) -> list[StepCheck]:
    """One reference per request over its whole history and stored K/V; worst per-request error per step."""
    kv_errs: list[float] = []
    refs = {r: reference_forward_rounded(stack, torch.cat(hist[r]), stored_kv=stored[r], kv_errs=kv_errs)[0]
            for r in rows}
    checks, done = [], {r: 0 for r in rows}
    for label, mode, new, graphed, per_req in outs:
        worst = 0.0
        for r, n, (xin, o) in zip(rows, new, per_req):
            ref = refs[r][done[r]:done[r] + n]
            done[r] += n
            err = rel_err(o - xin, ref - xin)
            worst = max(worst, err) if err == err else float("inf")
        checks.append(StepCheck(step=label, mode=mode.value, batch_size=b, graph=graphed, max_rel_err=worst,
                                tol=_tol(stack.dtype)))
    # the pool must hold what the stack computed, within one step of the coarser dtype (else: a wrong write)
    bound = max(torch.finfo(kv_dtype).eps, torch.finfo(stack.dtype).eps, _tol(stack.dtype))
    if kv_errs and max(kv_errs) > bound:
        checks.append(StepCheck(step="kv-cache-write", mode="write", batch_size=b, graph=False,
                                max_rel_err=max(kv_errs), tol=bound))
    return checks
