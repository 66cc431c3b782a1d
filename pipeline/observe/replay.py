"""Replay: re-run a recorded start's decisions and report the first place they now differ.

``pipeline.replay(trace)`` takes a trace (path, paths, :class:`~pipeline.observe.trace.Trace`, a run or a
list of records). For each run it rebuilds the :class:`SetupRequest` from ``run_started``, builds a
:class:`~pipeline.platforms.fake.FakePlatform` from the recorded ``device_initialized`` facts and
re-runs the pure decision functions of :mod:`states` in pipeline order — ``device_init.decide_blas``,
``resolve.decide``, the settings rules, ``build_mode.decide``, ``npu_lazy_mem.decide`` — with the
*recorded* inputs: package presence from ``run_started.packages`` and environment-backed settings
from the ``setting_resolved`` records (never the current environment). No GPU is touched and no
backend is constructed. A recorded failure in a decision state must fail again with the same error
code; a failure in an effect (building a backend, the device itself) ends the comparison there.

The module object is itself callable (``pipeline.replay(trace)`` works whether ``pipeline.replay``
resolves to this module or to :func:`replay`). Nothing here imports torch.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core import settings
from pipeline.core.contracts import DeviceFacts, SetupRequest
from pipeline.core.errors import AttnSetupError, UsageError
from pipeline.observe.trace import Run, Trace, as_trace


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """The first decision that differs: in ``state``, ``field`` was ``recorded`` and is ``now``."""

    state: str
    field: str
    recorded: Any = None
    now: Any = None

    def __str__(self) -> str:
        return f"{self.state}: {self.field}: recorded {self.recorded!r}, now {self.now!r}"


class RunReplay(msgspec.Struct, frozen=True, kw_only=True):
    """One run's replay: ``checked`` lists the fields compared (in order); ``divergence`` or None.

    ``stopped`` says why comparison ended before ``done`` (a recorded effect failure, an
    incomplete trace), or is empty.
    """

    run_id: str
    rank: int
    checked: list[str]
    divergence: Optional[Divergence] = None
    stopped: str = ""
    launch_id: str = ""

    @property
    def same(self) -> bool:
        return self.divergence is None


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    """Every run's replay; ``same`` when no run diverged; ``divergence`` is the first found."""

    runs: list[RunReplay]
    skipped_lines: int = 0

    @property
    def same(self) -> bool:
        return all(r.same for r in self.runs)

    @property
    def divergence(self) -> Optional[Divergence]:
        return next((r.divergence for r in self.runs if r.divergence is not None), None)


class _Diverged(Exception):
    def __init__(self, d: Divergence) -> None:
        super().__init__(str(d))
        self.d = d


class _Stop(Exception):
    """Comparison cannot continue (the recorded run ended here)."""


def _b(x: Any) -> Any:
    return msgspec.to_builtins(x)


def _no_start_reason(run: Run) -> str:
    return (f"it failed in {run.failure.state!r} before the attention pipeline started, so it made no "
            "decision to replay" if run.failure is not None else "its first records are missing (truncated?)")


def _no_start(run: Run) -> UsageError:
    return UsageError(f"run {run.run_id} rank {run.rank} has no run_started record: {_no_start_reason(run)}",
                      code="trace_unreadable", flags=[("run_id", run.run_id)],
                      remedy="inspect it with `attn-setup inspect`; replay a trace of a run that reached resolve")


def _unreadable(run: Run, why: str) -> UsageError:
    """trace_unreadable (exit 2) naming the run and where its run_started record is."""
    where = f" ({run.started_at[0]}:{run.started_at[1]})" if run.started_at else ""
    launch = f" launch {run.launch_id}" if run.launch_id else ""
    return UsageError(f"run {run.run_id} rank {run.rank}{launch}: its run_started record{where} {why}",
                      code="trace_unreadable",
                      flags=[("run_id", run.run_id), ("record", f"run_started{where}")],
                      remedy="replay a trace written by 'attn-setup run' (or the library) unchanged; "
                             "'attn-setup inspect' still shows what the run did")


class _Replayer:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.checked: list[str] = []
        started = run.started
        if started is None:
            raise _no_start(run)
        try:
            self.req = msgspec.convert(started.request, SetupRequest)
        except (msgspec.ValidationError, AttnSetupError) as e:
            msg = e.info.message if isinstance(e, AttnSetupError) else str(e)
            raise _unreadable(run, f"holds a request this version cannot rebuild: {msg}") from None
        self.installed = dict(started.packages)
        self.failure = next((r for r in run.records if isinstance(r, (ev.RunFailed, ev.RunInterrupted))), None)

    def check(self, state: str, fld: str, recorded: Any, now: Any) -> None:
        self.checked.append(f"{state}.{fld}")
        if _b(recorded) != _b(now):
            raise _Diverged(Divergence(state=state, field=fld, recorded=_b(recorded), now=_b(now)))

    def decide(self, state: str, fn: Callable[[], Any]) -> Any:
        """Run a decision; a typed error must match a recorded failure in ``state``."""
        try:
            out = fn()
        except AttnSetupError as e:
            rec = self.failure.error if self.failure is not None and self.failure.error.state == state else None
            self.check(state, "error.code", rec.code if rec else None, e.info.code)
            self.check(state, "error.message", rec.message, e.info.message)
            raise _Stop(f"failed in {state} as recorded")
        if self.failure is not None and self.failure.error.state == state and self.failure.error.code != "interrupted":
            if not self._effect_failure(state):
                self.check(state, "error.code", self.failure.error.code, None)
        return out

    def _effect_failure(self, state: str) -> bool:
        """True when the recorded failure in ``state`` came after its decision (an effect failed)."""
        decision = {"device-init": ev.DeviceInitialized, "resolve": ev.BackendsResolved,
                    "build-mode": ev.BuildPlanned, "npu-lazy-mem": ev.StepSkipped}.get(state)
        return decision is not None and any(r.state == state for r in self.run.all(decision))

    def need(self, cls: type, state: str) -> Any:
        rec = self.run.first(cls)
        if rec is None:
            raise _Stop(f"the trace ends before {state} recorded its decision")
        return rec

    def setting(self, name: str, compute: Callable[[dict[str, str]], tuple[int, str]], state: str) -> tuple[int, str]:
        """Recompute a field > env > default setting with the recorded env value; compare it."""
        rec = next((s for s in self.run.all(ev.SettingResolved) if s.field == name), None)
        env = {rec.env_var: str(rec.value)} if rec is not None and rec.source == "env" and rec.env_var else {}
        recorded = None if rec is None else [rec.value, rec.source]
        try:
            value, source = compute(env)
        except AttnSetupError as e:  # the recorded value is refused now: that is a divergence
            self.check(state, f"setting.{name}", recorded, f"refused: {e.info.code}")
            raise
        self.check(state, f"setting.{name}", recorded, [value, source])
        return value, source

    # -- the states, in pipeline order -------------------------------------------------------------
    def device_init(self) -> DeviceFacts:
        from pipeline.platforms import parse_device
        from pipeline.platforms.fake import FakePlatform
        from states import device_init

        rec = self.run.first(ev.DeviceInitialized)
        if rec is None:
            raise _Stop("device-init recorded no device facts (the device itself failed, or the trace ends)")
        _, index = parse_device(self.req.device)
        facts, _ = device_init.apply(FakePlatform(rec.facts), index)
        self.check("device-init", "blas_init", rec.blas_init, device_init.decide_blas(facts.type))
        return facts

    def resolve(self, facts: DeviceFacts) -> Any:
        from states import resolve

        res = self.decide("resolve", lambda: resolve.decide(
            self.req.args, self.req.served_model, facts, is_draft_worker=self.req.is_draft_worker,
            installed=self.installed))
        rec = self.need(ev.BackendsResolved, "resolve")
        dt = next((s for s in self.run.all(ev.SettingResolved) if s.field == "dtype"), None)
        if dt is not None and res.dtype is not None:  # traces from before the dtype rule record none
            self.check("resolve", "setting.dtype", [dt.value, dt.source], [res.dtype.value, res.dtype.source])
        for fld, now in (("prefill", res.pair.prefill), ("decode", res.pair.decode),
                         ("is_draft_override", res.pair.is_draft_override), ("rules", dict(res.rules)),
                         ("rejected", res.rejected), ("not_attention", res.not_attention)):
            self.check("resolve", fld, getattr(rec, fld), now)
        self.check("resolve", "skips", self._skips("resolve"), [[s.what, s.reason] for s in res.skips])
        fb = self.run.first(ev.ReferenceFallback)
        now = resolve.reference_fallback(res, facts)
        self.check("resolve", "reference_fallback", None if fb is None else fb.halves,
                   None if now is None else now.what.split("+"))
        return res

    def _skips(self, state: str) -> list[list[str]]:
        """Recorded skips of ``state``: downgrades, and features that did not apply (``step_skipped``
        ``cuda_graph``; traces before that split logged those as ``feature_downgraded`` too)."""
        return [[r.what, r.reason] for r in self.run.records if r.state == state and (
            isinstance(r, ev.FeatureDowngraded) or (isinstance(r, ev.StepSkipped) and r.what == "cuda_graph"))]

    def build_mode(self, res: Any) -> Any:
        from pipeline.backends import registry
        from states import build_mode

        model, pair = self.req.served_model, res.pair
        ws: dict[str, int] = {}  # backend → workspace bytes, each logged setting compared once
        by_field: dict[str, int] = {}
        for backend in dict.fromkeys((pair.prefill, pair.decode)):
            entry = registry.get(backend)
            field = entry.workspace(self.req.args, model, {}).field
            if not field:  # nothing logged: the record's bytes
                ws[backend] = entry.workspace(self.req.args, model, {}).value
            elif field not in by_field:
                by_field[field] = self.setting(field, lambda env, e=entry: (lambda s: (s.value, s.source))(
                    e.workspace(self.req.args, model, env)), "build-mode")[0]
            ws[backend] = ws.get(backend, by_field.get(field, 0))

        def ws_bytes(backend: str) -> int:
            return ws[backend]

        plan = self.decide("build-mode", lambda: build_mode.decide(
            self.req.args, pair, is_draft_worker=self.req.is_draft_worker, workspace_bytes=ws_bytes))
        rec = self.need(ev.BuildPlanned, "build-mode")
        for fld in ("mode", "hybrid", "instances", "workspaces"):
            self.check("build-mode", fld, getattr(rec, fld), getattr(plan, fld))
        self.check("build-mode", "skips", self._skips("build-mode"), [[s.what, s.reason] for s in plan.skips])
        if self.failure is not None and self.failure.error.state == "build-mode":
            raise _Stop(f"building failed as recorded ({self.failure.error.code}): an effect, not replayed")
        return plan

    def npu_lazy_mem(self, facts: DeviceFacts) -> None:
        from states import npu_lazy_mem

        if self.run.first(ev.StateTransition) is None or "npu-lazy-mem" not in {
                t.to for t in self.run.all(ev.StateTransition)}:
            raise _Stop("the trace ends before npu-lazy-mem")
        size, source = self.setting("zbal_local_mem_size",
                                    lambda env: settings.zbal_local_mem_size(self.req.args, env=env), "npu-lazy-mem")
        d = self.decide("npu-lazy-mem", lambda: npu_lazy_mem.decide(facts.type, size, source,
                                                                     self.req.is_draft_worker))
        lazy = self.run.first(ev.LazyMemInitialized)
        skip = next((s for s in self.run.all(ev.StepSkipped) if s.what == "npu_lazy_mem"), None)
        if lazy is None and skip is None:
            raise _Stop("the trace ends before npu-lazy-mem recorded its decision")
        self.check("npu-lazy-mem", "run", lazy is not None, d.run)
        if d.run:
            self.check("npu-lazy-mem", "bytes", lazy.bytes, d.nbytes)
        else:
            self.check("npu-lazy-mem", "reason", skip.reason, d.reason)

    def annotate(self, res: Any) -> None:
        rec = self.need(ev.BackendsAnnotated, "annotate")
        self.check("annotate", "names", [rec.prefill, rec.decode], [res.pair.prefill, res.pair.decode])

    def replay(self) -> RunReplay:
        stopped = ""
        try:
            facts = self.device_init()
            res = self.resolve(facts)
            self.build_mode(res)
            self.npu_lazy_mem(facts)
            self.annotate(res)
        except _Diverged as e:
            return RunReplay(run_id=self.run.run_id, rank=self.run.rank, checked=self.checked, divergence=e.d,
                             launch_id=self.run.launch_id)
        except _Stop as e:
            stopped = str(e)
        return RunReplay(run_id=self.run.run_id, rank=self.run.rank, checked=self.checked, stopped=stopped,
                         launch_id=self.run.launch_id)


def _replay_run(run: Run) -> RunReplay:
    """One run's replay; a recorded input this version cannot even use is ``trace_unreadable``."""
    try:
        return _Replayer(run).replay()
    except _Diverged as e:  # a divergence found outside a state (a refused recorded setting)
        return RunReplay(run_id=run.run_id, rank=run.rank, checked=[], divergence=e.d, launch_id=run.launch_id)
    except UsageError:
        raise
    except (AttnSetupError, msgspec.ValidationError) as e:
        msg = e.info.message if isinstance(e, AttnSetupError) else str(e)
        raise _unreadable(run, f"holds inputs this version refuses: {msg}") from None
    except Exception as e:  # noqa: BLE001 - recorded values no real run writes: unreadable, never a traceback
        raise _unreadable(run, f"holds inputs this version cannot replay ({type(e).__name__}: {e})") from None


def replay(trace: Any) -> ReplayResult:
    """Re-run every recorded run's decisions; see the module docstring.

    Parameters
    ----------
    trace: a trace path (str/PathLike), a list of paths, a :class:`~pipeline.observe.trace.Trace`, a
        :class:`~pipeline.observe.trace.Run` or a list of event records.

    Returns :class:`ReplayResult` (``.same``, ``.divergence`` = (state, field, recorded, now)). A
    run without ``run_started`` (a launch refused before the attention pipeline started, next to
    other launches of the same run id) is reported as stopped there, not compared.
    Raises :class:`UsageError` (``trace_unreadable``, exit 2) when no record is readable, when no
    run has a ``run_started`` record (nothing to replay from), or when a run's recorded request or
    inputs cannot be used by this version (the error names the run and its ``run_started``
    record's file and line). Never raises anything else for any file content.
    """
    t: Trace = as_trace(trace).require_records()
    if not any(r.started is not None for r in t.runs):
        raise _no_start(t.runs[0])
    runs = []
    for r in t.runs:
        if r.started is None:
            runs.append(RunReplay(run_id=r.run_id, rank=r.rank, checked=[], launch_id=r.launch_id,
                                  stopped=f"no run_started record: {_no_start_reason(r)}"))
        else:
            runs.append(_replay_run(r))
    return ReplayResult(runs=runs, skipped_lines=t.skipped_lines)


class _CallableModule(types.ModuleType):
    def __call__(self, trace: Any) -> ReplayResult:
        return replay(trace)


sys.modules[__name__].__class__ = _CallableModule
