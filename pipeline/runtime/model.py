"""A real attention stack built from a Hugging Face config, run through a built attention backend (docs/internals.md).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch
from pipeline.core.contracts import LayerKind, ModelSpec
from pipeline.core.errors import ConfigError
from pipeline.core.spec import truncate_spec
from pipeline.runtime.reference import reference_attention

__all__ = ["AttentionStack", "truncate_spec", "reference_forward", "rope_neox"]
EPS = 1e-6


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotary embedding of x [T, H, d] (d even) at positions [T]; computed in float32, returns x's dtype."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = positions.to(torch.float32).view(-1, 1, 1) * inv.view(1, 1, -1)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class AttentionStack:
    """The first ``num_layers`` attention layers of ``spec`` (dims from ``spec.layer_kinds()``), random weights
    (``seed``).

    ``self.num_layers``: hidden layers spanned. ``layers[i]``: the i-th :class:`AttentionLayer`; ``weights[i]``: MHA
    ``qkv`` [H·D + 2·Hkv·D, hidden], ``o`` [hidden, H·Dv]; MLA ``q`` [H·(nope+rope), hidden], ``dkv`` [kv_lora+rope,
    hidden], ``uk`` [H, nope, kv_lora], ``uv`` [H, v_head, kv_lora], ``o`` [hidden, H·v_head]. Raises ConfigError when
    qk and v head dims differ without MLA.
    """

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                 num_layers: Optional[int] = None) -> None:
        self.spec = truncate_spec(spec, num_layers)
        self.num_layers = self.spec.num_hidden_layers
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed
        self.hidden = spec.hidden_size
        self.kind_of: dict[int, LayerKind] = {lid: kind for kind in self.spec.layer_kinds() for lid in kind.layer_ids}
        gen = torch.Generator().manual_seed(seed)
        self.layers: list[AttentionLayer] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        for lid, kind in sorted(self.kind_of.items()):
            if not kind.is_mla and kind.head_dim_qk != kind.head_dim_v:
                raise ConfigError("qk and v head dims differ on a non-MLA layer", code="model_config_invalid",
                                  flags=[("head_dim", kind.head_dim_qk), ("v_head_dim", kind.head_dim_v)],
                                  remedy="use a config whose head_dim equals v_head_dim")
            self.weights.append(self._weights(kind, gen))
            sinks = (torch.randn(kind.num_heads, generator=gen) + 1.0).to(self.device) if kind.has_sinks else None
            self.layers.append(AttentionLayer(
                layer_id=lid, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads, head_dim=kind.head_dim_qk,
                v_head_dim=kind.head_dim_v, scaling=kind.scaling, sliding_window=kind.sliding_window,
                logit_softcap=kind.logit_softcap, sinks=sinks, is_mla=kind.is_mla,
                attention_chunk_size=kind.attention_chunk_size))
        self.aux_hidden_state_layers: Optional[list[int]] = None
        self._f64_weights: Optional[list[dict[str, torch.Tensor]]] = None  # reference_forward's cache

    def _rand(self, gen: torch.Generator, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(self.device, self.dtype)

    def _weights(self, kind: LayerKind, gen: torch.Generator) -> dict[str, torch.Tensor]:
        h, hid = kind.num_heads, self.hidden
        if kind.is_mla:
            m = self.spec.mla
            return {"q": self._rand(gen, h * (m.qk_nope_head_dim + m.qk_rope_head_dim), hid),
                    "dkv": self._rand(gen, m.kv_lora_rank + m.qk_rope_head_dim, hid),
                    "uk": self._rand(gen, h, m.qk_nope_head_dim, m.kv_lora_rank),
                    "uv": self._rand(gen, h, m.v_head_dim, m.kv_lora_rank),
                    "o": self._rand(gen, hid, h * m.v_head_dim)}
        d, hkv = kind.head_dim_qk, kind.num_kv_heads
        qkv = self._rand(gen, (h + 2 * hkv) * d, hid)
        gain = 1.0 / (kind.scaling * math.sqrt(d))
        if gain < 1.0:  # a scale above 1/sqrt(d) (Gemma-4: 1.0, its q / k RMS-normed): logits kept at unit size,
            qkv[: h * d] *= gain  # as those norms keep the model's, not a one-hot softmax no dtype can resolve
        return {"qkv": qkv, "o": self._rand(gen, hid, h * d)}

    def param_bytes(self) -> int:
        """Bytes held by the weights (sinks included)."""
        ts = [t for w in self.weights for t in w.values()] + [L.sinks for L in self.layers if L.sinks is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def set_aux_hidden_state_layers(self, layer_ids: Sequence[int]) -> None:
        """EAGLE3-style capture: :meth:`forward` also returns the residual stream entering these layers (set before
        graph capture). Raises ConfigError (``invalid_value``) for ids that are not built attention layers."""
        built = [L.layer_id for L in self.layers]
        bad = [i for i in layer_ids if i not in built]
        if bad:
            allowed = f"0..{self.num_layers - 1}" if len(built) == self.num_layers else ", ".join(map(str, built))
            ids = ", ".join(map(str, bad))
            raise ConfigError(f"aux hidden-state layer ids {ids} are not attention layers the stack builds",
                              code="invalid_value", flags=[("aux_hidden_state_layers", list(layer_ids))],
                              allowed=[allowed], remedy="pick layers the stack builds")
        self.aux_hidden_state_layers = list(layer_ids)

    def _qkv(self, idx: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        L, w, theta = self.layers[idx], self.weights[idx], self.spec.rope_theta
        t = x.shape[0]
        if not L.is_mla:
            q, k, v = (x @ w["qkv"].T).split([L.num_heads * L.head_dim, L.num_kv_heads * L.head_dim,
                                               L.num_kv_heads * L.head_dim], dim=-1)
            q = rope_neox(q.reshape(t, L.num_heads, L.head_dim), pos, theta)
            k = rope_neox(k.reshape(t, L.num_kv_heads, L.head_dim), pos, theta)
            return q, k, v.reshape(t, L.num_kv_heads, L.v_head_dim)
        m = self.spec.mla
        q = (x @ w["q"].T).reshape(t, L.num_heads, -1)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, w["uk"])
        lat = x @ w["dkv"].T
        c = _rms(lat[:, : m.kv_lora_rank])
        k_rope = rope_neox(lat[:, None, m.kv_lora_rank:], pos, theta)
        q = torch.cat([q_abs, rope_neox(q_rope, pos, theta)], dim=-1)
        return q, torch.cat([c[:, None], k_rope], dim=-1), c[:, None].contiguous()

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch,
                backend: AttentionBackend) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every layer on ``hidden`` [T, hidden_size] (model dtype); the backend writes new K/V. Returns the float32
        residual stream [T, hidden_size] and the aux hidden states (one float32 [T, hidden_size] per aux layer; [] if
        none)."""
        pos, h, aux = forward_batch.positions, hidden.float(), []
        for idx, L in enumerate(self.layers):
            if self.aux_hidden_state_layers and L.layer_id in self.aux_hidden_state_layers:
                aux.append(h)
            q, k, v = self._qkv(idx, _rms(h).to(self.dtype), pos)
            o = backend.forward(q, k, v, L, forward_batch, save_kv_cache=True)
            o = o.reshape(h.shape[0], L.num_heads, L.v_head_dim)
            if L.is_mla:
                o = torch.einsum("thc,hvc->thv", o, self.weights[idx]["uv"])
            h = h + (o.reshape(h.shape[0], -1) @ self.weights[idx]["o"].T).float()
        return h, aux


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference RoPE in float64 through complex rotation of (x_i, x_{i+d/2}) pairs."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    freq = 1.0 / theta ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    z = z * torch.polar(torch.ones_like(freq), pos.to(torch.float64).view(-1, 1, 1) * freq)
    return torch.cat([z.real, z.imag], dim=-1)


def reference_forward(stack: AttentionStack, hidden: torch.Tensor, kv_dtype: Optional[torch.dtype] = None,
                      store_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One request's sequence [L, hidden_size] through the stack in float64, dense and causal: (output (CPU), aux).
    Apart from :meth:`AttentionStack.forward`: no backend or cache, complex RoPE, MLA un-absorbed. ``kv_dtype``: round
    what the cache stores through it; ``store_dtype``: round every tensor the stack hands on (five points) so the
    comparison measures the attention path."""
    def cached(t: torch.Tensor) -> torch.Tensor:
        return t if kv_dtype is None else t.to(kv_dtype).to(torch.float64)

    def stored(t: torch.Tensor) -> torch.Tensor:
        return t if store_dtype is None else t.to(store_dtype).to(torch.float64)

    f = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    if getattr(stack, "_f64_weights", None) is None:
        stack._f64_weights = [{k: f(t) for k, t in w.items()} for w in stack.weights]
    h, aux, n = f(hidden), [], hidden.shape[0]
    pos, theta = torch.arange(n), stack.spec.rope_theta
    for idx, L in enumerate(stack.layers):
        if stack.aux_hidden_state_layers and L.layer_id in stack.aux_hidden_state_layers:
            aux.append(h)
        w = stack._f64_weights[idx]
        x = stored(h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS))
        if L.is_mla:
            m = stack.spec.mla
            q = stored(x @ w["q"].T).reshape(n, L.num_heads, -1)
            lat = stored(x @ w["dkv"].T)
            c = lat[:, : m.kv_lora_rank]
            c = cached(stored(c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + EPS)))
            k_nope = torch.einsum("lc,hnc->lhn", c, w["uk"])
            k_rope = cached(stored(_rope_complex(lat[:, None, m.kv_lora_rank:], pos, theta))).expand(n, L.num_heads, -1)
            qq = torch.cat([q[..., : m.qk_nope_head_dim],
                            stored(_rope_complex(q[..., m.qk_nope_head_dim:], pos, theta))], -1)
            kk = torch.cat([k_nope, k_rope], dim=-1)
            vv = torch.einsum("lc,hvc->lhv", c, w["uv"])
        else:
            d, hkv = L.head_dim, L.num_kv_heads
            q, k, v = stored(x @ w["qkv"].T).split([L.num_heads * d, hkv * d, hkv * d], dim=-1)
            qq = stored(_rope_complex(q.reshape(n, L.num_heads, d), pos, theta))
            kk = cached(stored(_rope_complex(k.reshape(n, hkv, d), pos, theta)))
            vv = cached(v.reshape(n, hkv, d))
        o = stored(reference_attention(qq, kk, vv, q_positions=pos, scale=L.scaling, window=L.sliding_window,
                                       softcap=L.logit_softcap, sinks=None if L.sinks is None else f(L.sinks),
                                       chunk=L.attention_chunk_size))
        h = h + stored(o.reshape(n, -1) @ w["o"].T)
    return h, aux
