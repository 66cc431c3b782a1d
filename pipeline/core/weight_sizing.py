"""What the runner's attention stack weighs, and its refusal when that is more than the memory free now.

``attn-setup run`` (and :class:`pipeline.runtime.runner.Runner`) builds the first ``num_layers`` attention
layers of the model with random weights (:class:`pipeline.runtime.model.AttentionStack`), and the float64
verification reference keeps a copy of them on the host. Both sizes follow from the config alone:

* per built attention layer ``(H·Dqk + 2·Hkv·Dqk)·hidden + hidden·H·Dv`` elements (MHA/GQA: the fused QKV
  projection and ``o_proj``), or for an absorbed-MLA layer ``q`` ``H·(nope+rope)·hidden``, ``dkv``
  ``(kv_lora+rope)·hidden``, ``W_UK`` ``H·nope·kv_lora``, ``W_UV`` ``H·v_head·kv_lora`` and ``o``
  ``hidden·H·v_head`` elements;
* in the model dtype's bytes on the device (2 for bfloat16/float16, 4 for float32), and 8 bytes per element
  for the host's float64 reference copy — for Llama-3.1-8B with ``--num-layers 32`` that is 2.7 GB + 10.7 GB,
  matching the 13.6 GB peak a trial measured.

:func:`check_weights_fit` refuses, before anything is allocated, a stack whose bytes exceed
:data:`~pipeline.core.pool_sizing.POOL_MEMORY_SHARE` of the memory free now (the device's for the weights,
the host's for the reference; on a CPU both are host memory), naming ``num_layers``, the bytes needed, the
limit and the largest ``num_layers`` that fits — the same rule :func:`~pipeline.core.pool_sizing.check_fits`
applies to the KV pools, so that neither ends in the kernel's OOM killer. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import ConfigError

__all__ = ["weight_bytes", "check_weights_fit", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REFERENCE_BYTES = 8  # float64


def _layer_elems(model: Any, kind: Any) -> int:
    h, hkv, hid = kind.num_heads, kind.num_kv_heads, model.hidden_size
    if kind.is_mla:
        m = model.mla
        return (h * (m.qk_nope_head_dim + m.qk_rope_head_dim) * hid + (m.kv_lora_rank + m.qk_rope_head_dim) * hid
                + h * m.qk_nope_head_dim * m.kv_lora_rank + h * m.v_head_dim * m.kv_lora_rank
                + hid * h * m.v_head_dim)
    return (h + 2 * hkv) * kind.head_dim_qk * hid + hid * h * kind.head_dim_v


def weight_bytes(model: Any, num_layers: int, dtype: str) -> tuple[int, int]:
    """``(model-dtype bytes, float64 reference bytes)`` of the first ``num_layers`` attention layers' weights
    of ``model`` (a :class:`~pipeline.core.contracts.ModelSpec`) at compute dtype ``dtype`` (a dtype name).

    Raises the ConfigError of :func:`pipeline.core.spec.attention_prefix` when ``num_layers`` is outside
    the model's attention layers."""
    from pipeline.core.spec import attention_prefix

    elems, n_hidden = 0, attention_prefix(model, num_layers)
    for kind in model.layer_kinds():
        layers = sum(1 for lid in kind.layer_ids if lid < n_hidden)
        elems += layers * _layer_elems(model, kind)
    return elems * DTYPE_BYTES.get(dtype, 2), elems * REFERENCE_BYTES


def check_weights_fit(model: Any, num_layers: int, dtype: str, *, device_free: int, host_free: int,
                      on_host: bool, device: str) -> None:
    """Refuse (ConfigError ``weights_exceed_memory``, exit 3) a stack of ``num_layers`` attention layers whose
    weights or float64 reference exceed :data:`~pipeline.core.pool_sizing.POOL_MEMORY_SHARE` of the free bytes.

    ``device_free`` / ``host_free``: bytes free now on the device and the host (0 = unknown: that side is not
    checked); ``on_host``: the device is the host (CPU), so weights and reference share ``host_free``. The
    error names ``num_layers`` (its value), the bytes needed and the limit, and as remedy the largest
    ``--num-layers`` that fits the free memory less :func:`~pipeline.core.pool_sizing.remedy_margin` (or, when
    not even one layer does, a smaller model or more free memory).
    """
    from pipeline.core.pool_sizing import POOL_MEMORY_SHARE, remedy_available
    from pipeline.core.spec import attention_layer_ids

    def fits(n: int, spare: bool = False) -> tuple[bool, str]:
        own, ref = weight_bytes(model, n, dtype)
        device_free, host_free = (remedy_available(d_free), remedy_available(h_free)) if spare else (d_free, h_free)
        if on_host:
            limit = int(host_free * POOL_MEMORY_SHARE)
            return (not host_free or own + ref <= limit,
                    f"{own + ref} bytes (weights {own} + float64 reference {ref}) but the host has {host_free} "
                    f"bytes free; {POOL_MEMORY_SHARE:.0%} of that is {limit} bytes")
        dlim, hlim = int(device_free * POOL_MEMORY_SHARE), int(host_free * POOL_MEMORY_SHARE)
        if device_free and own > dlim:
            return False, (f"{own} bytes of weights but {device} has {device_free} bytes free; "
                           f"{POOL_MEMORY_SHARE:.0%} of that is {dlim} bytes")
        if host_free and ref > hlim:
            return False, (f"{ref} bytes for the float64 verification reference but the host has {host_free} "
                           f"bytes free; {POOL_MEMORY_SHARE:.0%} of that is {hlim} bytes")
        return True, ""

    d_free, h_free = device_free, host_free
    ok, why = fits(num_layers)
    if ok:
        return
    lo, hi = 0, min(num_layers, len(attention_layer_ids(model)))  # largest n in [1, hi) that fits: binary search
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if fits(mid, spare=True)[0]:
            lo = mid
        else:
            hi = mid
    remedy = (f"pass --num-layers {lo} or fewer (the most attention layers whose weights fit; sizes scale with "
              "the layer count)" if lo >= 1 else
              "free memory on the device and the host, or use a smaller model: not even one attention layer fits "
              "with a margin for free memory that moves between runs")
    raise ConfigError(f"{num_layers} attention layers need {why}", code="weights_exceed_memory",
                      state="load-model", flags=[("num_layers", num_layers)],
                      allowed=[f"num_layers <= {lo}" if lo >= 1 else "a model whose one layer fits"], remedy=remedy)
