"""The library entry point: walk the setup table (:data:`pipeline.setup.table.SETUP`) and return
:class:`~pipeline.setup.result.AttentionBackends`; and the same decisions without effect (``plan``, preflight)
(docs/internals.md)."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Mapping, Optional

from pipeline.core import events as ev, steps
from pipeline.core.contracts import DeviceFacts, SetupRequest
from pipeline.core.errors import error_info_from, OrderingError, UsageError
from pipeline.core.eventlog import EventLog, new_run_id, redacted_request, versions
from pipeline.core.faults import Faults
from pipeline.core.steps import TableMachine
from pipeline.platforms import platform_for, Platform
from pipeline.setup.context import SetupContext
from pipeline.setup.result import AttentionBackends, release
from pipeline.setup.table import SETUP


def inputs_of(request: SetupRequest, installed: Optional[Mapping[str, bool]]) -> tuple:
    """What setup decisions depend on: a decision made for equal inputs is taken as is."""
    return (request.args, request.served_model, request.is_draft_worker, request.device, request.rank,
            request.world_size, request.pool.max_reqs, None if installed is None else dict(installed))


def decide_setup(request: SetupRequest, *, platform: Optional[Platform] = None, facts: Optional[DeviceFacts] = None,
                 installed: Optional[Mapping[str, bool]] = None, env: Mapping[str, str] = os.environ,
                 rank_group: Any = None) -> steps.Decided:
    """Every setup decision up to allocation, nothing applied: the setup table in decide mode. ``facts``: device facts
    (``plan``: a profile), else read from ``platform``; ``installed``: package presence, else imports checked against
    metadata. Returns the :class:`~pipeline.core.steps.Decided` of device-init, resolve, build-mode and npu-lazy-mem, or
    the first refusal; ``build_attention_backends(..., decided=)`` reuses it."""
    if facts is None and platform is None:
        platform = platform_for(request.device)
    ctx = SetupContext(request, platform=platform, facts=facts, installed=installed, env=env, rank_group=rank_group)
    return steps.decide(SETUP, ctx, inputs=inputs_of(request, installed))


def decide_offline(request: SetupRequest, device: DeviceFacts, installed: Mapping[str, bool]) -> tuple[Any, Any]:
    """``(Resolution, BuildPlan)`` for ``request`` on ``device`` with no device touched (:func:`decide_setup` on
    the given facts; what ``attn-setup plan`` decides). Raises the typed ConfigError of the first refusal."""
    decided = decide_setup(request, facts=device, installed=installed).raise_refusal()
    return decided["resolve"], decided["build-mode"].plan


def result(ctx: SetupContext) -> AttentionBackends:
    """What the engine gets: the built backends (sglang's attribute names) and what the run decided."""
    built, res = ctx.built, ctx.resolution
    return AttentionBackends(
        attn_backend=built.attn_backend, decode_attn_backend=built.decode_attn_backend,
        decode_attn_backend_group=list(built.decode_attn_backend_group),
        prefill_attention_backend_str=res.pair.prefill, decode_attention_backend_str=res.pair.decode,
        run_id=ctx.log.run_id, resolution=res, plan=built.plan, skips=list(res.skips) + list(built.plan.skips),
        instances=dict(built.instances), pools={} if ctx.given_pools is not None else ctx.pools,
        workspace_pool=ctx.workspace_pool, events=ctx.log.records, torch_device=ctx.torch_device,
        device_facts=ctx.device.facts, graphs=ctx.build.graphs, lazy_mem=ctx.lazy.decision, agreement=ctx.agreement,
        settings=list(ctx.build.settings) + [ctx.lazy.setting])


def _hand_over(ctx: SetupContext) -> None:
    """Hand backends, workspaces and pools to the caller's :class:`AttentionBackends`: the context drops its references
    and machine (a reference cycle), so ``close()`` frees memory at once."""
    _drop_built(ctx)
    ctx.machine = None


def _drop_built(ctx: SetupContext) -> None:
    """The context forgets the backends, workspaces and pools it built (their owner now is the result, or nobody)."""
    ctx.pools, ctx.workspace_pool = {}, None
    ctx.built.instances.clear()
    ctx.built.attn_backend = ctx.built.decode_attn_backend = None
    ctx.built.decode_attn_backend_group = []


def _fail(ctx: Optional[SetupContext], log: EventLog, exc: BaseException) -> None:
    """The machine to ``failed``, everything built released, ``run_failed`` logged with the ErrorInfo (only the
    record when the context or its machine never came to be)."""
    failed = SETUP.failed
    if ctx is None or ctx.machine is None:
        log.emit(ev.RunFailed, state=failed, outcome="failed", error=error_info_from(exc, SETUP.steps[0].state))
        return
    info = error_info_from(exc, ctx.state)
    released = release(ctx.built.instances, ctx.workspace_pool, {} if ctx.given_pools is not None else ctx.pools)
    # Drop every reference this run holds, so a caller keeping the exception (and with it these frames)
    # keeps no device memory alive either.
    _drop_built(ctx)
    if ctx.state not in SETUP.terminal:
        ctx.machine.fire("fail")
    if released:
        ctx.log.emit(ev.ResourcesReleased, state=failed, released=released)
    ctx.log.emit(ev.RunFailed, state=failed, outcome="failed", error=info, released=released)


def _check_call(request: Any, pools: Any) -> None:
    if not isinstance(request, SetupRequest):
        raise UsageError(f"build_attention_backends needs a SetupRequest, got {type(request).__name__}",
                         code="usage", flags=[("request", type(request).__name__)], allowed=["SetupRequest"],
                         remedy="build one: SetupRequest(args=AttentionArgs(...), model=load_model_spec(path))")
    if pools is not None and not isinstance(pools, Mapping):
        raise UsageError(f"pools must be a dict of the engine's pools, got {type(pools).__name__}", code="usage",
                         flags=[("pools", type(pools).__name__)],
                         allowed=["{'req_to_token_pool': ReqToTokenPool, 'kv_pool': KVPool}", "None"],
                         remedy="pass pools=None to let the pipeline build them")


def _context(request: SetupRequest, log: EventLog, **kw: Any) -> SetupContext:
    ctx = SetupContext(request, log=log, **kw)

    def moved(src: Any, dst: Any, trigger: str, ms: float) -> None:
        if ctx.watch is not None:
            ctx.watch.beat(dst.value if dst.value != SETUP.failed else f"failed in {src.value}")
        log.emit(SETUP.event, state=dst.value, outcome="failed" if dst.value == SETUP.failed else "ok",
                 from_state=src.value, to=dst.value, trigger=trigger, duration_ms=ms)

    ctx.machine = TableMachine(SETUP, ctx.model, on_transition=moved)
    if ctx.watch is not None:  # heartbeats for the whole run, so a peer waiting on us can say where we are
        ctx.beats = ctx.watch.running(log)
        ctx.beats.__enter__()
    return ctx


def _run_log(request: SetupRequest, log: Optional[EventLog], log_file: Any, rank_group: Any) -> tuple[EventLog, bool]:
    """``(the run's EventLog, whether this call opened it)``: the caller's ``log``, or one opened for ``log_file``
    (:func:`open_event_log`) under the run id — the request's, else the rank group's, else a new one."""
    if log is not None:
        return log, False
    run_id = request.run_id or getattr(rank_group, "run_id", None) or new_run_id()
    return open_event_log(run_id, request.rank, log_file, tuple(request.secrets.values())), True


def _end_heartbeats(ctx: Optional[SetupContext]) -> None:
    if ctx is not None and ctx.beats is not None:
        ctx.beats.__exit__(None, None, None)


def build_attention_backends(request: SetupRequest, *, platform: Optional[Platform] = None,
                             log: Optional[EventLog] = None, log_file: Optional[str] = None,
                             pools: Optional[dict[str, Any]] = None,
                             installed: Optional[Mapping[str, bool]] = None,
                             cpu_group: Any = None, rank_group: Any = None,
                             faults: Optional[Faults] = None,
                             decided: Optional[steps.Decided] = None) -> AttentionBackends:
    """Run ``device-init → resolve → build-mode → npu-lazy-mem → annotate → done`` (the setup table).

    ``request``: the immutable inputs; ``platform``: default from ``request.device``; ``log`` / ``log_file``: an
    :class:`EventLog` or a trace path (:func:`open_event_log`); ``pools``: the engine's own ``{"req_to_token_pool",
    "kv_pool"}`` (default: built from ``request.pool``); ``installed``: package override; ``cpu_group``: for NPU lazy
    memory; ``rank_group``: a :class:`pipeline.setup.distributed.RankGroup` when ``world_size > 1`` (resolution
    exchanged, :class:`RankDivergence` on all ranks; its run id and CPU group as defaults); ``faults``: test-only;
    ``decided``: :func:`decide_setup`'s result for the same inputs.

    Returns :class:`AttentionBackends`. Raises the typed error of the failure after ``failed`` was entered, logged and
    everything released; :class:`UsageError` before starting for a non-SetupRequest, non-dict pools or a bad
    ``log_file``.
    """
    _check_call(request, pools)
    log, own_log = _run_log(request, log, log_file, rank_group)
    if decided is not None and decided.inputs != inputs_of(request, installed):
        decided = None
    ctx, t0 = None, time.perf_counter()
    try:
        ctx = _context(request, log, platform=platform or platform_for(request.device), installed=installed,
                       pools=pools, cpu_group=cpu_group, rank_group=rank_group, faults=faults)
        log.emit(ev.RunStarted, state=ctx.state, request=redacted_request(request), versions=versions(ctx.installed),
                 packages=ctx.installed, platform=type(ctx.platform).__name__)
        steps.run(SETUP, ctx, ctx.machine, faults=faults, given=decided)
        out = result(ctx)
        _hand_over(ctx)
        log.emit(ev.RunFinished, state=SETUP.success, duration_ms=(time.perf_counter() - t0) * 1e3)
        return out
    except BaseException as exc:
        _fail(ctx, log, exc)
        # The traceback's frames (factories, states) still reference pools, workspaces and backends;
        # clear their locals so a caller who keeps the exception keeps no device memory alive.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        _end_heartbeats(ctx)
        if own_log:
            log.close()


def open_event_log(run_id: str, rank: int, log_file: Any, secrets: tuple[str, ...] = (),
                   name: str = "log_file") -> EventLog:
    """The EventLog for ``log_file=`` (None or a path, absent or a regular file; parents created). Raises
    :class:`UsageError` (``log_file_unwritable``, exit 2) naming ``name`` for another type, a directory, device, FIFO or
    socket, or a path that cannot be opened for appending."""
    import stat

    if log_file is None:
        return EventLog(run_id, rank, None, secrets=secrets)

    def bad(why: str) -> UsageError:
        return UsageError(f"{name}={os.fspath(log_file) if isinstance(log_file, (str, os.PathLike)) else log_file!r} "
                          f"{why}", code="log_file_unwritable", flags=[(name, str(log_file))],
                          allowed=["a path to a regular file (created if absent)"],
                          remedy=f"pass {name}= a writable file path such as logs/attn.rank0.jsonl, or None")

    if not isinstance(log_file, (str, os.PathLike)) or isinstance(log_file, bytes) or not os.fspath(log_file):
        raise bad("is not a file path")
    try:
        mode = os.stat(log_file).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise bad(f"cannot be checked: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise bad("is a directory")
    if mode is not None and not stat.S_ISREG(mode):
        raise bad("is not a regular file (a device, FIFO or socket)")
    try:
        return EventLog(run_id, rank, log_file, secrets=secrets)
    except OSError as e:
        raise bad(f"cannot be opened for appending: {e.strerror or e}") from None


class ModelRunnerAttention:
    """sglang ModelRunner's attention attributes, filled by :meth:`init_attention_backends`; parameters as
    :func:`build_attention_backends`."""

    def __init__(self, request: SetupRequest, *, pools: Optional[dict[str, Any]] = None, platform: Any = None,
                 log_file: Optional[str] = None, cpu_group: Any = None, rank_group: Any = None,
                 installed: Optional[dict[str, bool]] = None) -> None:
        self.request = request
        self._kw = dict(pools=pools, platform=platform, log_file=log_file, cpu_group=cpu_group, rank_group=rank_group,
                        installed=installed)
        self.attn_backend: Any = None
        self.decode_attn_backend: Any = None
        self.decode_attn_backend_group: list[Any] = []
        self.prefill_attention_backend_str: Optional[str] = None
        self.decode_attention_backend_str: Optional[str] = None
        self.result: Any = None

    def init_attention_backends(self) -> None:
        """Run the pipeline and set the attributes (typed errors unchanged); OrderingError (``out_of_order``) on a
        second call."""
        if self.result is not None:
            raise OrderingError("init_attention_backends() already ran for this runner", state="done",
                                flags=[("attn_backend", type(self.attn_backend).__name__)],
                                remedy="call it once per model runner; close() and build a new one to re-initialise")

        out = build_attention_backends(self.request, **self._kw)
        self.result = out
        self.attn_backend = out.attn_backend
        self.decode_attn_backend = out.decode_attn_backend
        self.decode_attn_backend_group = out.decode_attn_backend_group
        self.prefill_attention_backend_str = out.prefill_attention_backend_str
        self.decode_attention_backend_str = out.decode_attention_backend_str

    def close(self) -> list[str]:
        """Release what the pipeline built (not the engine's pools) and return it; afterwards the backend attributes
        raise :class:`~pipeline.core.errors.BackendClosed` (None / None / [] before ``init_attention_backends()``)."""
        from pipeline.setup.result import BACKEND_ACCESSORS

        if self.result is None:
            return []
        released = self.result.close()
        for name in BACKEND_ACCESSORS:
            self.__dict__.pop(name, None)
        return released

    def __getattr__(self, name: str) -> Any:
        """Only called for an attribute that is not there: a backend attribute after :meth:`close`."""
        from pipeline.setup.result import BACKEND_ACCESSORS, closed_error

        result = self.__dict__.get("result")
        if name in BACKEND_ACCESSORS and result is not None and result.closed:
            raise closed_error(type(self).__name__, name, result.run_id)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

