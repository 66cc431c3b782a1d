"""Steps through a ready runner, checked against the float64 dense reference of the stack (docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pipeline.backends.memory import dequantize_kv, layer_kv_scales, make_draft_batch, make_forward_batch, PageAllocator
from pipeline.core.contracts import ForwardMode
from pipeline.backends.speculative import SpecInfo
from pipeline.core.errors import BuildError
from pipeline.memory.pools import CHUNK_LENS, EXTEND_LENS
from pipeline.runtime.model import _rope_complex, AttentionStack, EPS
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.spec_batches import accept_path, next_branches, random_path, random_tree


MLA_ABSORBED = "absorbed"
MLA_UNABSORBED = "unabsorbed"
_MLA_PATHS = (MLA_UNABSORBED, MLA_ABSORBED)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_abs[t, h] = q_nope[t, h] @ W_UK[h]``: [T, H, qk_nope] x [H, qk_nope, kv_lora_rank] -> [T, H, kv_lora_rank],
    float64 (sglang's ``forward_absorb``)."""
    return torch.einsum("thn,hnc->thc", q_nope, w_uk)


def expand_latent_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``o[t, h] = W_UV[h] @ o_lat[t, h]``: o_lat [T, H, kv_lora_rank], W_UV [H, v_head_dim, kv_lora_rank] -> [T, H,
    v_head_dim], float64."""
    return torch.einsum("thc,hvc->thv", o_lat, w_uv)


def _note(errs: Optional[list[float]], k: torch.Tensor, k_ref: torch.Tensor, v: Optional[torch.Tensor],
          v_ref: Optional[torch.Tensor]) -> None:
    """Append the worse of ``rel_err(k, k_ref)`` and ``rel_err(v, v_ref)`` to ``errs`` (when given)."""
    if errs is not None:
        errs.append(max(rel_err(k, k_ref), 0.0 if v is None else rel_err(v, v_ref)))


def reference_forward_rounded(stack: AttentionStack, hidden: torch.Tensor, kv_dtype: Optional[torch.dtype] = None,
                              stored_kv: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None,
                              kv_errs: Optional[list[float]] = None, *, mla_path: str = MLA_UNABSORBED,
                              absorbed_rounding: bool = True, positions: Optional[torch.Tensor] = None,
                              mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One request's ``hidden`` [L, hidden_size] through ``stack`` in float64, rounded like the stack: (output, aux).

    ``positions`` [L] / ``mask`` [L, L] bool: a token tree (default ``0..L-1``, causal). ``kv_dtype``: round K/V through
    it; ``stored_kv``: the pool's dequantized K/V per layer to attend over; ``kv_errs``: receives the stored vs
    recomputed relative error per layer. MLA only: ``mla_path`` :data:`MLA_UNABSORBED` (default) or
    :data:`MLA_ABSORBED`; ``absorbed_rounding``: round ``q_abs`` and the latent output as the stack does. Raises
    BuildError (``reference_input_invalid``) for an unknown ``mla_path``.
    """
    if mla_path not in _MLA_PATHS:
        raise BuildError(f"reference_forward_rounded: mla_path={mla_path!r} is not allowed",
                         code="reference_input_invalid", flags=[("mla_path", mla_path)], allowed=list(_MLA_PATHS),
                         remedy=f"pass mla_path={MLA_ABSORBED!r} or {MLA_UNABSORBED!r}")
    act = stack.dtype

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(act).to(torch.float64)

    def cached(t: torch.Tensor) -> torch.Tensor:
        t = r(t)
        return t if kv_dtype is None else t.to(kv_dtype).to(torch.float64)

    f = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    if getattr(stack, "_f64_weights", None) is None:  # shared with reference_forward: exact copies of `act` weights
        stack._f64_weights = [{k: f(t) for k, t in w.items()} for w in stack.weights]
    weights = stack._f64_weights
    h, aux, n = f(hidden), [], hidden.shape[0]
    pos = torch.arange(n) if positions is None else positions.cpu()
    for idx, L in enumerate(stack.layers):
        if stack.aux_hidden_state_layers and L.layer_id in stack.aux_hidden_state_layers:
            aux.append(h)
        w = weights[idx]
        x = r(_rms(h))
        stored = None if stored_kv is None else stored_kv[idx]
        if L.is_mla:
            qq, kk, vv = _mla_qkv(stack, L, w, x, pos, r, cached, stored, kv_errs, mla_path, absorbed_rounding)
        else:
            qq, kk, vv = _mha_qkv(stack, L, w, x, pos, r, cached, stored, kv_errs)
        o = reference_attention(qq, kk, vv, q_positions=pos, scale=L.scaling, window=L.sliding_window,
                                softcap=L.logit_softcap, sinks=None if L.sinks is None else f(L.sinks),
                                chunk=L.attention_chunk_size, k_positions=None if positions is None else pos,
                                mask=mask)
        if L.is_mla and mla_path == MLA_ABSORBED:
            o = expand_latent_output(r(o) if absorbed_rounding else o, w["uv"])
        h = h + r(r(o).reshape(n, -1) @ w["o"].T)
    return h, aux


def _rms(t: torch.Tensor) -> torch.Tensor:
    """RMS norm without weights (the stack's): ``t / sqrt(mean(t^2) + EPS)`` over the last dim."""
    return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + EPS)


def _mla_qkv(stack: AttentionStack, L: Any, w: dict, x: torch.Tensor, pos: torch.Tensor, r: Any, cached: Any,
             stored: Any, kv_errs: Optional[list[float]], mla_path: str, absorbed_rounding: bool) -> tuple:
    """q, k, v (float64) of one MLA layer of :func:`reference_forward_rounded` on the normed input ``x`` [n, hidden]:
    absorbed (one latent head: k = [c, k_rope], v = c, q = [q_nope W_UK, q_rope]) or un-absorbed (K/V expanded per
    head through W_UK / W_UV); ``stored``: the pool's latent K of this layer, attended over instead."""
    m, n, theta = stack.spec.mla, x.shape[0], stack.spec.rope_theta
    q = r(x @ w["q"].T).reshape(n, L.num_heads, -1)
    lat = r(x @ w["dkv"].T)
    c = cached(_rms(lat[:, : m.kv_lora_rank]))
    k_rope = cached(_rope_complex(lat[:, None, m.kv_lora_rank:], pos, theta))
    if stored is not None:
        _note(kv_errs, stored[0], torch.cat([c[:, None], k_rope], -1), None, None)
        c, k_rope = stored[0][:, 0, : m.kv_lora_rank], stored[0][:, :, m.kv_lora_rank:]
    q_rope = r(_rope_complex(q[..., m.qk_nope_head_dim:], pos, theta))
    if mla_path == MLA_ABSORBED:
        q_abs = absorb_query(q[..., : m.qk_nope_head_dim], w["uk"])
        qq = torch.cat([r(q_abs) if absorbed_rounding else q_abs, q_rope], -1)
        return qq, torch.cat([c[:, None], k_rope], dim=-1), c[:, None]
    k_rope = k_rope.expand(n, L.num_heads, -1)
    qq = torch.cat([q[..., : m.qk_nope_head_dim], q_rope], -1)
    kk = torch.cat([torch.einsum("lc,hnc->lhn", c, w["uk"]), k_rope], dim=-1)
    return qq, kk, torch.einsum("lc,hvc->lhv", c, w["uv"])


def _mha_qkv(stack: AttentionStack, L: Any, w: dict, x: torch.Tensor, pos: torch.Tensor, r: Any, cached: Any,
             stored: Any, kv_errs: Optional[list[float]]) -> tuple:
    """q, k, v (float64) of one MHA/GQA layer of :func:`reference_forward_rounded`; ``stored``: the pool's (K, V)."""
    n, d, hkv, theta = x.shape[0], L.head_dim, L.num_kv_heads, stack.spec.rope_theta
    q, k, v = r(x @ w["qkv"].T).split([L.num_heads * d, hkv * d, hkv * d], dim=-1)
    qq = r(_rope_complex(q.reshape(n, L.num_heads, d), pos, theta))
    kk = cached(_rope_complex(k.reshape(n, hkv, d), pos, theta))
    vv = cached(v.reshape(n, hkv, d))
    if stored is not None:
        _note(kv_errs, stored[0], kk, stored[1], vv)
        kk, vv = stored
    return qq, kk, vv


REF_ROUNDED = "rounded"
REF_MLA_ABSORBED = "mla-absorbed"
REF_MLA_UNABSORBED = "mla-unabsorbed"
# What two float64 evaluations in different association orders may differ by, relative to max|Δ| (~1e-13; a wrong
# absorption moves Δ by >= 5e-2, tests/test_verify_mla_steps.py).
F64_SLACK = 1e-9


@dataclass(frozen=True)
class StepCheck:
    """One step's outcome: label, mode, batch size, replayed, worst error, tolerance and ``reference``; with per-request
    tolerances, the request with the largest ``err / tol``."""

    step: str
    mode: str
    batch_size: int
    graph: bool
    max_rel_err: float
    tol: float
    reference: str = REF_ROUNDED

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.tol


def _tol(dtype: torch.dtype) -> float:
    """The compute dtype's tolerance (as :data:`pipeline.runtime.verify.TOLERANCE`): the reference reads the K/V the
    pool holds, so the KV-cache dtype (bf16, fp16, fp8) is part of the input, not an error, and loosens nothing."""
    return 1e-4 if dtype is torch.float32 else 1e-2


def absorption_tolerance(tol: float, d_rounded: torch.Tensor, d_exact: torch.Tensor,
                         d_unabsorbed: torch.Tensor) -> float:
    """The absorption check's tolerance for one request in one step.

    Arguments: the stack's residual update ``Δ`` [T, hidden_size] float64 per reference — ``d_rounded`` (absorbed, with
    the two absorbed-only roundings), ``d_exact`` (absorbed, without), ``d_unabsorbed`` — and the kernel check's
    ``tol``. Returns ``tol · max|d_rounded| / M + max|d_rounded − d_exact| / M + F64_SLACK``, ``M = max|d_unabsorbed|``
    (1 when 0).

    Derivation: ``|out − un| ≤ |out − ar| + |ar − ax| + |ax − un|``: the kernel check bounds the first, the second is
    this batch's float64 effect of the roundings, the third is 0 exactly (absorption identity), so a wrong absorption
    leaves it large and fails. ``|ar − un|`` as allowance would contain ``|ax − un|`` and could not fail; an analytic
    roundoff bound would allow more than the roundings do.
    """
    m = float(d_unabsorbed.abs().max()) if d_unabsorbed.numel() else 0.0
    m = m if m > 0 else 1.0  # rel_err's convention: an all-zero reference gives the absolute error
    return (tol * float(d_rounded.abs().max()) + float((d_rounded - d_exact).abs().max())) / m + F64_SLACK


class _Tokens:
    """One request's tokens as a tree — each token's parent (the previous token of a sequence, a draft tree's parent,
    a draft branch's previous token) —, each one's input and the K/V the pool held for it right after its step
    (before an acceptance moves KV or frees a tree's rejected slots). ``last``: the token the next ones follow."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []
        self.parent: list[int] = []
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per token, per stack layer
        self.last = -1

    def add(self, x: torch.Tensor, parents: list[int], kv: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[int]:
        """Append tokens (``parents`` index this request's tokens; -1: none); returns their indices."""
        first = len(self.parent)
        self.x += list(x)
        self.parent += parents
        self.kv += kv
        return list(range(first, first + len(parents)))

    def tree(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [L]: each token's depth, mask [L, L]: ancestors and itself)."""
        n = len(self.parent)
        mask = torch.zeros((n, n), dtype=torch.bool)
        depth = torch.zeros(n, dtype=torch.int64)
        for i, p in enumerate(self.parent):
            mask[i, i] = True
            if p >= 0:
                mask[i] |= mask[p]
                depth[i] = depth[p] + 1
        return depth, mask


def _step_parents(tok: _Tokens, mode: ForwardMode, n: int, tree: Optional[list[int]], branch_tokens: Any,
                  b: int) -> list[int]:
    """Parents (request-token indices) of one request's new tokens in a step."""
    nxt = len(tok.parent)
    if mode is ForwardMode.TARGET_VERIFY:
        return [tok.last if p < 0 else nxt + p for p in tree]
    if mode is ForwardMode.DRAFT_DECODE:
        prev, parent = branch_tokens
        return [tok.last if prev is None else prev[b][int(parent[b, j])] for j in range(n)]
    return [tok.last] + list(range(nxt, nxt + n - 1))


def _pool_kv(stack: Any, kv: Any, slots: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per token at ``slots``, per stack layer: the dequantized K/V the pool holds (float64, CPU)."""
    per_layer = []
    for L in stack.layers:
        ks, vs = layer_kv_scales(kv, L.layer_id)
        per_layer.append((dequantize_kv(kv.get_key_buffer(L.layer_id)[slots], ks, torch.float64).cpu(),
                          dequantize_kv(kv.get_value_buffer(L.layer_id)[slots], vs, torch.float64).cpu()))
    return [[(k[i: i + 1], v[i: i + 1]) for k, v in per_layer] for i in range(slots.shape[0])]


def _steps(b: int, decode_steps: int, spec: Any, draft: bool) -> list[tuple[str, ForwardMode, list[int]]]:
    """extend, chunked extend, decodes; a target worker verifies trees after the first decode, a draft worker
    draft-extends and runs draft-decode steps."""
    ext = ForwardMode.DRAFT_EXTEND if spec is not None and draft else ForwardMode.EXTEND
    steps = [("extend", ForwardMode.EXTEND, list(EXTEND_LENS[:b])),
             ("draft-extend" if draft and spec is not None else "chunked-extend", ext, list(CHUNK_LENS[:b]))]
    decodes = [(f"decode#{i}", ForwardMode.DECODE, [1] * b) for i in range(decode_steps)]
    if spec is None:
        return steps + decodes
    if draft:
        return steps + [(f"draft-decode#{i}", ForwardMode.DRAFT_DECODE, [spec.topk] * b)
                         for i in range(spec.num_steps)] + decodes
    # every tree of num_draft_tokens, as a captured target-verify graph holds them (the instances' check mixes sizes)
    return steps + decodes[:1] + [("target-verify", ForwardMode.TARGET_VERIFY, [spec.num_draft_tokens] * b)] \
        + decodes[1:]


def verify_model_steps(runner: Any, *, decode_steps: int = 3, seed: int = 0, spec: Any = None,
                       draft: bool = False) -> list[StepCheck]:
    """Run extend, chunked extend and decode steps through a ready ``runner`` (docs/internals.md).

    Uses ``req_to_token`` rows ``0..min(4, max_reqs)-1`` and frees them. Tolerance 1e-4 (float32) / 1e-2 (bf16/fp16)
    against a reference rounded like the stack over the K/V the pool holds; a ``kv-cache-write`` check is added when the
    pool's K/V stray by more than a step of the coarser dtype. MLA stacks get ``mla-absorbed`` then ``mla-unabsorbed``
    (:func:`absorption_tolerance`). ``spec`` adds speculative steps (target verify of random trees, or with ``draft``
    draft extend and decode of ``spec.topk`` branches); each request's reference is computed once over its tree. Raises
    BuildError when the pools are too small.
    """
    stack, pools = runner.stack, runner.pools
    req_pool, kv = pools["req_to_token_pool"], pools["kv_pool"]
    gen = torch.Generator().manual_seed(seed)
    b = min(len(EXTEND_LENS), req_pool.max_reqs)
    rows = list(range(b))
    alloc = PageAllocator(req_pool, kv.size, kv.page_size, seed=seed)
    toks = {r: _Tokens() for r in rows}
    outs: list[tuple[str, ForwardMode, bool, list[tuple[list[int], torch.Tensor, torch.Tensor]]]] = []
    branches: list[Any] = [None, None]  # the previous draft step's slots and its tokens per request
    try:
        for label, mode, new in _steps(b, decode_steps, spec, draft):
            graphed, per_req = _run_step(runner, mode, rows, new, alloc, toks, spec, branches, gen)
            outs.append((label, mode, graphed, per_req))
    finally:
        for r in rows:
            alloc.free(r)
            req_pool.req_to_token[r].zero_()
    return _compare(stack, kv.dtype, rows, toks, outs, b)


def _run_step(runner: Any, mode: ForwardMode, rows: list[int], new: list[int], alloc: PageAllocator,
              toks: dict[int, _Tokens], spec: Any, branches: list[Any], gen: torch.Generator) -> tuple[bool, list]:
    """One step through the runner with random inputs; returns (replayed, per request (token indices, input, output)).
    After target verify each request keeps an accepted path (KV moved)."""
    stack, kv = runner.stack, runner.pools["kv_pool"]
    trees = [random_tree(n, spec.topk, spec.num_steps, gen) for n in new] \
        if mode is ForwardMode.TARGET_VERIFY else None
    if mode is ForwardMode.DRAFT_DECODE:
        slots, parent = next_branches(branches[0], rows, spec.topk, alloc, gen)
        fb = make_draft_batch(rows, slots, alloc, kv)
    else:
        info = None if trees is None else SpecInfo(topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
                                                   parents=trees)
        fb = make_forward_batch(mode, rows, new, alloc, kv, spec_info=info)
    x = torch.randn(fb.num_tokens, stack.hidden, generator=gen).to(kv.device, stack.dtype)
    out, _aux, graphed = runner.forward(x, fb)
    stored = _pool_kv(stack, kv, fb.out_cache_loc)
    per_req, start, made = [], 0, []
    for i, (r, n) in enumerate(zip(rows, new)):
        par = _step_parents(toks[r], mode, n, None if trees is None else trees[i],
                            (branches[1], parent) if mode is ForwardMode.DRAFT_DECODE else None, i)
        idx = toks[r].add(x[start:start + n].double().cpu(), par, stored[start:start + n])
        made.append(idx)
        per_req.append((idx, x[start:start + n].double().cpu(), out[start:start + n].double().cpu()))
        if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE):
            toks[r].last = idx[-1]
        start += n
    if mode is ForwardMode.DRAFT_DECODE:
        branches[:] = [slots, made]
    if mode is ForwardMode.TARGET_VERIFY:
        for r, tree, idx, prefix in zip(rows, trees, made, fb.extend_prefix_lens_cpu):
            path = random_path(tree, gen)
            accept_path(alloc, kv, r, prefix, path)
            toks[r].last = idx[path[-1]]
    return graphed, per_req


def _compare(stack: Any, kv_dtype: torch.dtype, rows: list[int], toks: dict[int, _Tokens], outs: list[Any],
             b: int) -> list[StepCheck]:
    """Worst per-request error per step against one reference per request over its tree (three for MLA stacks)."""
    kv_errs: list[float] = []
    tol = _tol(stack.dtype)
    mla = any(L.is_mla for L in stack.layers)
    first = MLA_ABSORBED if mla else MLA_UNABSORBED

    def ref(r: int, **kw: Any) -> torch.Tensor:
        t = toks[r]
        pos, mask = t.tree()
        stored = [(torch.cat([kv[i][0] for kv in t.kv]), torch.cat([kv[i][1] for kv in t.kv]))
                  for i in range(len(stack.layers))]
        return reference_forward_rounded(stack, torch.stack(t.x), stored_kv=stored, positions=pos, mask=mask,
                                         **kw)[0]

    refs = {r: ref(r, kv_errs=kv_errs, mla_path=first) for r in rows}
    if mla:
        exact = {r: ref(r, mla_path=MLA_ABSORBED, absorbed_rounding=False) for r in rows}
        unabs = {r: ref(r, mla_path=MLA_UNABSORBED) for r in rows}
    checks = []
    for label, mode, graphed, per_req in outs:
        worst, absorb = 0.0, None  # absorb: (err, tol) of the request with the largest err / tol
        for r, (at, xin, o) in zip(rows, per_req):
            err = rel_err(o - xin, refs[r][at] - xin)
            worst = max(worst, err) if err == err else float("inf")
            if mla:
                e_b = rel_err(o - xin, unabs[r][at] - xin)
                e_b = e_b if e_b == e_b else float("inf")
                t_b = absorption_tolerance(tol, refs[r][at] - xin, exact[r][at] - xin, unabs[r][at] - xin)
                if absorb is None or e_b / t_b > absorb[0] / absorb[1]:
                    absorb = (e_b, t_b)
        checks.append(StepCheck(step=label, mode=mode.value, batch_size=b, graph=graphed, max_rel_err=worst,
                                tol=tol, reference=REF_MLA_ABSORBED if mla else REF_ROUNDED))
        if absorb is not None:
            checks.append(StepCheck(step=label, mode=mode.value, batch_size=b, graph=graphed, max_rel_err=absorb[0],
                                    tol=absorb[1], reference=REF_MLA_UNABSORBED))
    # the pool must hold what the stack computed, within one step of the coarser dtype (else: a wrong write)
    bound = max(torch.finfo(kv_dtype).eps, torch.finfo(stack.dtype).eps, tol)
    if kv_errs and max(kv_errs) > bound:
        checks.append(StepCheck(step="kv-cache-write", mode="write", batch_size=b, graph=False,
                                max_rel_err=max(kv_errs), tol=bound,
                                reference=REF_MLA_ABSORBED if mla else REF_ROUNDED))
    return checks

