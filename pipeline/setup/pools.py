"""build-mode's memory: the workspaces and KV pools checked against the device before anything is allocated,
the pools built from ``request.pool`` — or the engine's own pools checked against it.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.dtypes import kv_dtype
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import POOL_MEMORY_SHARE, PoolSizing, available_bytes, check_fits, kv_bytes_per_token, \
    remedy_available
from pipeline.platforms import parse_device
from pipeline.setup.context import SetupContext

GIVEN_POOLS_REMEDY = ("build the pools from the same sizes as the SetupRequest's PoolFacts (max_reqs, max_context_len, "
                      "num_token_slots, page_size) and the model (KVPool.for_layer_kinds), or pass pools=None")


def check_workspace_memory(ctx: SetupContext, d: Any) -> None:
    """Refuse planned workspaces larger than :data:`POOL_MEMORY_SHARE` of the device's free memory (ConfigError
    ``workspace_exceeds_memory`` naming the setting that sized them and a size that fits the free memory less
    :func:`~pipeline.memory.pools.remedy_margin`)."""
    plan = d.plan
    total = plan.workspace_bytes
    avail = available_bytes(ctx.platform, parse_device(ctx.request.device)[1]) if total else 0
    if not avail or total <= avail * POOL_MEMORY_SHARE:
        return
    s = max(d.settings, key=lambda s: s.value) if d.settings else None  # the setting that sized the workspaces
    name = "workspace_bytes" if s is None else (s.env_var if s.source == "env" and s.env_var else s.field)
    per_ws = int(avail * POOL_MEMORY_SHARE) // max(len(plan.workspaces), 1)
    fit = int(remedy_available(avail) * POOL_MEMORY_SHARE) // max(len(plan.workspaces), 1)  # with a margin
    raise ConfigError(f"the planned workspaces need {total} bytes but {ctx.torch_device} has {avail} bytes free "
                      f"({POOL_MEMORY_SHARE:.0%} of it may be used)", code="workspace_exceeds_memory",
                      flags=[(name, None if s is None else s.value), ("workspaces", len(plan.workspaces)),
                             ("available_bytes", avail)],
                      allowed=[f"<= {per_ws} bytes per workspace"], remedy=f"set {name} to {fit} or less")


def check_pools_fit(ctx: SetupContext) -> None:
    """Refuse the KV pools ``request.pool`` asks for (``req_to_token`` + every layer's K/V) when they cannot fit the
    free memory of the run's device: ConfigError ``pool_exceeds_memory`` naming the ``pool.*`` field that decides
    it (:func:`pipeline.memory.pools.check_fits`). Reads free memory, allocates nothing; build-mode's ``check``
    calls it before its workspace checks (a pool of 2**31 rows is the problem to name, not the workspace its graphs
    would need). In a run that check comes right before build-mode's ``apply``, which allocates the pools
    (:func:`make_pools`) without reading free memory a second time: nothing is allocated in between, and on CPU one
    read of ``/proc/meminfo`` costs ~50 µs, a twentieth of a whole setup."""
    req = ctx.request
    p, model = req.pool, req.served_model
    per_tok = kv_bytes_per_token(model.layer_kinds(), model.num_hidden_layers, kv_dtype(req.args, model))
    s = PoolSizing(facts=p, source="slots", budget_bytes=None, bytes_per_token=per_tok,
                   req_to_token_bytes=p.max_reqs * p.max_context_len * 4, kv_bytes=p.num_token_slots * per_tok)
    check_fits(s, available_bytes(ctx.platform, parse_device(req.device)[1]), device=str(ctx.torch_device), cli=False,
               graph_top=req.args.cuda_graph_max_bs or max(req.args.cuda_graph_bs or [0]))


def make_pools(ctx: SetupContext) -> None:
    """The KV pools for ``request.pool`` and the served model (build-mode's ``check`` has refused them already when
    they cannot fit the device's free memory: :func:`check_pools_fit`); or, when the engine passed its own, those
    checked (:func:`check_given_pools`)."""
    if ctx.given_pools is not None:
        check_given_pools(ctx)
        return
    from pipeline.backends.memory import KVPool, ReqToTokenPool, torch_dtype

    req = ctx.request
    p, model = req.pool, req.served_model
    kinds, kvd = model.layer_kinds(), kv_dtype(req.args, model)
    ctx.pools["req_to_token_pool"] = ReqToTokenPool(p.max_reqs, p.max_context_len, ctx.torch_device)
    ctx.pools["kv_pool"] = KVPool.for_layer_kinds(kinds, model.num_hidden_layers, p.num_token_slots, p.page_size,
                                                  torch_dtype(kvd), ctx.torch_device)


def _bad(field: str, have: Any, want: Any) -> ConfigError:
    return ConfigError(f"the given pools' {field} is {have!r}, this run needs {want!r}", code="pools_mismatch",
                       flags=[(f"pools.{field}", repr(have))], allowed=[repr(want)], remedy=GIVEN_POOLS_REMEDY)


def _check_tensor(field: str, t: Any, shape: tuple, dtype: Any, dev: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise _bad(field, type(t).__name__, f"a torch.Tensor {list(shape)} {dtype}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise _bad(field, f"{list(t.shape)} {t.dtype}", f"{list(shape)} {dtype}")
    if t.device.type != dev.type or (dev.index is not None and t.device.index not in (None, dev.index)):
        raise _bad(f"{field}.device", str(t.device), str(dev))


def check_given_pools(ctx: SetupContext) -> None:
    """Refuse engine pools that the request's ``PoolFacts`` or the model do not describe.

    The workspace bound and the backends' buffers are sized from ``request.pool`` and the layer kinds, so
    pools that differ would be read past their end or under-sized (sglang builds both from one ModelRunner
    config). Checked: both keys; ``req_to_token`` [max_reqs, max_context_len] int32; per model layer a K
    [num_token_slots, Hkv, D] and V [num_token_slots, Hkv, Dv] buffer of the KV dtype, on the run's device
    (an MLA layer's V a view of its K buffer's first Dv dims); ``page_size``. Raises ConfigError ``pools_mismatch`` (naming the field, what it holds and what is needed)
    before any allocation.
    """
    import torch

    from pipeline.backends.memory import torch_dtype

    pools, req = ctx.given_pools, ctx.request
    p, model = req.pool, req.served_model
    for key in ("req_to_token_pool", "kv_pool"):
        if pools.get(key) is None:
            raise _bad(key, None if key not in pools else pools[key], "a pool object")
    r2t, kv, dev = pools["req_to_token_pool"], pools["kv_pool"], torch.device(ctx.torch_device)
    _check_tensor("req_to_token_pool.req_to_token", getattr(r2t, "req_to_token", None),
                  (p.max_reqs, p.max_context_len), torch.int32, dev)
    if getattr(kv, "page_size", None) != p.page_size:
        raise _bad("kv_pool.page_size", getattr(kv, "page_size", None), p.page_size)
    kvd, n = torch_dtype(kv_dtype(req.args, model)), model.num_hidden_layers
    kb, vb = getattr(kv, "k_buffer", None), getattr(kv, "v_buffer", None)
    for name, bufs in (("k_buffer", kb), ("v_buffer", vb)):
        if not isinstance(bufs, (list, tuple)) or len(bufs) < n:
            raise _bad(f"kv_pool.{name}", f"{type(bufs).__name__} of "
                       f"{len(bufs) if isinstance(bufs, (list, tuple)) else '-'}", f"a list of {n} per-layer buffers")
    for k in model.layer_kinds():
        for lid in k.layer_ids:
            _check_tensor(f"kv_pool.k_buffer[{lid}]", kb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_qk),
                          kvd, dev)
            _check_tensor(f"kv_pool.v_buffer[{lid}]", vb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_v),
                          kvd, dev)
            if k.is_mla and (vb[lid].data_ptr() != kb[lid].data_ptr() or vb[lid].stride() != kb[lid].stride()):
                raise _bad(f"kv_pool.v_buffer[{lid}]", "a separate tensor",
                           f"a view of the first {k.head_dim_v} dims of k_buffer[{lid}] (one latent buffer per "
                           "MLA layer, as sglang's MLATokenToKVPool; KVPool.for_layer_kinds builds it)")
