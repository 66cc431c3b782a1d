"""Replay: re-run a recorded start's decisions and report the first place they now differ.

Details: docs/internals.md, ``pipeline.observe.replay``.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import msgspec

from pipeline.core import events as ev, steps
from pipeline.core.contracts import SetupRequest
from pipeline.core.errors import AttnSetupError, UsageError
from pipeline.core.eventlog import REDACTED
from pipeline.observe.trace import as_trace
from pipeline.observe.runs import Run, Trace
from pipeline.setup.context import SetupContext
from pipeline.setup.table import SETUP


_IGNORED = {"secrets", "run_id", "device_spelled_as"}  # top-level request fields that decide nothing


def has_redacted(x: Any) -> bool:
    """Whether any string in ``x`` (nested lists and dicts) holds the redaction marker."""
    if isinstance(x, str):
        return REDACTED in x
    if isinstance(x, dict):
        return any(has_redacted(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_redacted(v) for v in x)
    return False


def matches_around_redaction(recorded: Any, now: Any) -> bool:
    """Whether ``now`` reads as ``recorded`` once each marker in ``recorded``'s strings stands for some non-empty
    text (structure, keys and every other value equal)."""
    if isinstance(recorded, str) and REDACTED in recorded:
        if not isinstance(now, str):
            return False
        pattern = "(?:.+)".join(re.escape(p) for p in recorded.split(REDACTED))
        return re.fullmatch(pattern, now, re.DOTALL) is not None
    if isinstance(recorded, dict):
        return (isinstance(now, dict) and recorded.keys() == now.keys()
                and all(matches_around_redaction(v, now[k]) for k, v in recorded.items()))
    if isinstance(recorded, (list, tuple)):
        return (isinstance(now, (list, tuple)) and len(recorded) == len(now)
                and all(matches_around_redaction(a, b) for a, b in zip(recorded, now)))
    return recorded == now


def redacted_request_fields(request: Any, path: str = "") -> list[str]:
    """The dotted paths of the recorded ``request``'s values that hold the marker and decide something (the
    secrets, the run id, the device's spelling and a model's ``source`` decide nothing)."""
    out: list[str] = []
    if isinstance(request, str):
        return [path] if REDACTED in request else []
    items = (request.items() if isinstance(request, dict) else enumerate(request)
             if isinstance(request, (list, tuple)) else ())
    for k, v in items:
        if (not path and k in _IGNORED) or k == "source":
            continue
        out += redacted_request_fields(v, f"{path}.{k}" if path else str(k))
    return out


def request_redacted(run_id: str, rank: int, where: str, fields: list[str]) -> UsageError:
    """``request_redacted`` (exit 2): the run's recorded request cannot be rebuilt, a secret having redacted
    ``fields``; names the run, its ``run_started`` record (``where``) and the fields."""
    shown = ", ".join(fields[:8]) + (f" and {len(fields) - 8} more" if len(fields) > 8 else "")
    return UsageError(
        f"run {run_id} rank {rank}: its run_started record{where} holds request values redacted because a secret "
        f"occurs in them ({shown}); replay cannot rebuild the request from them",
        code="request_redacted", flags=[("run_id", run_id), ("fields", fields)],
        allowed=["a recorded request whose deciding values hold no secret"],
        remedy="use secrets that do not occur in ordinary values (a device, a dtype, a backend or model name), "
               "rerun and replay that trace; 'attn-setup inspect' still shows what this run did")


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
    incomplete trace), or is empty. ``unrecorded``: ``state:record`` of each decision record missing from a run whose
    records go on past that state (a lost or unreadable line; the other decisions are still compared). ``ends_in``: for a run that never recorded its end (``inspect``'s
    ``incomplete``) whose trace ends before its last decision, the state it ends in; else empty. ``redacted``: the
    checked fields whose recorded value held a secret's ``"<redacted>"`` marker, compared around it
    (:mod:`pipeline.observe.replay`).
    """

    run_id: str
    rank: int
    checked: list[str]
    divergence: Optional[Divergence] = None
    stopped: str = ""
    launch_id: str = ""
    ends_in: str = ""
    redacted: list[str] = []
    unrecorded: list[str] = []

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


def _b(x: Any) -> Any:
    return msgspec.to_builtins(x)


def _failed_before_resolve(run: Run) -> bool:
    """The run recorded a failure in a state before resolve: the command line's (``args``, ``preflight``), a
    runner state before ``attention`` or ``device-init``; its trace holds no decision because it made none."""
    from pipeline.runtime.table import RUNNER

    f, runner = run.failure, RUNNER.order
    return f is not None and (f.state in ("args", "preflight", SETUP.order[0])
                              or (f.state in runner and runner.index(f.state) < runner.index("attention")))


def _stop_text(run: Run) -> str:
    """Where a failed run stopped: its command and exit code, the state and the recorded error code."""
    cmd, fin, f = run.first(ev.CommandStarted), run.first(ev.CommandFinished), run.failure
    who = (f"'attn-setup {cmd.command}'" if cmd is not None else "the run") + (
        f" (exit {fin.exit_code})" if fin is not None else "")
    return f"{who} failed in state {f.state!r} with {f.code}" if f is not None else f"{who} ended"


def _no_start_reason(run: Run) -> str:
    return (f"{_stop_text(run)}, before the attention pipeline started, so it made no decision to replay"
            if run.failure is not None else
            "the record is missing or unreadable (a cut or corrupt line: 'attn-setup inspect' counts the lines it "
            "skipped)")


def _no_start(run: Run) -> UsageError:
    return UsageError(f"run {run.run_id} rank {run.rank} has no run_started record: {_no_start_reason(run)}",
                      code="trace_unreadable", flags=[("run_id", run.run_id)],
                      remedy="inspect it with `attn-setup inspect`; replay a trace of a run that reached resolve")


def _nothing_to_replay(runs: list[Run]) -> UsageError:
    """``nothing_to_replay`` (exit 2): the trace reads, but every run failed before resolve, deciding nothing."""
    first = runs[0]
    whys = [f"run {r.run_id} rank {r.rank}" + (f" launch {r.launch_id}" if r.launch_id else "")
            + f": {_stop_text(r)}, before resolve" for r in runs]
    return UsageError("the trace is readable but holds no decision to replay: " + "; ".join(whys)
                      + " (replay compares what resolve and the states after it decided)",
                      code="nothing_to_replay",
                      flags=[("run_id", first.run_id), ("rank", first.rank), ("state", first.failure.state),
                             ("error_code", first.failure.code)],
                      remedy="read why it stopped with `attn-setup inspect LOG`; fix that and replay the trace of a "
                             "run that reached resolve")


def _incomplete(runs: list[RunReplay], skipped: int) -> UsageError:
    """``trace_incomplete`` (exit 2): a run's trace ends before its last decision and before the run recorded its
    end (a cut file, a process killed while it wrote): what it recorded matched, the rest cannot be compared.
    With unreadable lines skipped, the missing records may be those: ``trace_unreadable``, saying so."""
    cut = [r for r in runs if r.ends_in]
    first = cut[0]
    if skipped:
        return UsageError(f"run {first.run_id} rank {first.rank}: its readable records stop in state "
                          f"{first.ends_in!r} without the run's end, and {skipped} line(s) of the trace could not be "
                          "read: the decisions after that may be in them", code="trace_unreadable",
                          flags=[("run_id", first.run_id), ("state", first.ends_in), ("skipped_lines", skipped)],
                          remedy="`attn-setup inspect LOG --json` lists the skipped lines; replay the trace as the "
                                 "run wrote it")
    whys = [f"run {r.run_id} rank {r.rank}" + (f" launch {r.launch_id}" if r.launch_id else "")
            + f": the trace ends in state {r.ends_in!r}, before the run recorded its end; "
            + (f"the {len(r.checked)} decision(s) recorded up to there are the same now" if r.checked else
               "no decision was recorded before that") for r in cut]
    return UsageError("the trace is incomplete, so replay cannot say the start decides the same: " + "; ".join(whys)
                      + " (the rest was never written: a cut file, or a process that died while it wrote)",
                      code="trace_incomplete",
                      flags=[("run_id", first.run_id), ("rank", first.rank), ("state", first.ends_in)],
                      remedy="replay the run's whole log (`attn-setup inspect LOG` calls this one incomplete and "
                             "shows where it ends), or run the start again to record a complete trace")


def _unrecorded_error(runs: list[RunReplay], t: Trace) -> UsageError:
    """``trace_unreadable`` (exit 2): a run's records go on past a state whose decision record is not in the
    trace; names the run, the state, the record and the unreadable lines the trace skipped (it may be one)."""
    r = next(r for r in runs if r.unrecorded)
    state, event = r.unrecorded[0].split(":", 1)
    lines = [f"{s.path}:{s.line} ({s.reason})" for s in t.skipped[:3]]
    where = (f"; the trace has {t.skipped_lines} unreadable line(s), the record may be one of them: "
             + ", ".join(lines) if lines else "; no line of the trace was unreadable: the line is absent")
    more = f" (also missing: {', '.join(r.unrecorded[1:])})" if len(r.unrecorded) > 1 else ""
    return UsageError(f"run {r.run_id} rank {r.rank}" + (f" launch {r.launch_id}" if r.launch_id else "")
                      + f": state {state!r} has no {event} line although the run's records go on after it{where}"
                      + f"{more}; the other {len(r.checked)} decision(s) are the same now, but replay cannot say the "
                      "start decides the same", code="trace_unreadable",
                      flags=[("run_id", r.run_id), ("state", state), ("record", event)]
                      + ([("unreadable_lines", lines)] if lines else []),
                      remedy="replay the trace as the run wrote it (not edited or cut); `attn-setup inspect LOG` "
                             "shows what the run did")


def _cut_before_setup(run: Run) -> bool:
    """An unfinished ``run`` (or runner) trace that ends before the setup machine wrote anything: no run_started
    was lost, it was never written."""
    return (run.status == "incomplete" and (run.first(ev.CommandStarted) or run.first(ev.RunnerStarted)) is not None
            and not any(r.state in SETUP.order for r in run.records))


def _unrecorded(recorded: Any, now: Any) -> bool:
    """What a trace cut inside a state looks like: the value never written, or a list cut short of ``now``."""
    return recorded is None or (isinstance(recorded, list) and isinstance(now, list) and len(recorded) < len(now)
                                and now[:len(recorded)] == recorded)


def _unreadable(run: Run, why: str) -> UsageError:
    """trace_unreadable (exit 2) naming the run and where its run_started record is."""
    where = f" ({run.started_at[0]}:{run.started_at[1]})" if run.started_at else ""
    launch = f" launch {run.launch_id}" if run.launch_id else ""
    return UsageError(f"run {run.run_id} rank {run.rank}{launch}: its run_started record{where} {why}",
                      code="trace_unreadable",
                      flags=[("run_id", run.run_id), ("record", f"run_started{where}")],
                      remedy="replay a trace written by 'attn-setup run' (or the library) unchanged; "
                             "'attn-setup inspect' still shows what the run did")


_RECORD_OF = {"skips": "step_skipped or feature_downgraded", "setting": "setting_resolved"}


def _fewer(recorded: Any, now: Any) -> bool:
    """``recorded`` is what ``now`` would be with records lost: never written, or a list missing some of its items
    (the rest in order)."""
    if recorded is None:
        return True
    if not (isinstance(recorded, list) and isinstance(now, list) and len(recorded) < len(now)):
        return False
    rest = iter(now)
    return all(any(x == y for y in rest) for x in recorded)


class _Replayer:
    """One run's replay: its recorded inputs, and the fields compared so far."""

    def __init__(self, run: Run, skipped_lines: int = 0) -> None:
        self.run, self.skipped_lines = run, skipped_lines
        self.checked: list[str] = []
        self.redacted: list[str] = []
        self.unrecorded: list[str] = []
        started = run.started
        if started is None:
            raise _no_start(run)
        hidden = redacted_request_fields(started.request)
        if hidden:  # a secret equal to ordinary text; not trace_unreadable
            where = f" ({run.started_at[0]}:{run.started_at[1]})" if run.started_at else ""
            raise request_redacted(run.run_id, run.rank, where, hidden)
        try:
            self.req = msgspec.convert(started.request, SetupRequest)
        except (msgspec.ValidationError, AttnSetupError) as e:
            msg = e.info.message if isinstance(e, AttnSetupError) else str(e)
            raise _unreadable(run, f"holds a request this version cannot rebuild: {msg}") from None
        self.installed = dict(started.packages)
        self.env = {s.env_var: str(s.value) for s in run.all(ev.SettingResolved) if s.source == "env" and s.env_var}
        end = next((r for r in run.records if isinstance(r, (ev.RunFailed, ev.RunInterrupted))), None)
        self.error = None if end is None else end.error
        self.incomplete = run.status == "incomplete"  # no terminal record: the trace may end inside a state
        moves = run.all(ev.StateTransition)
        # the setup state the trace ends in (the one it left for 'failed' when the failure record was cut off)
        self.last = (moves[-1].from_state if moves[-1].to == "failed" else moves[-1].to) if moves else SETUP.order[0]

    def check(self, state: str, fld: str, recorded: Any, now: Any) -> None:
        recorded, now = _b(recorded), _b(now)
        if recorded != now and self.incomplete and state == self.last and _unrecorded(recorded, now):
            raise steps.Stop(f"the trace ends in {state} before it recorded {fld}")  # compare only what was written
        if recorded != now and self.skipped_lines and _fewer(recorded, now):  # the rest may be the unreadable lines
            raise steps.Unrecorded(state, _RECORD_OF.get(fld.split(".", 1)[0], f"{fld} record"))
        self.checked.append(f"{state}.{fld}")
        if recorded != now:
            if has_redacted(recorded) and matches_around_redaction(recorded, now):
                self.redacted.append(f"{state}.{fld}")  # the marker stands for text we cannot know
                return
            raise _Diverged(Divergence(state=state, field=fld, recorded=recorded, now=now))

    def replay(self) -> RunReplay:
        run = self.run
        facts = run.first(ev.DeviceInitialized)
        stopped = "device-init recorded no device facts (the device itself failed, or the trace ends)"
        if facts is None and any(r.state in SETUP.order[1:] for r in run.records):  # the run went on past it
            self.unrecorded.append(f"{SETUP.order[0]}:{ev.event_name(ev.DeviceInitialized)}")
        try:
            if facts is not None:
                ctx = SetupContext(self.req, facts=facts.facts, installed=self.installed, env=self.env)
                steps.replay(SETUP, ctx, run, self.error, self.check,
                             missing=lambda state, event: self.unrecorded.append(f"{state}:{event}"))
                stopped = ""
        except _Diverged as e:
            return RunReplay(run_id=run.run_id, rank=run.rank, checked=self.checked, divergence=e.d,
                             launch_id=run.launch_id, redacted=self.redacted, unrecorded=self.unrecorded)
        except steps.Stop as e:
            stopped = str(e)
        ends_in = self.last if stopped and self.incomplete else ""
        return RunReplay(run_id=run.run_id, rank=run.rank, checked=self.checked, stopped=stopped,
                         launch_id=run.launch_id, ends_in=ends_in, redacted=self.redacted, unrecorded=self.unrecorded)


def _replay_run(run: Run, skipped_lines: int = 0) -> RunReplay:
    """One run's replay; a recorded input this version cannot even use is ``trace_unreadable``."""
    try:
        return _Replayer(run, skipped_lines).replay()
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
    """Re-run every recorded run's decisions; see docs/internals.md, ``pipeline.observe.replay``.

    Parameters
    ----------
    trace: a trace path (str/PathLike), a list of paths, a :class:`~pipeline.observe.runs.Trace`, a
        :class:`~pipeline.observe.runs.Run` or a list of event records.

    Returns :class:`ReplayResult` (``.same``, ``.divergence`` = (state, field, recorded, now)). A
    run without ``run_started`` (a launch refused before the attention pipeline started, next to
    other launches of the same run id) is reported as stopped there, not compared.
    Raises :class:`UsageError` (``trace_unreadable``, exit 2) when no record is readable, when no
    run has a ``run_started`` record and no failure before resolve explains it (the record may be a
    lost line), or when a run's recorded request or inputs cannot be used by this version
    (the error names the run and its ``run_started`` record's file and line); ``nothing_to_replay``
    (exit 2) when the trace reads but no run got to a decision because each recorded a failure before
    resolve (a ``run`` refused at its flags, in preflight, a runner state before ``attention`` or at
    device-init): the error names each run, the state it failed in and its recorded error code;
    ``trace_incomplete`` (exit 2) when no run diverged but a run's trace ends before its last decision without
    recording its end (``inspect``'s ``incomplete``): only what was recorded is compared, and the error names
    each such run and the state its trace ends in. Never raises anything else for any file content.
    """
    t: Trace = as_trace(trace).require_records()
    early = all(_failed_before_resolve(r) for r in t.runs)  # no decision, and the recorded failure says why
    if not any(r.started is not None or _cut_before_setup(r) for r in t.runs) and not early:
        raise _no_start(t.runs[0])
    runs = []
    for r in t.runs:
        if r.started is None:
            cut = _cut_before_setup(r)
            runs.append(RunReplay(run_id=r.run_id, rank=r.rank, checked=[], launch_id=r.launch_id,
                                  stopped="the trace ends before the attention pipeline started" if cut else
                                  f"no run_started record: {_no_start_reason(r)}", ends_in=r.last_state if cut else ""))
        else:
            runs.append(_replay_run(r, t.skipped_lines))
    if early and not any(r.checked or r.divergence is not None for r in runs):
        raise _nothing_to_replay(t.runs)
    if any(r.ends_in for r in runs) and not any(r.divergence is not None for r in runs):
        raise _incomplete(runs, t.skipped_lines)
    if any(r.unrecorded for r in runs) and not any(r.divergence is not None for r in runs):
        raise _unrecorded_error(runs, t)
    return ReplayResult(runs=runs, skipped_lines=t.skipped_lines)

