"""build-mode: which instances to build, on which workspace, and the decode CUDA graphs they are captured for
(docs/internals.md)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, overload, Sequence, Union

from pipeline.backends import registry
from pipeline.core.contracts import (AttentionArgs, BuildPlan, DeviceFacts, InstancePlan, Mode,
    ResolvedAttentionBackendStr, Skip, WorkspacePlan)
from pipeline.core.errors import ConfigError


HEAD = (1, 2, 4, 8)  # then 16, 24, 32, … step 8 (sglang's get_batch_sizes_to_capture)


class BatchSeries(Sequence[int]):
    """The sizes 1, 2, 4, 8, 16, 24, … up to ``top`` (those at most ``top``), ascending, held as a head tuple and a
    ``range``. A slice is a list (callers slice at most :data:`pipeline.core.numbers.REMEDY_MAX_BS`'s sizes)."""

    def __init__(self, top: int) -> None:
        self.top = int(top)
        self._head = tuple(b for b in HEAD if b <= self.top)
        self._tail = range(16, self.top + 1, 8)

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, list[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n, h = len(self), len(self._head)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("batch size index out of range")
        return self._head[i] if i < h else self._tail[i - h]

    def __iter__(self) -> Iterator[int]:
        yield from self._head
        yield from self._tail

    def __contains__(self, b: object) -> bool:
        return b in self._head or b in self._tail

    def __repr__(self) -> str:
        return f"BatchSeries(top={self.top}, {len(self)} sizes)"

    def total(self) -> int:
        """The sum of the sizes, in closed form."""
        t = self._tail
        return sum(self._head) + (len(t) * (t[0] + t[-1]) // 2 if len(t) else 0)


def series_sum(sizes: Sequence[int]) -> int:
    """``sum(sizes)``: in closed form for a :class:`BatchSeries`, else summed."""
    return sizes.total() if isinstance(sizes, BatchSeries) else sum(sizes)


def check_graph_bs(args: AttentionArgs, max_reqs: int, *, state: str = "build-mode") -> None:
    """The one rule for user graph sizes: refused, never clamped (sglang clamps). In order: a ``cuda_graph_bs`` entry
    outside ``1..max_reqs``; ``cuda_graph_max_bs`` given with ``cuda_graph_bs`` and not its largest
    (``conflicting_options``); ``cuda_graph_max_bs`` above ``max_reqs``.

    Checked on every device, O(len(cuda_graph_bs)). Raises ConfigError (``invalid_value`` / ``conflicting_options``, in
    ``state``) naming both fields and numbers, the allowed values and a remedy.
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
            remedy=f"set cuda_graph_max_bs={max_reqs}, or drop cuda_graph_max_bs (its default, sglang's top for the "
                   f"device's memory, is capped at max_reqs), or raise max_reqs to at least {top}")


# sglang's default ``cuda_graph_max_bs`` by total device memory (``ServerArgs._handle_gpu_memory_settings``): (below
# MiB, tp_size < 4, tp_size >= 4); the last row has no bound. sglang keeps sizes <= the request pool.
SGLANG_MAX_BS_BY_MEMORY: tuple[tuple[Optional[int], int, int], ...] = (
    (20 * 1024, 8, 8),       # T4, 4080
    (35 * 1024, 24, 80),     # A10, 4090, 5090
    (60 * 1024, 32, 160),    # A100 40 GB, L40(S)
    (90 * 1024, 256, 512),   # H100, A100 80 GB
    (160 * 1024, 256, 512),  # H20, H200
    (None, 512, 512),        # B200, MI300
)
# sglang's fallback when device memory is unknown; ours on CPU too (never captured).
SGLANG_MAX_BS_NO_MEMORY = 160


class GraphTop(NamedTuple):
    """The top of the capture series: ``bs`` (cut bound), ``source`` (``cuda_graph_bs``, ``cuda_graph_max_bs``,
    ``default`` or ``max_reqs``), ``text`` (in words)."""

    bs: int
    source: str
    text: str


def default_max_bs(device: Optional[DeviceFacts], world_size: int = 1) -> tuple[int, str]:
    """sglang's default ``cuda_graph_max_bs`` for ``device`` and ``world_size`` (tp_size) and its words:
    :data:`SGLANG_MAX_BS_BY_MEMORY`, or :data:`SGLANG_MAX_BS_NO_MEMORY` (160) without a memory reading."""
    mem = device.total_memory_bytes if device is not None and device.type != "cpu" else 0
    if mem <= 0:
        why = "a CPU" if device is not None and device.type == "cpu" else "no known device memory"
        return SGLANG_MAX_BS_NO_MEMORY, f"default for {why}: {SGLANG_MAX_BS_NO_MEMORY} (sglang's fallback)"
    mib = mem / (1 << 20)
    for below, small, large in SGLANG_MAX_BS_BY_MEMORY:
        if below is None or mib < below:
            bs = small if world_size < 4 else large
            break
    tp = f", tp {world_size}" if world_size > 1 else ""
    return bs, f"default for {mem / (1 << 30):.0f} GiB{tp}: {bs} (sglang's rule)"


def graph_top(args: AttentionArgs, max_reqs: int, *, device: Optional[DeviceFacts] = None,
              world_size: int = 1) -> GraphTop:
    """The top of the decode capture series (every series function cuts here): the largest ``cuda_graph_bs``, else
    ``cuda_graph_max_bs``, else ``min(max_reqs, default_max_bs)``. Raises what :func:`check_graph_bs` raises."""
    check_graph_bs(args, max_reqs)
    if args.cuda_graph_bs:
        return GraphTop(max(args.cuda_graph_bs), "cuda_graph_bs", "the largest of cuda_graph_bs")
    if args.cuda_graph_max_bs:
        return GraphTop(args.cuda_graph_max_bs, "cuda_graph_max_bs", f"cuda_graph_max_bs={args.cuda_graph_max_bs}")
    bs, why = default_max_bs(device, world_size)
    if max_reqs < bs:
        return GraphTop(max_reqs, "max_reqs", f"max_reqs={max_reqs}, below the {why}")
    return GraphTop(bs, "default", why)


def _series_top(top: int) -> int:
    """The last entry <= ``top`` of sglang's series 1, 2, 4, 8, 16, 24, … (0 when ``top`` < 1)."""
    return top - (top - 16) % 8 if top >= 16 else max((b for b in (1, 2, 4, 8) if b <= top), default=0)


def capture_batch_sizes(args: AttentionArgs, max_reqs: int, *, device: Optional[DeviceFacts] = None,
                        world_size: int = 1, state: str = "build-mode") -> list[int]:
    """The decode batch sizes to capture, ascending: ``cuda_graph_bs``, else sglang's series 1, 2, 4, 8, 16, 24, … up to
    :func:`graph_top`. Raises ConfigError (``invalid_value``, in ``state``) naming ``cuda_graph_bs`` and ``max_reqs``.
    """
    return list(capture_series(args, max_reqs, device=device, world_size=world_size, state=state))


def capture_series(args: AttentionArgs, max_reqs: int, *, device: Optional[DeviceFacts] = None,
                   world_size: int = 1, state: str = "build-mode") -> Sequence[int]:
    """:func:`capture_batch_sizes` not listed: the ``cuda_graph_bs`` sizes sorted, else the series as a
    :class:`states.build_mode.BatchSeries` (length, indexing and sum in O(1) whatever the top; the graphs'
    lower bound and the memory remedies use it, so refusing an absurd top costs nothing). Raises as that."""

    check_graph_bs(args, max_reqs, state=state)
    if args.cuda_graph_bs:
        return sorted(set(args.cuda_graph_bs))
    return BatchSeries(graph_top(args, max_reqs, device=device, world_size=world_size).bs)


def count_batch_sizes(args: AttentionArgs, max_reqs: int, *, device: Optional[DeviceFacts] = None,
                      world_size: int = 1) -> int:
    """``len(capture_batch_sizes(args, max_reqs, …))`` computed, not listed (O(1) in ``max_reqs``; the progress line's
    "bs k of n" before the pools are checked). Raises what :func:`check_graph_bs` raises."""
    check_graph_bs(args, max_reqs)
    if args.cuda_graph_bs:
        return len(set(args.cuda_graph_bs))
    top = graph_top(args, max_reqs, device=device, world_size=world_size).bs
    return sum(1 for b in (1, 2, 4, 8) if b <= top) + (max((top - 16) // 8 + 1, 0) if top >= 16 else 0)


def batch_sizes_text(args: AttentionArgs, max_reqs: int, limit: int = 4096, *,
                     device: Optional[DeviceFacts] = None, world_size: int = 1) -> str:
    """The captured sizes as comma-separated text (what ranks compare in their configuration digest); a series
    longer than ``limit`` as ``1,2,4,8,16..TOP step 8 (N sizes)`` so a huge ``cuda_graph_max_bs`` costs nothing."""
    kw = dict(device=device, world_size=world_size)
    n = count_batch_sizes(args, max_reqs, **kw)
    if n <= limit:
        return ",".join(map(str, capture_batch_sizes(args, max_reqs, **kw)))
    return f"1,2,4,8,16..{graph_max_bs(args, max_reqs, True, **kw)} step 8 ({n} sizes)"


class GraphDecision(NamedTuple):
    """Whether decode CUDA graphs are captured; ``downgrade``: lost because of the decode backend (a warning, refused
    under ``strict``), False when off by the user or not applicable."""

    capture: bool
    reason: str = ""
    downgrade: bool = False


def graph_mode(spec: Any, is_draft_worker: bool) -> str:
    """The step CUDA graphs capture (a ``ForwardMode`` value), as sglang's graph runners: target verify on a speculative
    target, draft decode on a draft worker, else decode."""
    if spec is None:
        return "decode"
    return "draft_decode" if is_draft_worker else "target_verify"


def graph_backend(pair: Any, spec: Any, is_draft_worker: bool) -> str:
    """The resolved backend whose graphs are captured: the prefill half for target verify (an extend-shaped batch,
    sglang's ``speculative_attention_mode="prefill"``), the decode half otherwise."""
    return pair.prefill if graph_mode(spec, is_draft_worker) == "target_verify" else pair.decode


def decide_graphs(args: AttentionArgs, device_type: str, decode_backends: Sequence[str]) -> GraphDecision:
    """The one CUDA-graph rule, in order: ``disable_cuda_graph`` (off); not cuda (does not apply); a decode backend
    whose entry lacks ``cuda_graph`` (a downgrade, as sglang)."""
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


def graph_max_bs(args: AttentionArgs, max_reqs: int, captured: bool, *, device: Optional[DeviceFacts] = None,
                 world_size: int = 1) -> int:
    """The largest decode batch a graph is captured for: the last of :func:`capture_batch_sizes`, 0 without graphs
    (computed, not listed: O(1) in ``max_reqs``). Raises what :func:`check_graph_bs` raises."""
    if not captured:
        return 0
    check_graph_bs(args, max_reqs)
    if args.cuda_graph_bs:
        return max(args.cuda_graph_bs)
    return _series_top(graph_top(args, max_reqs, device=device, world_size=world_size).bs)


LISTED_SIZES = 1024  # a plan lists the capture sizes up to this many (the series of an absurd max_reqs is not built)


def graph_sizes(args: AttentionArgs, max_reqs: int, captured: bool, *, device: Optional[DeviceFacts] = None,
                world_size: int = 1) -> tuple[int, int, Optional[list[int]]]:
    """``(count, largest, sizes)`` of the decode batches captured (``(0, 0, [])`` without graphs); ``sizes`` is
    :func:`capture_batch_sizes` when at most :data:`LISTED_SIZES`, else None — counted in O(1) like
    :func:`graph_max_bs`, never built. Raises what :func:`check_graph_bs` raises."""
    if not captured:
        return 0, 0, []
    kw = dict(device=device, world_size=world_size)
    count = count_batch_sizes(args, max_reqs, **kw)
    sizes = capture_batch_sizes(args, max_reqs, **kw) if count <= LISTED_SIZES else None
    return count, graph_max_bs(args, max_reqs, True, **kw), sizes


def decide_mode(args: AttentionArgs, is_draft_worker: bool) -> tuple[Mode, list[Skip]]:
    """The build mode and any skip (PD-mux + TBO together are refused earlier, in resolve)."""
    if args.enable_pdmux:
        return Mode.PDMUX, []
    if args.enable_two_batch_overlap:
        if is_draft_worker:
            return Mode.NORMAL, [Skip(what="two_batch_overlap",
                                      reason="draft worker: TBO applies to the target worker only (as sglang)",
                                      avoid={"enable_two_batch_overlap": False})]
        return Mode.TBO, []
    return Mode.NORMAL, []


def _tops(mode: Mode, sm_group_num: int) -> list[tuple[str, bool]]:
    """(role, private workspace?) of each top-level instance slot."""
    if mode is Mode.PDMUX:
        return [("pdmux.prefill", True)] + [(f"pdmux.decode{i}", False) for i in range(sm_group_num)]
    if mode is Mode.TBO:
        return [("tbo.primary", False), ("tbo.child0", False), ("tbo.child1", False)]
    return [("primary", False)]


def decide(args: AttentionArgs, pair: ResolvedAttentionBackendStr, *, is_draft_worker: bool,
           workspace_bytes: Callable[[str], int]) -> BuildPlan:
    """The plan: instances ``[{role, backend, workspace}]`` and workspaces ``[{id, owner, bytes, shared_by}]``;
    ``workspace_bytes(backend)`` gives bytes (0-byte workspaces are still planned)."""
    mode, skips = decide_mode(args, is_draft_worker)
    hybrid = pair.prefill != pair.decode
    instances: list[InstancePlan] = []
    shared: Optional[dict[str, Any]] = None
    privates: list[WorkspacePlan] = []
    for top, private in _tops(mode, args.sm_group_num):
        halves = [(f"{top}.prefill", pair.prefill), (f"{top}.decode", pair.decode)] if hybrid else [(top, pair.prefill)]
        need = max(workspace_bytes(b) for _, b in halves)
        if private:
            ws_id = f"ws-private-{top}"
            privates.append(WorkspacePlan(id=ws_id, owner=top, bytes=need, shared_by=[r for r, _ in halves]))
        else:
            if shared is None:
                shared = dict(id="ws-shared", owner=halves[0][0], bytes=need, shared_by=[])
            shared["bytes"] = max(shared["bytes"], need)
            shared["shared_by"] += [r for r, _ in halves]
            ws_id = "ws-shared"
        instances += [InstancePlan(role=r, backend=b, workspace=ws_id) for r, b in halves]
    workspaces = privates + ([WorkspacePlan(**shared)] if shared else [])
    return BuildPlan(mode=mode, hybrid=hybrid, instances=instances, workspaces=workspaces, skips=skips)

