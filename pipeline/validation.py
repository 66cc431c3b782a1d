"""Field-level checks run from the contracts' ``__post_init__`` (before anything is allocated).

Each failure raises :class:`pipeline.errors.ConfigError` naming the field, its value, what is
allowed and a remedy. Cross-field and capability checks live in :mod:`states.resolve` and
:mod:`states.build_mode`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.contracts import AttentionArgs, PoolFacts, SetupRequest

KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
MAX_PAGE_SIZE = 4096
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")


def _bad(field: str, value: Any, allowed: list[str] | tuple[str, ...], remedy: str, msg: str | None = None):
    raise ConfigError(
        msg or f"{field}={value!r} is not allowed",
        code="invalid_value",
        flags=[(field, value)],
        allowed=allowed,
        remedy=remedy,
    )


def _positive(field: str, value: int | None, *, allow_zero: bool = False, upper: int | None = None) -> None:
    if value is None:
        return
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (upper is not None and value > upper):
        rng = f"an integer in [{lo}, {upper}]" if upper else f"an integer >= {lo}"
        _bad(field, value, [rng], f"set {field} to {rng}")


def check_attention_args(a: "AttentionArgs") -> None:
    """Domain checks of single fields of :class:`AttentionArgs` (raises ConfigError)."""
    _positive("page_size", a.page_size, upper=MAX_PAGE_SIZE)
    _positive("sm_group_num", a.sm_group_num)
    _positive("zbal_local_mem_size", a.zbal_local_mem_size, allow_zero=True)
    _positive("flashinfer_workspace_size", a.flashinfer_workspace_size)
    _positive("cuda_graph_max_bs", a.cuda_graph_max_bs)
    _positive("speculative_eagle_topk", a.speculative_eagle_topk)
    if a.cuda_graph_bs is not None:
        if not isinstance(a.cuda_graph_bs, (list, tuple)):
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["a list of positive integers"], "pass batch sizes as a list")
        if len(set(a.cuda_graph_bs)) != len(a.cuda_graph_bs):
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["distinct batch sizes"], "list each batch size once")
        if not a.cuda_graph_bs:
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["a non-empty list of positive integers"],
                 "omit cuda_graph_bs to use the defaults, or list at least one batch size")
        for bs in a.cuda_graph_bs:
            _positive("cuda_graph_bs", bs)
    if a.kv_cache_dtype not in KV_CACHE_DTYPES:
        _bad("kv_cache_dtype", a.kv_cache_dtype, KV_CACHE_DTYPES, "pick one of the allowed KV cache dtypes")
    if a.dtype not in MODEL_DTYPES:
        _bad("dtype", a.dtype, MODEL_DTYPES, "pick one of the allowed model dtypes")
    if a.speculative_algorithm is not None and a.speculative_algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        _bad("speculative_algorithm", a.speculative_algorithm, SPECULATIVE_ALGORITHMS,
             "use one of sglang's speculative algorithms, or leave it unset")
    if a.speculative_eagle_topk is not None and a.speculative_algorithm is None:
        raise ConfigError("speculative_eagle_topk is set without speculative_algorithm", code="conflicting_options",
                          flags=[("speculative_eagle_topk", a.speculative_eagle_topk), ("speculative_algorithm", None)],
                          remedy="set speculative_algorithm too, or drop speculative_eagle_topk")
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                  "speculative_draft_attention_backend"):
        v = getattr(a, field)
        if v is not None and not isinstance(v, str):
            _bad(field, v, ["a backend name (string)"], f"give {field} a backend name such as torch_native")
        if v is not None and (not v or v != v.strip()):
            _bad(field, v, ["a backend name"], f"give {field} a backend name such as torch_native, or omit it")


def check_pool_facts(p: "PoolFacts") -> None:
    """Domain checks of :class:`PoolFacts` (raises ConfigError)."""
    _positive("pool.max_reqs", p.max_reqs)
    _positive("pool.max_context_len", p.max_context_len)
    _positive("pool.num_token_slots", p.num_token_slots)
    _positive("pool.page_size", p.page_size, upper=MAX_PAGE_SIZE)
    if p.num_token_slots % p.page_size:
        _bad("pool.num_token_slots", p.num_token_slots, [f"a multiple of page_size={p.page_size}"],
             "round num_token_slots to whole pages")


def check_setup_request(r: "SetupRequest") -> None:
    """Cross-field checks of :class:`SetupRequest` (raises ConfigError)."""
    if r.world_size < 1:
        _bad("world_size", r.world_size, ["an integer >= 1"], "set world_size to the number of ranks")
    if not 0 <= r.rank < r.world_size:
        _bad("rank", r.rank, [f"0..{r.world_size - 1}"], "rank must be below world_size")
    if r.pool.page_size != r.args.page_size:
        raise ConfigError(
            f"pool.page_size={r.pool.page_size} differs from page_size={r.args.page_size}",
            code="conflicting_options",
            flags=[("page_size", r.args.page_size), ("pool.page_size", r.pool.page_size)],
            remedy="size the KV pool with the same page_size the backends are asked to use",
        )
    if r.draft_model is not None and not r.is_draft_worker:
        _bad("draft_model", r.draft_model.source or "<spec>", ["only with is_draft_worker=True"],
             "set is_draft_worker=True to initialize the draft worker, or drop draft_model")
    dev = r.device
    head, _, idx = dev.partition(":")
    if head not in ("auto", "cpu", "cuda", "musa", "npu", "xpu", "mps") or (idx and not idx.isdigit()) or (head in ("auto", "cpu") and idx):
        _bad("device", dev, ["auto", "cpu", "cuda", "cuda:N", "musa[:N]", "npu[:N]", "xpu[:N]"],
             "pass device='auto' to pick this machine's accelerator, or device='cpu'")
