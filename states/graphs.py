"""Decode CUDA graphs, decided once and torch-free: whether they are captured and for which batch sizes.

:func:`decide_graphs` is the one rule for whether graphs are captured (disabled, not a CUDA device, a
decode backend whose registry entry cannot be captured): resolve records it and the runner's capture step
obeys it. :func:`capture_batch_sizes` is the one rule for the sizes (sglang's ``get_batch_sizes_to_capture``).
``attn-setup plan``, ``run``'s preflight and build-mode's workspace bound use them too; the capture itself is
:class:`pipeline.runtime.cuda_graphs.DecodeGraphRunner`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from pipeline.backends import registry
from pipeline.core.contracts import AttentionArgs
from pipeline.core.errors import ConfigError


def check_graph_bs(args: AttentionArgs, max_reqs: int, *, state: str = "build-mode") -> None:
    """The one rule for graph sizes the user gives: an unreachable or conflicting size is refused, never clamped or
    ignored silently (sglang does both: ``get_batch_sizes_to_capture`` drops sizes above the request pool and adds
    the pool's size; ``ServerArgs`` replaces ``cuda_graph_max_bs`` by ``max(cuda_graph_bs)``). In order:

    - a ``cuda_graph_bs`` entry outside ``1..max_reqs`` (a captured batch holds one ``req_to_token`` row per
      request: a larger one is never run);
    - ``cuda_graph_max_bs`` given with ``cuda_graph_bs`` and not equal to its largest size (``conflicting_options``:
      the list decides what is captured);
    - ``cuda_graph_max_bs`` above ``max_reqs`` (unreachable, as a list entry above it is).

    Checked on every device (also where graphs are not captured), as ``plan`` and ``run``'s preflight check them.
    Costs O(len(cuda_graph_bs)), whatever ``max_reqs`` is, so it may run before any size is checked.

    Raises ConfigError (``invalid_value`` / ``conflicting_options``, in ``state``) naming both fields with their
    numbers, the allowed values and a remedy that then passes.
    """
    bad = sorted(b for b in args.cuda_graph_bs or () if not 1 <= b <= max_reqs)
    if bad:
        keep = sorted(b for b in args.cuda_graph_bs if 1 <= b <= max_reqs)
        sizes = ", ".join(map(str, bad))
        fix = f"drop {sizes} from cuda_graph_bs" + (f" (keeping {', '.join(map(str, keep))})" if keep else "") + (
            " and drop cuda_graph_max_bs" if args.cuda_graph_max_bs else "")
        raise ConfigError(
            f"cuda_graph_bs has {sizes}, above max_reqs={max_reqs}: a captured decode batch of {max(bad)} "
            f"requests needs {max(bad)} rows of req_to_token and the pool has {max_reqs}",
            code="invalid_value", state=state,
            flags=[("cuda_graph_bs", list(args.cuda_graph_bs)), ("max_reqs", max_reqs)],
            allowed=[f"1..{max_reqs}"], remedy=f"{fix}, or raise max_reqs to at least {max(bad)}")
    top = args.cuda_graph_max_bs  # 0 / False (a remedy's "drop") is unset, as everywhere below
    if top and args.cuda_graph_bs and top != max(args.cuda_graph_bs):
        largest = max(args.cuda_graph_bs)
        raise ConfigError(
            f"cuda_graph_max_bs={top} conflicts with cuda_graph_bs, whose largest size is {largest}: the listed sizes "
            f"are what is captured (sglang would replace cuda_graph_max_bs by {largest} without saying so)",
            code="conflicting_options", state=state,
            flags=[("cuda_graph_max_bs", top), ("cuda_graph_bs", list(args.cuda_graph_bs))], allowed=[str(largest)],
            remedy=f"set cuda_graph_max_bs={largest}, or drop cuda_graph_max_bs (the list's largest size is the "
                   "largest captured)")
    if top and top > max_reqs:
        raise ConfigError(
            f"cuda_graph_max_bs={top} is above max_reqs={max_reqs}: no decode batch has more than the pool's "
            f"{max_reqs} rows of req_to_token, so sizes above {max_reqs} are never captured (sglang would clamp them "
            "to the pool without saying so)", code="invalid_value", state=state,
            flags=[("cuda_graph_max_bs", top), ("max_reqs", max_reqs)], allowed=[f"1..{max_reqs}"],
            remedy=f"set cuda_graph_max_bs={max_reqs}, or drop cuda_graph_max_bs (its default is max_reqs), or raise "
                   f"max_reqs to at least {top}")


def capture_batch_sizes(args: AttentionArgs, max_reqs: int, *, state: str = "build-mode") -> list[int]:
    """The decode batch sizes to capture, ascending (the one implementation of this rule).

    ``cuda_graph_bs`` when given (checked by :func:`check_graph_bs`), else sglang's series 1, 2, 4, 8, 16, 24, 32,
    … (step 8 from 16, ``get_batch_sizes_to_capture``) up to ``cuda_graph_max_bs`` (default: ``max_reqs``), never
    above ``max_reqs``. ``plan``, ``run``'s preflight and the capture itself call this; checks made before the
    pools are sized (whose ``max_reqs`` may still be absurd) use :func:`check_graph_bs` and :func:`graph_max_bs`,
    which never build the series.

    Raises ConfigError (``invalid_value``, in ``state``) naming ``cuda_graph_bs`` and ``max_reqs`` with both numbers.
    """
    check_graph_bs(args, max_reqs, state=state)
    if args.cuda_graph_bs:
        return sorted(set(args.cuda_graph_bs))
    top = min(args.cuda_graph_max_bs or max_reqs, max_reqs)
    series = [1, 2, 4, 8] + list(range(16, top + 1, 8))
    return [b for b in series if b <= top]


def count_batch_sizes(args: AttentionArgs, max_reqs: int) -> int:
    """``len(capture_batch_sizes(args, max_reqs))`` computed, not listed (O(1) in ``max_reqs``; the progress line's
    "bs k of n" before the pools are checked). Raises what :func:`check_graph_bs` raises."""
    check_graph_bs(args, max_reqs)
    if args.cuda_graph_bs:
        return len(set(args.cuda_graph_bs))
    top = min(args.cuda_graph_max_bs or max_reqs, max_reqs)
    return sum(1 for b in (1, 2, 4, 8) if b <= top) + (max((top - 16) // 8 + 1, 0) if top >= 16 else 0)


def batch_sizes_text(args: AttentionArgs, max_reqs: int, limit: int = 4096) -> str:
    """The captured sizes as comma-separated text (what ranks compare in their configuration digest); a series
    longer than ``limit`` as ``1,2,4,8,16..TOP step 8 (N sizes)`` so an absurd ``max_reqs`` costs nothing."""
    n = count_batch_sizes(args, max_reqs)
    if n <= limit:
        return ",".join(map(str, capture_batch_sizes(args, max_reqs)))
    return f"1,2,4,8,16..{graph_max_bs(args, max_reqs, True)} step 8 ({n} sizes)"


class GraphDecision(NamedTuple):
    """Whether decode CUDA graphs are captured and, if not, why.

    ``downgrade``: graphs exist on this device and are lost because of the decode backend (a
    ``feature_downgraded`` warning, refused under ``strict``); False when they are switched off by
    the user or do not apply (no CUDA device).
    """

    capture: bool
    reason: str = ""
    downgrade: bool = False


def decide_graphs(args: AttentionArgs, device_type: str, decode_backends: Sequence[str]) -> GraphDecision:
    """The one CUDA-graph rule (resolve records it, the runner's capture step obeys it).

    Checked in order: ``disable_cuda_graph`` (off, no downgrade); a device other than cuda (does not
    apply); any decode backend whose registry entry cannot be captured (its record lacks ``cuda_graph``: a
    downgrade, as sglang turns graphs off for its reference backend).
    """
    if args.disable_cuda_graph:
        return GraphDecision(False, "disable_cuda_graph is set")
    if device_type != "cuda":
        return GraphDecision(False, f"CUDA graphs need a CUDA device; this run is on {device_type}")
    lacking = [n for n in decode_backends if not registry.get(n).graphs]
    if lacking:
        return GraphDecision(False, f"decode backend {lacking[0]!r} cannot be captured in a CUDA graph "
                             f"(as sglang turns graphs off for {registry.reference_name()})", downgrade=True)
    return GraphDecision(True)


def skip_reason(args: AttentionArgs, device_type: str, backend_names: Sequence[str]) -> Optional[str]:
    """Why decode graphs are not captured, or None when they are (:func:`decide_graphs`)."""
    d = decide_graphs(args, device_type, backend_names)
    return None if d.capture else d.reason


def graph_max_bs(args: AttentionArgs, max_reqs: int, captured: bool) -> int:
    """The largest decode batch a graph is captured for: the last of :func:`capture_batch_sizes`, 0 without graphs
    (computed, not listed: O(1) in ``max_reqs``). Raises what :func:`check_graph_bs` raises."""
    if not captured:
        return 0
    check_graph_bs(args, max_reqs)
    if args.cuda_graph_bs:
        return max(args.cuda_graph_bs)
    top = min(args.cuda_graph_max_bs or max_reqs, max_reqs)
    return top - (top - 16) % 8 if top >= 16 else max((b for b in (1, 2, 4, 8) if b <= top), default=0)


LISTED_SIZES = 1024  # a plan lists the capture sizes up to this many (the series of an absurd max_reqs is not built)


def graph_sizes(args: AttentionArgs, max_reqs: int, captured: bool) -> tuple[int, int, Optional[list[int]]]:
    """``(count, largest, sizes)`` of the decode batches captured (``(0, 0, [])`` without graphs); ``sizes`` is
    :func:`capture_batch_sizes` when at most :data:`LISTED_SIZES`, else None — counted in O(1) like
    :func:`graph_max_bs`, never built. Raises what :func:`check_graph_bs` raises."""
    if not captured:
        return 0, 0, []
    count = count_batch_sizes(args, max_reqs)
    sizes = capture_batch_sizes(args, max_reqs) if count <= LISTED_SIZES else None
    return count, graph_max_bs(args, max_reqs, True), sizes
