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
``r(attention)``, ``r(o @ Wo)``. MLA: ``r(rms(h))``, ``r(x @ Wq)``, ``r(x @ Wdkv)``,
``r(rms(c_kv))``, ``r(rope(k_rope))``, ``r(rope(q_rope))``, ``r(o · W_UV)``, ``r(o @ Wo)`` —
the absorbed query ``q_nope · W_UK`` and the latent output are not rounded: the reference stays
un-absorbed so that it still checks the absorption.

Stored K/V (``stored_kv``): a recomputed K lands on a neighbouring step of the cache dtype wherever float64
and the stack's GEMM round differently (about one element in a thousand in bf16), and a query whose softmax
sits on such a key amplifies that one step (0.85 of a head's weight on one key gave 2.1e-2 at decode#129);
the number of such keys grows with the context. Attending over what the pool holds removes that, while
``kv_errs`` still checks that the pool holds what the stack computed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pipeline.runtime.model import EPS, AttentionStack, _rope_complex
from pipeline.runtime.reference import reference_attention, rel_err

__all__ = ["reference_forward_rounded"]


def _note(errs: Optional[list[float]], k: torch.Tensor, k_ref: torch.Tensor, v: Optional[torch.Tensor],
          v_ref: Optional[torch.Tensor]) -> None:
    """Append the worse of ``rel_err(k, k_ref)`` and ``rel_err(v, v_ref)`` to ``errs`` (when given)."""
    if errs is not None:
        errs.append(max(rel_err(k, k_ref), 0.0 if v is None else rel_err(v, v_ref)))


def reference_forward_rounded(stack: AttentionStack, hidden: torch.Tensor, kv_dtype: Optional[torch.dtype] = None,
                              stored_kv: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None,
                              kv_errs: Optional[list[float]] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One request's sequence ``hidden`` [L, hidden_size] (positions ``0..L-1``) through ``stack`` in float64,
    rounded like the stack; returns the output [L, hidden_size] and the aux states (float64, CPU).

    ``kv_dtype``: a narrower cache dtype to round K/V through; ``stored_kv``: per layer, the dequantized K/V the
    pool holds (MLA: the latent K), attended over instead; ``kv_errs``: gets ``max|stored - recomputed| /
    max|recomputed|`` per layer (module docstring). Raises only reference_attention's shape errors."""
    act = stack.dtype

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(act).to(torch.float64)

    def cached(t: torch.Tensor) -> torch.Tensor:
        t = r(t)
        return t if kv_dtype is None else t.to(kv_dtype).to(torch.float64)

    def rms(t: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + EPS)

    f = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    if getattr(stack, "_f64_weights", None) is None:  # shared with reference_forward: exact copies of `act` weights
        stack._f64_weights = [{k: f(t) for k, t in w.items()} for w in stack.weights]
    weights = stack._f64_weights
    h, aux, n = f(hidden), [], hidden.shape[0]
    pos, theta = torch.arange(n), stack.spec.rope_theta
    for idx, L in enumerate(stack.layers):
        if stack.aux_hidden_state_layers and L.layer_id in stack.aux_hidden_state_layers:
            aux.append(h)
        w = weights[idx]
        x = r(rms(h))
        if L.is_mla:
            m = stack.spec.mla
            q = r(x @ w["q"].T).reshape(n, L.num_heads, -1)
            lat = r(x @ w["dkv"].T)
            c = cached(rms(lat[:, : m.kv_lora_rank]))
            k_rope = cached(_rope_complex(lat[:, None, m.kv_lora_rank:], pos, theta))
            if stored_kv is not None:
                _note(kv_errs, stored_kv[idx][0], torch.cat([c[:, None], k_rope], -1), None, None)
                c, k_rope = stored_kv[idx][0][:, 0, : m.kv_lora_rank], stored_kv[idx][0][:, :, m.kv_lora_rank:]
            k_rope = k_rope.expand(n, L.num_heads, -1)
            q_rope = r(_rope_complex(q[..., m.qk_nope_head_dim:], pos, theta))
            qq = torch.cat([q[..., : m.qk_nope_head_dim], q_rope], -1)
            kk = torch.cat([torch.einsum("lc,hnc->lhn", c, w["uk"]), k_rope], dim=-1)
            vv = torch.einsum("lc,hvc->lhv", c, w["uv"])
        else:
            d, hkv = L.head_dim, L.num_kv_heads
            q, k, v = r(x @ w["qkv"].T).split([L.num_heads * d, hkv * d, hkv * d], dim=-1)
            qq = r(_rope_complex(q.reshape(n, L.num_heads, d), pos, theta))
            kk = cached(_rope_complex(k.reshape(n, hkv, d), pos, theta))
            vv = cached(v.reshape(n, hkv, d))
            if stored_kv is not None:
                _note(kv_errs, stored_kv[idx][0], kk, stored_kv[idx][1], vv)
                kk, vv = stored_kv[idx]
        o = reference_attention(qq, kk, vv, q_positions=pos, scale=L.scaling, window=L.sliding_window,
                                softcap=L.logit_softcap, sinks=None if L.sinks is None else f(L.sinks),
                                chunk=L.attention_chunk_size)
        h = h + r(r(o).reshape(n, -1) @ w["o"].T)
    return h, aux
