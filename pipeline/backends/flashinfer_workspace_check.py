"""The FlashInfer workspace checks: the need (:mod:`pipeline.backends.flashinfer_sizing`) against the size a backend
gets, with a remedy whose every alternative then passes (build-mode, ``plan`` and ``run``'s preflight call
:func:`check_backend_workspace` through the registry entry; sglang fails instead with FlashInfer's "Out of workspace
memory" during graph capture)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from pipeline.backends.flashinfer_sizing import HeadShape, WorkspaceNeed, workspace_need
from pipeline.core.errors import ConfigError
from pipeline.core.numbers import REMEDY_MAX_BS, largest_fitting

WORKSPACE_FIELD = "flashinfer_workspace_size"
WORKSPACE_ENV = "SGLANG_FLASHINFER_WORKSPACE_SIZE"


def check_workspace_size(size_bytes: int, need: WorkspaceNeed, *, field_name: str = WORKSPACE_FIELD,
                         state: str = "build-mode", graph_fix: str = "", env_var: str = "",
                         raise_fits: bool = True, field_given: bool = False) -> None:
    """Raise :class:`ConfigError` (``workspace_too_small``) when ``size_bytes < need.bytes``.

    The one check of the workspace size, whichever source set it. The error names ``field_name`` and its
    value — or, when the value came from the environment (``env_var``, e.g.
    ``SGLANG_FLASHINFER_WORKSPACE_SIZE=1000``), that variable with its value first and the field after it
    (value None), as :func:`pipeline.core.validation.check_size` names a variable — the minimum this backend can
    use (``needed_bytes``: the bytes its largest planned batch needs, and the kernel path that needs them) and
    the remedy: set the field (or, unless ``field_given`` — the field set the size, and it wins over the variable —,
    the variable) to at least that — only when ``raise_fits`` (that size is a value the flag takes and the device
    can hold) —, or ``graph_fix`` (a change to the captured batch sizes that then passes) when given.
    """
    if size_bytes >= need.bytes:
        return
    worst = max(need.parts, key=need.parts.get) if need.parts else "plan"
    if env_var:
        raise ConfigError(
            f"environment variable {env_var}={size_bytes} sets a FlashInfer workspace smaller than the {need.bytes} "
            f"bytes the largest planned batch needs ({worst}): the least this backend can use here",
            code="workspace_too_small", state=state,
            flags=[(env_var, size_bytes), (field_name, None), ("needed_bytes", need.bytes)],
            allowed=[f">= {need.bytes}"],
            remedy=", or ".join(([f"set {env_var} to at least {need.bytes}"] if raise_fits else [])
                               + ([graph_fix] if graph_fix else [])),
        )
    raise ConfigError(
        f"the FlashInfer workspace of {size_bytes} bytes is smaller than the {need.bytes} bytes the "
        f"largest planned batch needs ({worst})",
        code="workspace_too_small", state=state,
        flags=[(field_name, size_bytes), ("needed_bytes", need.bytes)],
        allowed=[f">= {need.bytes}"],
        remedy=", or ".join(([f"set {field_name}{'' if field_given else f' (or {WORKSPACE_ENV})'} to at least "
                              f"{need.bytes}"] if raise_fits else [])
                            + ([graph_fix] if graph_fix else [])),
    )


def shapes_of(kinds: Iterable[Any]) -> list[HeadShape]:
    """The :class:`HeadShape` of each :class:`~pipeline.core.contracts.LayerKind` (heads, kv heads, v dim, sinks, MLA)."""
    return [HeadShape(k.num_heads, k.num_kv_heads, k.head_dim_v, k.has_sinks, bool(getattr(k, "is_mla", False)))
            for k in kinds]


def backend_need(kinds: Iterable[Any], *, backend: str, num_sms: int, max_reqs: int, graph_max_bs: int) -> int:
    """Bytes of workspace :func:`check_backend_workspace` needs (its ``need``: the least it accepts) for ``kinds``
    served by ``backend`` (``"flashinfer"`` or ``"fa3"``) with ``max_reqs`` rows and graphs up to ``graph_max_bs``
    (0: none) on ``num_sms`` SMs."""
    return workspace_need(shapes_of(kinds), cuda_graph_max_bs=graph_max_bs, num_sms=max(num_sms, 1),
                          max_batch_size=max_reqs, prefill_backend="fa3" if backend == "fa3" else "fa2").bytes


def check_backend_workspace(size_bytes: int, kinds: Iterable[Any], *, backend: str, num_sms: int, max_reqs: int,
                            graph_max_bs: int, graph_bs_given: bool = False, state: str = "build-mode",
                            env_var: str = "", max_bytes: int = 0, field_given: bool = False,
                            fits: Optional[Callable[[int, int], bool]] = None, graph_bs: Sequence[int] = (),
                            max_bs_given: bool = False) -> None:
    """The one workspace check (build-mode, ``plan`` and ``run``'s preflight call it, through the registry entry).

    ``size_bytes``: the workspace the backend gets; ``kinds``: the layer kinds it serves;
    ``backend``: ``"flashinfer"`` (fa2 kernels) or ``"fa3"``; ``num_sms``: the device's SMs;
    ``max_reqs``: rows of ``req_to_token`` (the largest eager batch); ``graph_max_bs``: the
    largest captured decode batch (:func:`states.build_mode.graph_max_bs`, 0 without graphs);
    ``graph_bs_given``: the sizes came from ``cuda_graph_bs`` (so the remedy names that list);
    ``env_var``: the environment variable the size came from ("" when the field or the default set it), named by
    the error; ``max_bytes``: the largest workspace this device can hold (0: unknown), see below; ``field_given``:
    ``flashinfer_workspace_size`` set the size (the remedy then names only it: the field wins over the variable);
    ``fits(ws, bs)``: whether each planned workspace at ``ws`` bytes fits the device beside the KV pools and the
    decode graphs up to ``bs`` (0: none) — ``plan``'s :func:`pipeline.memory.fits.fits_beside` (s12ws:
    without it the remedy named a workspace and a top whose graphs did not fit beside 2**24 rows of
    ``req_to_token``); None: only ``max_bytes`` bounds it; ``graph_bs``: the ``cuda_graph_bs`` list (when known: a
    remedy that cuts it then names the largest size it keeps, and with ``max_bs_given`` — ``cuda_graph_max_bs`` set
    too, which must equal that size — that top as well). Raises ConfigError ``workspace_too_small``.

    Every alternative of the remedy then passes this check with a value the flags take, and ``fits``:

    - a larger workspace, only when the need is at most ``min(max_bytes, MAX_BYTES)`` (``MAX_BYTES`` = 2**48, the
      ``--flashinfer-workspace-size`` domain) and fits;
    - a smaller largest captured batch that fits the workspace as it is (``cuda_graph_max_bs=N``, or the list's
      sizes up to N), N at most :data:`REMEDY_MAX_BS`;
    - when neither alone can work (the workspace cannot be raised enough and fits not even one captured request),
      both: a workspace of the need at such an N and that N;
    - when no captured batch fits at all, ``disable_cuda_graph=True`` (with the eager need as the workspace when
      the workspace is below it) if that fits.
    """
    from pipeline.core.validation import MAX_BYTES

    shapes = shapes_of(kinds)
    kw = dict(num_sms=max(num_sms, 1), max_batch_size=max_reqs, prefill_backend="fa3" if backend == "fa3" else "fa2")
    need = workspace_need(shapes, cuda_graph_max_bs=graph_max_bs, **kw)
    if size_bytes >= need.bytes:
        return
    cap = min(max_bytes, MAX_BYTES) if max_bytes > 0 else MAX_BYTES
    room = (lambda ws, bs: ws <= cap and fits(ws, bs)) if fits is not None else (lambda ws, bs: ws <= cap)  # noqa: E731
    need_at = lambda bs: workspace_need(shapes, cuda_graph_max_bs=bs, **kw).bytes  # noqa: E731
    raise_fits = room(need.bytes, graph_max_bs)
    fix = _graph_fix(size_bytes, need_at, room, top=min(graph_max_bs, max_reqs, REMEDY_MAX_BS + 1) - 1,
                     graphs=graph_max_bs > 0, sizes=_sizes_wording(graph_bs_given or bool(graph_bs), graph_bs,
                                                                   max_bs_given),
                     name=env_var or WORKSPACE_FIELD, raise_fits=raise_fits)
    check_workspace_size(size_bytes, need, state=state, graph_fix=fix, env_var=env_var, raise_fits=raise_fits,
                         field_given=field_given)


def _sizes_wording(list_given: bool, graph_bs: Sequence[int], max_bs_given: bool) -> Callable[[int], str]:
    """``sizes(n)``: the change that makes ``n`` the largest captured batch (library wording) —
    ``set cuda_graph_max_bs=n``, or with a list ``use only sizes up to n in cuda_graph_bs`` (with ``max_bs_given``,
    ``cuda_graph_max_bs`` set too, which must equal the list's largest size: ``use only sizes up to m in
    cuda_graph_bs and set cuda_graph_max_bs=m``, ``m`` the list's largest size up to ``n``) —, or "" where the list
    (when known) keeps no size."""
    def sizes(n: int) -> str:
        if not list_given:
            return f"set cuda_graph_max_bs={n}"
        m = max((b for b in graph_bs if b <= n), default=0) if graph_bs else n
        if not m:
            return ""
        return (f"use only sizes up to {m} in cuda_graph_bs and set cuda_graph_max_bs={m}" if max_bs_given
                else f"use only sizes up to {n} in cuda_graph_bs")
    return sizes


def _graph_fix(size_bytes: int, need_at: Callable[[int], int], room: Callable[[int, int], bool], *, top: int,
               graphs: bool, sizes: Callable[[int], str], name: str, raise_fits: bool) -> str:
    """The remedy's alternative that changes the captured sizes (library wording), or "": the largest top ``N`` in
    ``1..top`` whose need fits the workspace as it is and ``room(size_bytes, N)``; else, unless raising the workspace
    works (``raise_fits``), the need at the largest ``N`` with ``room(need_at(N), N)`` and that ``N``; else no graphs
    (``room`` at 0), with the eager need as the workspace when it is above ``size_bytes``. Each search is
    :func:`~pipeline.core.numbers.largest_fitting` over ``1..top``: the need and the graphs' bytes grow with ``N``
    (:func:`fa2_graph_decode_bytes` is nondecreasing in the batch, and tensor-core decode only turns on as it grows), so
    each predicate holds on a prefix.
    ``sizes``: :func:`_sizes_wording`'s (a list cut to no size is no alternative)."""
    fits = largest_fitting(range(1, top + 1), lambda bs: need_at(bs) <= size_bytes and room(size_bytes, bs))
    if fits is not None and sizes(fits):
        return sizes(fits)
    if raise_fits:
        return ""
    both = largest_fitting(range(1, top + 1), lambda bs: room(need_at(bs), bs))
    if both is not None and sizes(both):
        return f"set {name}={need_at(both)} and {sizes(both).removeprefix('set ')}"
    eager = max(need_at(0), size_bytes)
    if graphs and room(eager, 0):
        return ("set disable_cuda_graph=True" if eager == size_bytes
                else f"set {name}={eager} and disable_cuda_graph=True")
    return ""
