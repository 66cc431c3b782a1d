"""What every rank of a launch must agree on, and the free-memory balance between ranks.

:func:`digest_fields` turns one rank's request and environment into ``{field: text}``; resolve
exchanges it with the resolution (:func:`pipeline.setup.distributed.agree_on_resolution`) and every rank
fails with ``rank_divergence`` naming each field whose text differs, with every rank's value,
before anything is allocated. The attention args are compared field by field as ``args.<name>``
(the existing part of the table); the digest adds:

============================  =============================================================
``model``                     served model: type, architectures, sha256 of its config record less its layers
``num_layers``                the layers it spans (``--num-layers`` cuts them) and a sha256 of their kinds
``draft_model``               the draft model the same way (``none`` when not given)
``is_draft_worker``           draft worker or target worker
``pool.<field>``              ``max_reqs``, ``max_context_len``, ``num_token_slots`` (page size: ``args.page_size``)
``dtype.model`` / ``dtype.kv_cache``  resolved compute and KV-cache dtypes
``cuda_graph_bs``             the decode batch sizes that would be captured (``disabled``)
``versions.<package>``        attn-setup, Python, torch, CUDA, triton, flashinfer versions
``capabilities``              sha256 of every registered backend's capability record
============================  =============================================================

``world_size`` is not in the digest: device-init already refuses a request whose rank or world size
is not the process group's (``rank_mismatch``).

**May differ** (never compared, documented in README): ``rank``, ``LOCAL_RANK`` and the device
index (each rank has its own device; two ranks on one device of one host are refused separately),
the host name, process ids, the model config's file path (``source``: mounts differ between
hosts), timestamps and the trace file path.

Memory balance mirrors sglang's tensor-parallel check (``ModelRunner.init_torch_distributed``:
every rank all-reduces the minimum free memory and raises "The memory capacity is unbalanced"
when ``min_free < local_free * 0.9``), i.e. a spread above 10 % of the largest rank's free memory.
Here every rank compares the same gathered list, so all ranks fail together and the lowest rank
is named: :func:`check_memory_balance`.
"""

from __future__ import annotations

import hashlib
import os

from pipeline.core.numbers import ascii_float
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.errors import MemoryImbalance, UsageError

__all__ = ["digest_fields", "MAY_DIFFER", "check_memory_balance", "max_imbalance_from", "DEFAULT_MAX_IMBALANCE",
           "ENV_MAX_IMBALANCE"]

MAY_DIFFER = ("rank", "local_rank", "device index", "host", "pid", "model config path (source)", "trace path",
              "timestamps")
DEFAULT_MAX_IMBALANCE = 0.10  # sglang: min_free < 0.9 * local_free is refused
ENV_MAX_IMBALANCE = "ATTN_SETUP_MAX_MEMORY_IMBALANCE"
FLAG_MAX_IMBALANCE = "--max-memory-imbalance"


def _sha(obj: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()[:16]


def _model_text(model: Any, layers_apart: bool = False) -> str:
    if model is None:
        return "none"
    rec = msgspec.to_builtins(model)
    rec.pop("source", None)  # the file path may differ between hosts; the content may not
    if layers_apart:  # compared as ``num_layers`` (:func:`_layers_text`): a different --num-layers is not a model
        rec.pop("num_hidden_layers", None)
        rec.pop("layer_types", None)
    return f"{model.model_type} {'/'.join(model.architectures or [])} sha256:{_sha(rec)}"


def _layers_text(model: Any) -> str:
    """The layers the served model spans (``--num-layers`` cuts them) and a hash of their kinds."""
    return f"{model.num_hidden_layers} layers, kinds sha256:{_sha(list(model.layer_types or []))}"


def _capabilities_text() -> str:
    from pipeline.backends import registry

    return "sha256:" + _sha({n: msgspec.to_builtins(registry.get(n).capability) for n in registry.names()})


def digest_fields(request: Any, installed: Mapping[str, bool], device: Any = None) -> dict[str, str]:
    """``{field: text}`` of what must be equal on every rank (module docstring), for ``request``
    (a :class:`~pipeline.core.contracts.SetupRequest`), the package presence ``installed`` and the rank's
    ``device`` facts (the default capture sizes follow its memory: :func:`states.build_mode.graph_top`).

    Values are short texts so the divergence table shows them; a value that cannot be computed
    (an invalid dtype, a graph list the pool cannot hold) reads ``error: <code>`` — that rank's
    own check reports it, and the other ranks see the difference."""
    from states.build_mode import batch_sizes_text
    from pipeline.core.errors import AttnSetupError
    from pipeline.core.runinfo import versions
    from states.capability_check import kv_dtype, model_dtype

    args, pool = request.args, request.pool

    def safe(fn: Any) -> str:
        try:
            return str(fn())
        except AttnSetupError as e:
            return f"error: {e.info.code}"

    out = {"model": _model_text(request.served_model, layers_apart=True),
           "num_layers": _layers_text(request.served_model),
           "draft_model": _model_text(request.draft_model),
           "is_draft_worker": str(request.is_draft_worker).lower()}
    for f in pool.__struct_fields__:
        if f != "page_size":  # validation makes it equal to args.page_size, compared as that
            out[f"pool.{f}"] = str(getattr(pool, f))
    out["dtype.model"] = safe(lambda: model_dtype(args, request.served_model))
    out["dtype.kv_cache"] = safe(lambda: kv_dtype(args, request.served_model))
    out["cuda_graph_bs"] = ("disabled" if args.disable_cuda_graph else
                            safe(lambda: batch_sizes_text(args, pool.max_reqs, device=device,
                                                         world_size=request.world_size)))
    for k, v in sorted(versions(installed).items()):
        out[f"versions.{k}"] = str(v)
    out["capabilities"] = _capabilities_text()
    return out


def max_imbalance_from(value: Optional[float], environ: Mapping[str, str] = os.environ) -> float:
    """The allowed spread: ``value`` (the flag) when given, else ``ATTN_SETUP_MAX_MEMORY_IMBALANCE``,
    else 0.10. A fraction in [0, 1] of the largest rank's free bytes (1 turns the check off).

    Raises :class:`UsageError` naming the flag or variable when it is not such a number."""
    name, raw = FLAG_MAX_IMBALANCE, value
    if value is None:
        name, text = ENV_MAX_IMBALANCE, environ.get(ENV_MAX_IMBALANCE, "").strip()
        if not text:
            return DEFAULT_MAX_IMBALANCE
        try:
            raw = ascii_float(text)   # ASCII only, as the flag: '٣' is not 3 (adversarial pass #5)
        except ValueError:
            raw = text
    ok = isinstance(raw, (int, float)) and not isinstance(raw, bool) and 0.0 <= raw <= 1.0
    if not ok:
        shown = text if value is None else raw   # the variable as it was set, not its float's repr
        raise UsageError(f"{name} {shown!r} is not a fraction in [0, 1]", flags=[(name, str(shown))],
                         allowed=["0 <= fraction <= 1 (0.1 = sglang's rule; 1 = no check)"],
                         remedy=f"pass {FLAG_MAX_IMBALANCE} 0.1 (or unset {ENV_MAX_IMBALANCE})")
    return float(raw)  # type: ignore[arg-type]


def check_memory_balance(free_bytes: list[int], max_imbalance: float, *, rank: int,
                         device: str = "") -> None:
    """Refuse a launch whose ranks' free device memory differs too much.

    ``free_bytes[r]``: rank r's free bytes at device-init (``Platform.memory_available``). Passes when
    ``min >= (1 - max_imbalance) * max`` (sglang: ``min_free >= 0.9 * local_free``). Otherwise raises
    :class:`MemoryImbalance` (every rank, same numbers) naming the lowest rank, its bytes, the
    largest and the threshold."""
    hi, lo = max(free_bytes), min(free_bytes)
    if lo >= (1.0 - max_imbalance) * hi:
        return
    low = free_bytes.index(lo)
    gib = 1 << 30
    per = ", ".join(f"rank {r}={b / gib:.2f} GiB" for r, b in enumerate(free_bytes))
    raise MemoryImbalance(
        f"free device memory differs between ranks by {(hi - lo) / hi:.0%} (allowed {max_imbalance:.0%}): rank {low} "
        f"has {lo / gib:.2f} GiB free, the most is {hi / gib:.2f} GiB — seen from rank {rank}; {per}",
        state="device-init",
        flags=[("low_rank", low), ("free_bytes", {str(r): b for r, b in enumerate(free_bytes)}),
               ("max_imbalance", max_imbalance), ("min_allowed_bytes", int((1.0 - max_imbalance) * hi))]
        + ([("device", device)] if device else []),
        allowed=[f"every rank's free memory >= {1.0 - max_imbalance:.0%} of the largest"],
        remedy=f"free rank {low}'s device (another process holds memory there: check nvidia-smi), or allow a larger "
               f"spread with {FLAG_MAX_IMBALANCE} / {ENV_MAX_IMBALANCE} (1 turns the check off)")
