"""The float64 reference of an :class:`~pipeline.runtime.model.AttentionStack` that rounds where the stack rounds.

Why: :func:`pipeline.runtime.model.reference_forward` is exact float64 from the input on. A bf16/fp16
stack rounds its activations at every layer (the normed input, the projections, RoPE, the
attention output, the output projection), and those roundings feed the next layer and every later
token through the KV cache. Compared against exact float64, the stack's error therefore grows with
depth and with the number of decode steps although no kernel is wrong (a new-user trial saw
``decode#28`` at 1.11e-2 and ``decode#99`` at 2.68e-2 with torch_native in bf16).

:func:`reference_forward_rounded` computes the same float64 math but rounds to the stack's dtype at
the points where :meth:`AttentionStack.forward` materialises a tensor in that dtype. Both sides then
see the same rounded inputs at each layer and step, so what is left of the difference is the
attention kernel's own error (plus a one-ulp flip where float32 and float64 land on opposite
sides of a rounding boundary), and the fixed tolerance of
:mod:`pipeline.runtime.model_steps` holds at any step count — while a backend that computes the wrong
attention still moves the result by far more than the tolerance.

This is the usual way kernel tests in vLLM and sglang judge a bf16 attention kernel: against a
reference fed the kernel's *own* bf16 q/k/v, not against an end-to-end float64 model.

Rounding points mirrored (``r`` = round to the stack dtype):
MHA/GQA: ``r(rms(h))``, ``r(x @ Wqkv)``, ``r(rope(q))``, ``r(rope(k))``, the KV cache dtype,
``r(attention)``, ``r(o @ Wo)``. MLA, both paths: ``r(rms(h))``, ``r(x @ Wq)``, ``r(x @ Wdkv)``,
``r(rms(c_kv))``, ``r(rope(k_rope))``, ``r(rope(q_rope))``, ``r(o · W_UV)``, ``r(o @ Wo)``.

MLA has two paths (``mla_path``), because one reference cannot both round where the stack rounds and check the
absorption (:meth:`AttentionStack._qkv` / :meth:`AttentionStack.forward` are the stack's side):

- ``"absorbed"`` (:data:`MLA_ABSORBED`) follows the stack's absorbed form: ``q_abs = q_nope · W_UK`` per head
  ([T, H, kv_lora_rank]), attention of ``[q_abs, q_rope]`` over the one latent head ``[c_kv, k_rope]`` the pool
  holds, the latent output ``o_lat`` [T, H, kv_lora_rank] times ``W_UV`` per head. With
  ``absorbed_rounding=True`` it also rounds the two tensors the stack materialises in its dtype on that path and the
  un-absorbed form never has: ``r(q_abs)`` (the stack's bf16 einsum) and ``r(o_lat)`` (the backend's output dtype).
  This is the *kernel check*'s reference: the same inputs as the backend at every layer and step.
- ``"unabsorbed"`` (:data:`MLA_UNABSORBED`) expands per-head ``k_nope = W_UK c`` and ``v = W_UV c`` from the latent
  cache and attends with the plain query: the absorption identity ``(q_nope W_UK) · c = q_nope · (W_UK c)`` is not
  used, so comparing the stack with it checks the absorption (the *absorption check*,
  :mod:`pipeline.runtime.model_steps` derives its tolerance).

The float64 absorption math of the reference is in :func:`absorb_query` and :func:`expand_latent_output`, written
apart from the stack's.

Stored K/V (``stored_kv``): a recomputed K lands on a neighbouring step of the cache dtype wherever float64
and the stack's GEMM round differently (about one element in a thousand in bf16), and a query whose softmax
sits on such a key amplifies that one step (0.85 of a head's weight on one key gave 2.1e-2 at decode#129);
the number of such keys grows with the context. Attending over what the pool holds removes that, while
``kv_errs`` still checks that the pool holds what the stack computed.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pipeline.core.errors import BuildError
from pipeline.runtime.model import EPS, AttentionStack, _rope_complex
from pipeline.runtime.reference import reference_attention, rel_err

__all__ = ["reference_forward_rounded", "absorb_query", "expand_latent_output", "MLA_ABSORBED", "MLA_UNABSORBED"]

MLA_ABSORBED = "absorbed"
MLA_UNABSORBED = "unabsorbed"
_MLA_PATHS = (MLA_UNABSORBED, MLA_ABSORBED)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed query ``q_abs[t, h] = q_nope[t, h] @ W_UK[h]``: q_nope [T, H, qk_nope_head_dim] and W_UK
    [H, qk_nope_head_dim, kv_lora_rank] (the stack's ``uk``), both float64; returns [T, H, kv_lora_rank] float64.

    So ``q_abs[t, h] · c[j] == q_nope[t, h] · (W_UK[h] c[j])``, the un-absorbed score's no-rope part (DeepSeek-V2
    paper, section 2.1.2; sglang's ``forward_absorb``)."""
    return torch.einsum("thn,hnc->thc", q_nope, w_uk)


def expand_latent_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The per-head output ``o[t, h] = W_UV[h] @ o_lat[t, h]``: o_lat [T, H, kv_lora_rank] (attention over the latent
    values ``c``) and W_UV [H, v_head_dim, kv_lora_rank] (the stack's ``uv``), both float64; returns
    [T, H, v_head_dim] float64 — equal to attention over the expanded values ``W_UV[h] c[j]`` because the softmax
    weights sum linearly."""
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
    """One request's sequence ``hidden`` [L, hidden_size] (positions ``0..L-1``) through ``stack`` in float64,
    rounded like the stack; returns the output [L, hidden_size] and the aux states (float64, CPU).

    ``positions`` [L] and ``mask`` [L, L] bool: a request whose tokens form a tree (speculative decoding: draft
    trees verified, draft branches) — token ``i`` at its depth, seeing the tokens ``mask[i]`` marks (its ancestors and
    itself), for RoPE and for attention alike; default ``0..L-1`` and causal.

    ``kv_dtype``: a narrower cache dtype to round K/V through; ``stored_kv``: per layer, the dequantized K/V the
    pool holds (MLA: the latent K [L, 1, kv_lora_rank + qk_rope_head_dim]), attended over instead; ``kv_errs``: gets
    ``max|stored - recomputed| / max|recomputed|`` per layer (module docstring). ``mla_path`` (MLA layers only):
    :data:`MLA_UNABSORBED` (default, as before) or :data:`MLA_ABSORBED`; ``absorbed_rounding``: on the absorbed
    path, round ``q_abs`` and the latent output to the stack dtype as the stack does (False: keep them float64,
    which :mod:`pipeline.runtime.model_steps` uses to measure what those two roundings change). Non-MLA layers
    ignore both. Raises BuildError (``reference_input_invalid``) for an unknown ``mla_path``, else only
    reference_attention's shape errors."""
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
