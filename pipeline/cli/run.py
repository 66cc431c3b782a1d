"""``attn-setup run``: the runner flow, then verification on real batches.

Details: docs/internals.md, ``pipeline.cli.run``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import msgspec
from rich.markup import escape

from pipeline.cli import output as rp
from pipeline.cli.flags import device_as_written, device_of, is_gpu_device, request_from
from pipeline.cli.output import settle
from pipeline.cli.startup import slow_warnings
from pipeline.core import events as ev
from pipeline.core.contracts import ErrorInfo, ModelSpec, SetupRequest
from pipeline.core.errors import (AttnSetupError, ConfigError, error_info_from, EXIT_FAILED,
    EXIT_OK, INTERRUPTED_REMEDY, UsageError, interrupt_signal, signal_exit_code)
from pipeline.core.numbers import ascii_float, ascii_int
from pipeline.memory.pools import weight_bytes


MEMORY_NOTICE_BYTES = 4 << 30   # weights + their float64 reference copy above this: say so
MANY_STEPS = 30                 # more decode steps than this: say so


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def run_notices(ns: argparse.Namespace, request: Any, num_layers: int, in_torchrun: bool) -> list[str]:
    """The notices for this run (empty when none applies); see docs/internals.md, ``pipeline.cli.run``."""
    from states.capability_check import model_dtype

    out = []
    if ns.world_size > 1 and not in_torchrun:
        out.append(f"--world-size {ns.world_size} outside torchrun: this process runs rank {ns.rank} alone (no "
                   "rank group, the rank agreement is skipped); launch every rank with 'torchrun --nproc-per-node "
                   f"{ns.world_size} -m pipeline.cli run …' (it sets RANK/WORLD_SIZE) for a real group")
    model = request.served_model
    dtype = model_dtype(request.args, model)
    own, ref = weight_bytes(model, num_layers, dtype)
    if own + ref > MEMORY_NOTICE_BYTES:
        out.append(f"{num_layers} attention layers need about {_gib(own + ref)} of host memory for the weights "
                   f"({_gib(own)}) and the float64 verification reference ({_gib(ref)}), and minutes on a CPU; "
                   + _fewer(model, num_layers, dtype))
    if ns.decode_steps > MANY_STEPS:
        out.append(f"--decode-steps {ns.decode_steps}: every step is checked against a reference over the whole "
                   f"history, so this takes longer (100 steps: about a minute on a 2-core CPU with 2 layers)")
    return out


def _fewer(model: Any, num_layers: int, dtype: str) -> str:
    """A smaller run that verifies the same layer kinds, with its estimate: ``run``'s default (the leading attention
    layers with one of each kind, at least 2) when ``num_layers`` is above it, else the fewest with one of each
    kind (:func:`pipeline.core.spec.layers_covering_every_kind`); never the count in use. Already at the fewest:
    says so."""
    from pipeline.core.spec import layers_covering_every_kind

    fewer = [n for n in (layers_covering_every_kind(model, DEFAULT_LAYERS), layers_covering_every_kind(model, 1))
             if n < num_layers]
    if not fewer:
        return (f"{num_layers} {'is' if num_layers == 1 else 'are'} already the fewest attention layers that "
                "include every layer kind of this model")
    own, ref = weight_bytes(model, fewer[0], dtype)
    return f"--num-layers {fewer[0]} verifies the same layer kinds with about {_gib(own + ref)}"


def in_torchrun(environ: Any = os.environ) -> bool:
    """True when torchrun's variables say this process is one of several ranks."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


DEFAULT_LAYERS = 2  # a verification run: at least 2 layers, more when a layer kind first appears later (quick on CPU)

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def log_path(template: str, run_id: str, rank: int) -> str:
    """Fill ``{run_id}`` and ``{rank}`` into ``--log-file`` (no other placeholder, no format spec).

    Raises UsageError naming ``--log-file`` for other placeholders, unbalanced braces, or a path
    that is a directory or cannot be created.
    """
    for name in _PLACEHOLDER.findall(template):
        if name not in ("run_id", "rank"):
            raise UsageError(f"--log-file has an unknown placeholder {{{name}}}", code="usage",
                             flags=[("--log-file", template)], allowed=["{run_id}", "{rank}"],
                             remedy="use only {run_id} and {rank} in --log-file")
    path = template.replace("{run_id}", run_id).replace("{rank}", str(rank))
    if "{" in path or "}" in path:
        raise UsageError("--log-file has an unbalanced brace", code="usage", flags=[("--log-file", template)],
                         allowed=["{run_id}", "{rank}"], remedy="balance the braces or remove them")
    if os.path.isdir(path):
        raise UsageError(f"--log-file {path!r} is a directory", code="usage", flags=[("--log-file", template)],
                         remedy="give a file path, e.g. DIR/{run_id}.rank{rank}.jsonl")
    return path


def checked_log_path(ns: argparse.Namespace, run_id: str, rank: int) -> str:
    """:func:`log_path` of ``--log-file`` for ``run_id`` and ``rank``, checked against the other path flags
    (:func:`pipeline.cli.flags.check_log_path`: ``path_conflict``, exit 2) before the log opens."""
    from pipeline.cli.flags import check_log_path

    path = log_path(ns.log_file, run_id, rank)
    check_log_path(ns, path)
    return path


def open_log(path: str, template: str, run_id: str, rank: int, secrets: tuple[str, ...]) -> Any:
    """The run's EventLog; an unwritable path or one that is not a regular file (a FIFO, ``/dev/full``)
    is a UsageError naming ``--log-file`` (exit 2, nothing started)."""
    from pipeline.core.eventlog import EventLog

    try:
        return EventLog(run_id, rank, path, secrets=secrets, flag="--log-file", raise_write_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write the log file {path!r}: {e.strerror or e}", code="log_file_unwritable",
                         flags=[("--log-file", template)], remedy="pick a writable path for --log-file") from None


def check_context(request: SetupRequest, decode_steps: int, command: str = "run") -> None:
    """Refuse a ``--max-context-len`` shorter than the longest request ``run``'s checks reach: the built instances
    are verified on a 5-request batch and the model steps on a 4-request one
    (:func:`pipeline.memory.pools.check_needs`; torch-free, so ``plan`` refuses it too, at run's
    default ``--decode-steps``); ConfigError ``invalid_value`` naming the minimum."""
    from pipeline.core.speculative import settled
    from pipeline.core.validation import MAX_POOL_DIM
    from pipeline.memory.pools import check_needs

    p = request.pool
    ctx = check_needs(p.max_reqs, 1, decode_steps, settled(request), request.is_draft_worker).context
    if p.max_context_len < ctx:
        which = "verification request reaches with --decode-steps" if command == "run" else \
            "verification request of `attn-setup run` reaches with its default --decode-steps"
        raise ConfigError(f"--max-context-len {p.max_context_len} is shorter than the {ctx} tokens the longest "
                          f"{which} {decode_steps}", code="invalid_value",
                          flags=[("max_context_len", p.max_context_len), ("decode_steps", decode_steps)],
                          allowed=[f">= {ctx}"],
                          remedy=f"pass --max-context-len {ctx} or more" if ctx <= MAX_POOL_DIM else
                          f"lower --decode-steps (--max-context-len is at most {MAX_POOL_DIM})")


def check_plan_minimums(request: SetupRequest) -> None:
    """``plan``'s copy of the refusals ``run`` makes from its flags alone before anything is built, at ``run``'s
    default ``--decode-steps`` (plan has no such flag): a ``--max-context-len`` shorter than the longest verification
    request (:func:`check_context`), and a ``--num-token-slots`` below the slots the verification batches hold
    (``pool_budget_too_small``, as ``run``'s pool sizing words it: whole pages, at least two). Torch-free."""
    from pipeline.core.speculative import settled
    from pipeline.memory.pools import DEFAULT_DECODE_STEPS, check_needs, slot_floor

    check_context(request, DEFAULT_DECODE_STEPS, command="plan")
    p, page = request.pool, request.args.page_size
    floor = slot_floor(check_needs(p.max_reqs, page, DEFAULT_DECODE_STEPS, settled(request),
                                   request.is_draft_worker).slots, page)
    if p.num_token_slots is not None and -(-p.num_token_slots // page) * page < floor:
        raise ConfigError(f"num_token_slots={p.num_token_slots} cannot hold {floor} token slots (the verification "
                          f"batches of `attn-setup run` with its default --decode-steps {DEFAULT_DECODE_STEPS})",
                          code="pool_budget_too_small", flags=[("num_token_slots", p.num_token_slots),
                                                               ("page_size", page)],
                          allowed=[f">= {floor}"], remedy=f"set num_token_slots={floor} or more")


def check_warm_cache(ns: argparse.Namespace, runner: Any, pre: Any) -> None:
    """``--require-warm-cache``: refuse (ConfigError ``cold_jit_cache``, exit 3) a run whose FlashInfer variants
    would compile at startup, from the decisions the preflight made (the device facts and the resolved pair the
    run then takes), before anything is allocated."""
    if not getattr(ns, "require_warm_cache", False):
        return
    from pipeline.cli.warmup import check_warm, cold_report
    from pipeline.runtime.table import attention_request

    setup = pre["attention"]
    check_warm(ns, cold_report(attention_request(runner), setup["device-init"].facts, setup["resolve"].pair))


def check_pool_for_checks(ns: argparse.Namespace, request: SetupRequest, platform: Any, index: int = 0) -> None:
    """The pool ``run`` would size for these flags on ``platform``'s device ``index``, checked as its preflight checks
    it (:func:`pipeline.runtime.table.size_for`: fits the device, holds the verification batches); nothing is
    allocated. Raises the sizing's ConfigError."""
    from pipeline.core.spec import attention_layer_ids, truncate_spec
    from pipeline.runtime.table import size_for

    cfg = runner_config(ns, request)
    served = request.served_model
    spec = truncate_spec(served, cfg.num_layers) if attention_layer_ids(served) else served
    size_for(platform, index, cfg, spec)


def runner_config(ns: argparse.Namespace, request: SetupRequest) -> Any:
    """The RunnerConfig from the flags (default on every device: the first 2 attention layers, or as many as it
    takes to include one layer of every attention kind, e.g. 4 for Llama-4, 6 for Gemma-3); a pool sized from
    ``--num-token-slots`` or ``--mem-bytes`` must hold the verification batches (whole pages each:
    :func:`pipeline.memory.pools.check_needs`)."""
    from pipeline.core.model_spec import layers_covering_every_kind
    from pipeline.core.speculative import settled
    from pipeline.memory.pools import check_needs
    from pipeline.runtime.runner import RunnerConfig

    default = layers_covering_every_kind(request.served_model, DEFAULT_LAYERS)
    layers = ns.num_layers if ns.num_layers is not None else max(default, 1)
    p, ps, steps = request.pool, request.args.page_size, max(ns.decode_steps, 0)
    needs = check_needs(p.max_reqs, ps, steps, settled(request), request.is_draft_worker)
    return RunnerConfig(request=request, num_layers=layers, num_token_slots=ns.num_token_slots,
                        mem_bytes=ns.mem_bytes, mem_fraction=ns.mem_fraction, min_token_slots=needs.slots,
                        min_token_slots_for=f"the verification batches with --decode-steps {steps}",
                        min_context_len=needs.context)


def _summary(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], start_ns: Optional[int]) -> Any:
    """``(startup_summary, metrics error)`` (and ``slow_phase`` warnings, the ``--metrics-file``); never raises (an
    exit path)."""
    from pipeline.cli.startup import finish_startup

    return finish_startup(ns, log, jit, start_ns)


def _jit(runner: Any) -> list[dict[str, Any]]:
    """The FlashInfer JIT variants the runner's backends loaded, read before ``close()`` releases them."""
    from pipeline.cli.startup import jit_reports

    try:
        return jit_reports(runner)
    except Exception:  # noqa: BLE001 - an exit path: the summary goes on without them
        return []


def _ended(log: Any) -> bool:
    return any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in log.records)


def _close_run(ns: argparse.Namespace, log: Any, runner: Any, group: Any, progress: Any, error: Optional[ErrorInfo],
               code: int, t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    """:func:`cmd`'s ending, on every exit it controls: the progress line stopped, the JIT variants read (before
    ``close()`` releases the backends that know them), the runner and the rank group closed, then — even when a
    close raised, whose exception then goes on — :func:`_wrap_up`. The log stays open for :func:`finish_log`, which
    :func:`cmd` calls last on every way out (after the report is printed, so that ``command_finished`` carries the
    exit code the output's fate decided). Returns ``(error, exit code, startup summary)``."""
    if progress is not None:
        progress.__exit__(None, None, None)
    jit = _jit(runner)  # before close(): closing releases the backends that know what they loaded
    try:
        if runner is not None:
            runner.close()
        if group is not None:
            group.close()
    finally:
        error, code, summary = _wrap_up(ns, log, jit, error, code, t_start)
    return error, code, summary


def _wrap_up(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], error: Optional[ErrorInfo], code: int,
             t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    """The startup summary and the ``--metrics-file`` written with SIGINT and SIGTERM held (:func:`signals_held`: a
    signal there is logged as ``run_interrupted`` after them, exit 130 / 143), then the log's signal handlers
    restored and SIGTERM raised as ``KeyboardInterrupt("SIGTERM")`` until :func:`finish_log` (a SIGTERM while the
    report is printed ends 143 in the log and in the process); a run that was otherwise ok ends 2 when its log
    stopped taking writes (``log_write_failed``, also while the summary was written) or its metrics file could not
    be written (``output_write_failed``). Never raises."""
    summary = None
    try:
        with signals_held() as got:
            error, code = _interrupted_ends(log, *_log_failed(log, error, code))
            raising, log.raise_write_errors = log.raise_write_errors, False  # the summary goes on in memory
            try:
                summary, lost = _summary(ns, log, jit, t_start)
            finally:
                log.raise_write_errors = raising
            error, code = _metrics_failed(lost, *_log_failed(log, error, code))
        if got:
            error, code = _deliver_signal(log, got[0], error, code)
    finally:
        log.restore_signal_handlers()
        _sigterm_as_interrupt()
    return error, code, summary


def _log_failed(log: Any, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    if log.write_error is not None and code == EXIT_OK:
        return log.write_error.info, log.write_error.exit_code
    return error, code


def _metrics_failed(lost: Optional[AttnSetupError], error: Optional[ErrorInfo],
                    code: int) -> tuple[Optional[ErrorInfo], int]:
    """A ``--metrics-file`` that could not be written: the error of a run that was otherwise ok (exit 2); a failed
    run keeps its own, and the metrics error is one line on stderr."""
    if lost is None:
        return error, code
    if code == EXIT_OK:
        return lost.info, lost.exit_code
    import sys

    print(f"attn-setup: {lost.info.message}", file=sys.stderr)
    return error, code


TERMINATING = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held(signums: Sequence[int] = TERMINATING) -> Iterator[list[int]]:
    """``signums`` held while the body runs: a signal there only appends its number to the yielded list (the body —
    the last records, a file written whole — is never cut), and the handlers it replaced are back afterwards. Does
    nothing off the main thread (Python only lets the main thread set handlers); an ignored signal stays ignored."""
    got: list[int] = []
    prev: dict[int, Any] = {}
    try:
        for s in signums:
            if signal.getsignal(s) not in (signal.SIG_IGN, None):  # ignored since the process started: stays so
                prev[s] = signal.signal(s, lambda signum, _frame: got.append(signum))
    except ValueError:  # not the main thread
        pass
    try:
        yield got
    finally:
        for s, h in prev.items():
            signal.signal(s, h)


def _import_torch_whole(timed_import: Any) -> dict[str, Any]:
    """``timed_import()`` with SIGINT and SIGTERM held (:func:`signals_held`) until torch is imported: a signal
    inside the import left torch half-imported (the next import failed: ``internal_error``) or was lost. A held
    signal then ends the command as an interrupt before the log opens (130 / 143, ``interrupted``)."""
    _sigterm_as_interrupt()
    with signals_held() as got:
        result = timed_import()
    if got:
        raise KeyboardInterrupt(*(["SIGTERM"] if got[0] == signal.SIGTERM else []))
    return result


def _sigterm_as_interrupt() -> None:
    """From the summary on, SIGTERM unwinds like Ctrl-C (``KeyboardInterrupt("SIGTERM")``, exit 143 logged in
    ``command_finished``) instead of killing the process after its exit code was printed or logged as another."""
    def on_term(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    try:
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, None):
            signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass


def _install_handlers(log: Any) -> None:
    """SIGTERM unwinds like Ctrl-C (what was built released, exit 143 logged), then the log's handlers (its
    ``run_interrupted`` record) in front of both."""
    _sigterm_as_interrupt()
    log.install_signal_handlers()


def _deliver_signal(log: Any, signum: int, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    """A signal held by :func:`signals_held`, logged as ``run_interrupted`` (unless the run had ended with a terminal
    record already) and made the run's ending: ``interrupted``, exit 128 + its number — as the same signal anywhere
    else in the run."""
    name = signal.Signals(signum).name
    info = ErrorInfo(code="interrupted", state=log.current_state, message=f"received {name} in {log.where}",
                     remedy=INTERRUPTED_REMEDY)
    try:
        if not _ended(log):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal", signal=name,
                     error=info)
    except AttnSetupError:  # the log stopped taking writes: the signal's exit stands
        pass
    error, code = _interrupted_ends(log, error, code)
    if code != signal_exit_code(name):  # the run had ended already: still the signal's exit
        error, code = info, signal_exit_code(name)
    return error, code


def exit_code_of(e: BaseException, log: Any) -> int:
    """The exit code :func:`pipeline.cli.main` gives an exception that leaves ``cmd`` after the run was wrapped up
    (while the report is printed, or from a close): 130 for a Ctrl-C — logged as ``run_interrupted`` unless the run
    already ended with a terminal record —, a typed error's own code, else 1."""
    if isinstance(e, KeyboardInterrupt):
        try:
            if not _ended(log):
                log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal",
                         signal=interrupt_signal(e), error=error_info_from(e, log.current_state))
        except AttnSetupError:  # the log stopped taking writes just now: the signal's exit stands
            pass
        return signal_exit_code(interrupt_signal(e))
    return getattr(e, "exit_code", EXIT_FAILED)


def finish_log(log: Any, code: int, t0: float) -> None:
    """``command_finished`` with the exit code and ``duration_ms`` (ms since ``t0``, ``time.perf_counter()``
    seconds), then the log closed: the trace's last record, on every exit :func:`cmd` controls. From here on SIGINT
    and SIGTERM are ignored in the main thread (the exit code is the one logged; :func:`pipeline.cli.main` gives an
    in-process caller its handlers back)."""
    import time

    try:
        for s in TERMINATING:
            signal.signal(s, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    try:
        log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
                 duration_ms=(time.perf_counter() - t0) * 1e3)
    finally:
        log.close()


def _ended_by(e: BaseException, log: Any) -> tuple[ErrorInfo, int]:
    """The ErrorInfo and exit code of what stopped the run, logged as its terminal record unless one was written:
    a typed refusal (its exit code; refused in preflight when nothing was logged yet), SIGINT (exit 130: the
    handler wrote ``run_interrupted``, the unwinding released), any other crash (exit 1)."""
    if isinstance(e, AttnSetupError):
        error, code = e.info, e.exit_code
    elif isinstance(e, KeyboardInterrupt):
        # report the state the signal arrived in (the handler's record), not 'failed', where the unwinding ended
        seen = next((r for r in reversed(log.records) if isinstance(r, ev.RunInterrupted)), None)
        error = seen.error if seen is not None else error_info_from(e, next(
            (r.state for r in reversed(log.records) if r.state != "failed"), log.current_state))
        code = signal_exit_code(seen.signal if seen is not None else interrupt_signal(e))
    else:
        error, code = error_info_from(e, log.current_state), EXIT_FAILED
    if not _ended(log):
        if isinstance(e, KeyboardInterrupt):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal",
                     signal=interrupt_signal(e), error=error)
        else:
            log.emit(ev.RunFailed, state=error.state if isinstance(e, AttnSetupError) else log.current_state,
                     outcome="failed", error=error)
    return error, code


def _interrupted_ends(log: Any, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    """Once ``run_interrupted`` is logged for a signal, the run ends with 130 and that record's error, whatever
    else happened after it (a handler that returned, an exception swallowed on the way out): never a run that
    logs an interruption and then says it succeeded."""
    seen = next((r for r in log.records if isinstance(r, ev.RunInterrupted) and r.reason == "signal"), None)
    if seen is None or code == signal_exit_code(seen.signal):
        return error, code
    return seen.error, signal_exit_code(seen.signal)


def _print(ns: argparse.Namespace, report: dict[str, Any], records: Any, request: SetupRequest,
           error: Optional[ErrorInfo], code: int = EXIT_OK, notices: Sequence[str] = ()) -> None:
    """``--json``'s object (the notices on stderr), or: for a failed run first its headline (:func:`headline`: the
    state, the error, its message and remedy — the cause was below the tables), the notices,
    the model and device, the runner timeline, the tables, the startup summary, the verdict (``ok`` / ``failed``:
    stdout's last line, as ``plan``'s) and — for a failed run, last, where the eye lands when the prompt returns —
    the error in full in the command line's flags under a red rule that says the run failed and its exit code
    (the error sat between the tables)."""
    from pipeline.cli.output import console, print_stderr_lines, width, wrap

    if ns.json:
        print_stderr_lines(notices)
        rp.emit_json(report)
        return
    if error is not None:
        from pipeline.cli.output import cli_error, command_dests

        c = console(stderr=True)
        for line in wrap(headline(cli_error(error, command_dests("run")), code), width(c)):  # at the terminal's width
            c.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    print_stderr_lines(notices)
    _render_runner(report, records, request)
    rp.render_tables({**report, "states": []}, verdict=False)  # the setup states are in the runner timeline above
    from pipeline.cli.startup import render_summary

    render_summary(report["summary"], records)  # with the slow_phase warnings under it
    rp.render_verdict(report)  # stdout's last line, after the startup summary, as plan's (it sat above the summary)
    if error is not None:
        from pipeline.cli.output import cli_error, command_dests

        sys.stdout.flush()  # the tables are out before the error (one terminal, two streams)
        console(stderr=True).rule(f"[bold red]attn-setup run failed (exit {code})[/]", style="red", align="left")
        rp.render_error(cli_error(error, command_dests("run")))


NO_LOG = ("none: refused at its command line (flags, launch variables, model configs, the log path) before the run "
          "started; nothing was imported, allocated or written")


def print_refused(err: AttnSetupError, as_json: bool) -> None:
    """A ``run`` refused before its log opened, printed as every failed run is (:func:`_print`): the headline, ``log:``
    (here :data:`NO_LOG`), the verdict ``failed`` on stdout, then the error in full under the red rule; ``--json``:
    ``{"ok": false, "error": …, "log_file": null}``."""
    from pipeline.cli.output import cli_error, command_dests, console, width, wrap

    info, code = cli_error(err.info, command_dests("run")), err.exit_code
    if as_json:
        rp.emit_json({"ok": False, "error": info, "log_file": None})
        return
    c = console(stderr=True)
    for line in wrap(headline(info, code), width(c)):
        c.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    for line in wrap(f"log: {NO_LOG}", width(c)):
        c.print(escape(line), soft_wrap=True)
    rp.render_verdict({"ok": False})
    sys.stdout.flush()
    c.rule(f"[bold red]attn-setup run failed (exit {code})[/]", style="red", align="left")
    rp.render_error(info)


def headline(info: ErrorInfo, code: int) -> str:
    """A failed run's first line: ``attn-setup run failed (exit 3) in state resolve: backend_unavailable: <message>;
    remedy: <remedy>``."""
    return (f"attn-setup run failed (exit {code}) in state {info.state}: {info.code}: {info.message}"
            + (f"; remedy: {info.remedy}" if info.remedy else ""))


def device_line(report: dict[str, Any], request: Optional[SetupRequest]) -> Optional[str]:
    """``device: cuda:0 NVIDIA H200 (sm90), written as CUDA:0`` from the report's ``device``; the requested device
    when the run stopped before device-init read its facts."""
    from pipeline.observe.runs import device_text

    d = report.get("device")
    if d is not None:
        return f"device: {device_text(d)}"  # inspect prints the same line from the log
    if request is None:
        return None
    spelled = request.device_spelled_as
    return (f"device: {request.device} requested (the run stopped before device-init read its facts)"
            + (f", written as {spelled}" if spelled else ""))


def _report(log: Any, run_id: str, code: int, checked: Any, log_file: str,
            error: Optional[ErrorInfo]) -> dict[str, Any]:
    """Run's JSON object; ``verified`` and ``model_steps`` from the runner's :class:`~pipeline.runtime.runner.Verification`
    (None: the run stopped before), the error's remedy in this command line's flags."""
    from pipeline.cli.output import cli_error, command_dests
    from pipeline.observe.runs import device_from, outcomes

    return {
        "ok": code == EXIT_OK, "run_id": run_id, "states": outcomes(log.records, "setup"),
        "resolved": rp.resolved_from(log.records), "plan": rp.plan_from(log.records),
        "skips": rp.skips_from(log.records), "warnings": rp.warnings_from(log.records),
        "verified": [] if checked is None else [_instance_obj(r) for r in checked.instances],
        "log_file": os.path.abspath(log_file),
        "error": None if error is None else msgspec.to_builtins(cli_error(error, command_dests("run"))),
        "runner_states": outcomes(log.records, "runner"), "device": device_from(log.records),
        "model_steps": [] if checked is None else [_step_obj(c) for c in checked.steps],
    }


def model_line(request: SetupRequest, records: Any) -> str:
    """``model: llama (LlamaForCausalLM) from PATH, 2 attention layers built (layers 0-1) of 32`` (+ the draft
    model on a draft worker); a hybrid names the layers of the span it skipped: ``2 attention layers built
    (layers 0-7: 6 linear-attention skipped) of 48`` (:func:`pipeline.core.layer_span.span_text`)."""
    from pipeline.core.layer_span import layer_span, span_text

    built = next((r.num_layers for r in records if isinstance(r, ev.ModelLoaded)), None)

    from pipeline.cli.inspect import _safe  # text from the config: terminal escapes shown escaped, as plan does

    def one(m: ModelSpec, serves: bool) -> str:
        arch = f" ({', '.join(map(_safe, m.architectures))})" if m.architectures else ""
        layers = ""
        lay = request.served_model.shard
        if serves and built is not None and lay is not None and lay.pp_size > 1:  # a stage: its layers, whole-model ids
            s, stage = lay.layer_range[0], request.served_model
            span = layer_span(list(stage.layer_types), built, lay.total_layers)
            layers = (f", {span.attention} attention layer{'s' * (span.attention != 1)} built (layers {s}-"
                      f"{s + built - 1} of pipeline stage {lay.pp_rank}) of {lay.total_layers}")
        elif serves and built is not None:
            layers = ", " + span_text(layer_span(list(m.layer_types), built, m.num_hidden_layers))
        return f"{_safe(m.model_type)}{arch} from {_safe(m.source or 'a dict')}{layers}"

    draft = request.draft_model
    text = f"model: {one(request.model, draft is None or not request.is_draft_worker)}"
    if request.is_draft_worker:
        text += f"; draft worker serving {'the draft model: ' + one(draft, True) if draft else 'the model itself'}"
    return text


def timeline_title(report: dict[str, Any]) -> str:
    """The timeline's heading, true to its rows: the setup states are nested only when the runner reached its
    attention step; a start refused before the runner started shows the setup states alone."""
    runner = [s["state"] for s in report.get("runner_states") or []]
    if "attention" in runner:
        return "timeline (runner states, setup states under attention)"
    if runner:
        return "timeline (runner states; the setup machine did not start)" if not report.get("states") else \
            "timeline (runner states, then the setup states)"
    return "timeline (setup states; the runner did not start)"


def timeline_rows(report: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(label, outcome, ms)`` in the order the states ran: the runner's states, with the setup
    machine's states nested (indented) under ``attention``; the setup states alone without a runner."""
    runner = report.get("runner_states") or []
    setup = [(f"  └ {s['state']}" if runner else s["state"], s["outcome"], s["duration_ms"])
             for s in report.get("states") or []]
    rows: list[tuple[str, str, float]] = []
    for s in runner:
        rows.append((s["state"], s["outcome"], s["duration_ms"]))
        if s["state"] == "attention":
            rows += setup
            setup = []
    return rows + setup


def _pool_line(records: Any) -> Optional[str]:
    r = next((r for r in records if isinstance(r, ev.MemoryPoolSized)), None)
    if r is None:
        return None
    line = (f"KV pool: {r.num_token_slots} token slots x {rp.fmt_bytes(r.bytes_per_token)} = {rp.fmt_bytes(r.kv_bytes)} "
            f"(from {r.source}), req_to_token {r.max_reqs} x {r.max_context_len} = {rp.fmt_bytes(r.req_to_token_bytes)}")
    if r.graph_bytes_estimate:
        kept = ", kept out of the budget" if r.source == "mem_fraction" else ""
        line += f"; decode CUDA graphs {rp.fmt_bytes(r.graph_bytes_estimate)} estimated{kept}"
    return line


def _top_text(records: Any, request: Optional[SetupRequest]) -> str:
    """`` (top: default for 131 GiB: 256 (sglang's rule))``: where the largest captured size came from
    (:func:`states.build_mode.graph_top` on the initialized device); empty when that cannot be said."""
    from states.build_mode import graph_top

    init = next((r for r in records if isinstance(r, ev.DeviceInitialized)), None)
    if request is None or init is None:
        return ""
    try:
        top = graph_top(request.args, request.pool.max_reqs, device=init.facts, world_size=request.tp_size)
    except AttnSetupError:
        return ""
    return f" (top: {top.text})"


def _graph_line(records: Any, request: Optional[SetupRequest] = None) -> Optional[str]:
    """``CUDA graphs: 4 sizes captured (top: default for 131 GiB: 256 (sglang's rule)), graph pool 2.0 MiB (estimated
    2.0 MiB), capture step took 76.0 MiB of the device (estimated 76.0 MiB kept, 78.0 MiB at its peak)`` from the
    ``cuda_graph_memory`` event (None without one)."""
    m = next((r for r in records if isinstance(r, ev.CudaGraphMemory)), None)
    if m is None:
        return None
    cap = next((r for r in records if isinstance(r, ev.CudaGraphCaptured)), None)
    what = "" if cap is None or cap.mode == "decode" else f" of {cap.mode.replace('_', '-')}"  # a speculative step
    return (f"CUDA graphs: {len(m.batch_sizes)} sizes{what} captured{_top_text(records, request)}, graph pool "
            f"{rp.fmt_bytes(m.pool_bytes)} (estimated "
            f"{rp.fmt_bytes(m.pool_estimate)}), capture step took {rp.fmt_bytes(m.step_device_bytes)} of the device "
            f"(estimated {rp.fmt_bytes(m.kept_estimate)} kept, {rp.fmt_bytes(m.total_estimate)} at its peak)"
            + (f", after {rp.fmt_bytes(m.prime_device_bytes)} of one-time capture setup before the pools were sized"
               if m.prime_device_bytes else ""))


def _render_runner(report: dict[str, Any], records: Any = (), request: Optional[SetupRequest] = None) -> None:
    """The model, the timeline (runner states with the setup states nested) and the stack's verified steps,
    at the terminal's width (:mod:`pipeline.cli.output`)."""
    from pipeline.cli.output import console, print_line, print_table

    c = console()
    if request is not None:
        print_line(c, model_line(request, records))
        if request.world_size > 1:
            from pipeline.core.shard import shard_summary

            print_line(c, shard_summary(request))
    for line in (device_line(report, request), _pool_line(records), _graph_line(records, request)):
        if line:
            print_line(c, line)
    rows = timeline_rows(report)
    if rows:
        print_table(c, timeline_title(report), ["state", "outcome", "duration ms"],
                    [[label, outcome, f"{ms:.1f}"] for label, outcome, ms in rows])
    if report["model_steps"]:
        from pipeline.runtime.runner import tol_text

        steps = report["model_steps"]
        # an MLA stack is judged against two references per step: the table names them (module model_steps)
        refs = any(s.get("reference", "").startswith("mla-") for s in steps)
        print_table(c, "attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                    ["step", "bs", "graph"] + (["reference"] if refs else []) + ["max rel err", "tol", "passed"],
                    [[s["step"], str(s["batch_size"]), "yes" if s["graph"] else "no"]
                     + ([s.get("reference", "")] if refs else [])
                     + [f"{s['max_rel_err']:.2e}", tol_text(s["tol"]), "yes" if s["passed"] else "NO"]
                     for s in steps])


def preflight(ns: argparse.Namespace, runner: Any, log: Any, group: Any) -> None:
    """Refuse, before the runner loads the model or sizes the pools, what the runner or the setup would refuse.

    The flags ``run`` alone has (``--decode-steps``, ``--max-context-len`` against what the checks need), then
    the runner's table in decide mode (:meth:`pipeline.runtime.runner.Runner.preflight`: the env settings, the
    dtype and ``--num-layers``, ``--mem-bytes``/``--mem-fraction``/``--num-token-slots`` against the device's
    memory and the verification batches, every setup decision up to allocation — the resolution with
    ``--strict``, the CUDA-graph sizes against ``--max-reqs``, the FlashInfer workspace bound). The run then
    takes those decisions (one resolve per run). A refusal of the setup machine is passed to it, which raises it
    at its own state without deciding again, so the log records device-init → resolve (or build-mode) → failed
    with the ErrorInfo (before the pools: nothing is allocated there).
    """
    from pipeline.runtime.table import attention_request
    from pipeline.setup.build import build_attention_backends

    from pipeline.cli.startup import check_startup_flags

    check_startup_flags(ns)  # the flags' domains were checked as they were read (pipeline.cli.flags)
    check_context(runner.request, ns.decode_steps)
    pre = runner.preflight()
    if pre.refused is None:
        check_warm_cache(ns, runner, pre)
        return
    state, err = pre.refused
    if state == "attention":  # logged where it happened in the setup machine
        build_attention_backends(attention_request(runner), log=log, rank_group=group, decided=pre[state])
    raise err


def _instance_obj(r: Any) -> dict[str, Any]:
    """One ``verified`` entry of the report, from :meth:`pipeline.runtime.runner.Runner.verify`'s result."""
    return {"role": r.role, "backend": r.backend, "max_rel_err": r.max_rel_err, "passed": r.passed, "tol": r.tol,
            "detail": r.detail}


def _step_obj(c: Any) -> dict[str, Any]:
    """One ``model_steps`` entry of the report, from :meth:`pipeline.runtime.runner.Runner.verify`'s result."""
    return {"step": c.step, "mode": c.mode, "batch_size": c.batch_size, "graph": c.graph,
            "max_rel_err": c.max_rel_err, "tol": c.tol, "passed": c.passed, "reference": c.reference}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.cli.flags import add_setup_flags

    run = sub.add_parser("run", help="run the pipeline and verify every built backend on a real batch")
    add_setup_flags(run)
    run.add_argument("--log-file", default="./attn-setup-logs/{run_id}.rank{rank}.jsonl",
                     help="JSON-lines trace path; {run_id} and {rank} are filled in "
                          "(default: ./attn-setup-logs/{run_id}.rank{rank}.jsonl)")
    run.add_argument("--decode-steps", type=ascii_int, default=3, help="decode steps verified after the extend")
    run.add_argument("--num-layers", type=ascii_int, default=None,
                     help=f"build only the first N attention layers (default {DEFAULT_LAYERS}, or as many as it takes "
                          "to include every attention layer kind; a hybrid model's linear-attention / mamba layers "
                          "are skipped, not counted)")
    run.add_argument("--dist-timeout", type=ascii_float, default=None, metavar="SECONDS",
                     help="under torchrun (WORLD_SIZE > 1): seconds to wait for the rendezvous (then "
                          "rank_exchange_failed) and for every rank at each of our waits (then rank_stalled, naming "
                          "the rank, its last state and what it was doing) "
                          "(default: $ATTN_SETUP_DIST_TIMEOUT, else 60)")
    run.add_argument("--max-memory-imbalance", type=ascii_float, default=None, metavar="FRACTION",
                     help="under torchrun: the allowed spread of free device memory between ranks at device-init, "
                          "a fraction of the largest; more fails every rank with memory_imbalance "
                          "(default: $ATTN_SETUP_MAX_MEMORY_IMBALANCE, else 0.1 as sglang; 1 = no check)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--mem-fraction", type=ascii_float, default=None,
                        help="size the KV pool from this share of device memory (sglang's mem_fraction_static; "
                             "default: unset, the pool has --num-token-slots slots)")
    budget.add_argument("--mem-bytes", type=ascii_int, default=None,
                        help="size the KV pool from this many bytes (default: unset, as --mem-fraction)")
    from pipeline.cli.startup import add_startup_flags

    add_startup_flags(run)
    return run


def _notices(ns: argparse.Namespace, request: SetupRequest, in_group: bool) -> list[str]:
    """:func:`pipeline.cli.run.run_notices` as ``notice:`` lines, printed on stderr with the report (never
    stdout: ``--json`` stays one object), after a failed run's headline (:func:`pipeline.cli.run._print`)."""

    try:
        lines = run_notices(ns, request, runner_config(ns, request).num_layers, in_group)
    except AttnSetupError:
        return []  # a request the checks that follow refuse, with the error that names it: nothing to announce
    return [f"notice: {line}" for line in lines]


def _progress(ns: argparse.Namespace, log: Any, request: SetupRequest) -> Any:
    """The terminal progress line (:mod:`pipeline.observe.progress`), started; nothing on a non-TTY / --json / --no-progress."""
    from pipeline.observe.progress import progress_for

    p = progress_for(ns, log, request)
    p.__enter__()
    return p


def _process_start(ns: argparse.Namespace) -> Optional[int]:
    """The startup summary's origin (:func:`pipeline.observe.startup.process_start`); its creation time is kept in
    ``ns._process_created_ns`` for the summary's ``created_ns`` / ``idle_before_start_s``."""
    from pipeline.observe.startup import process_start

    start = process_start()
    ns._process_created_ns = None if start is None else start.created_ns
    return None if start is None else start.start_ns


def _watch_slow_phases(ns: argparse.Namespace, log: Any, start_ns: Optional[int]) -> Any:
    """With ``--slow-phase-s`` (or its variable) a :class:`pipeline.observe.startup.SlowPhaseWatch` on ``log``,
    so that each ``slow_phase`` warning comes as its phase ends; None without (or with a bad value: preflight
    refuses it)."""
    from pipeline.observe.startup import SlowPhaseWatch
    from pipeline.observe.startup import slow_threshold

    try:
        slow = slow_threshold(getattr(ns, "slow_phase_s", None))
    except Exception:  # noqa: BLE001 - refused in preflight, with the flag named
        return None
    if slow is None:
        return None
    from pipeline.cli.startup import startup_parts

    return SlowPhaseWatch(log, slow, start_ns=start_ns, startup_parts=startup_parts(ns)).install()


def summary_obj(summary: Any) -> Any:
    return None if summary is None else msgspec.to_builtins(summary)


def _rank_group(ns: argparse.Namespace) -> Any:
    """Under torchrun (WORLD_SIZE > 1) the launch's RankGroup, its rank, world size and device written back into
    ``ns``; None otherwise. ``--dist-timeout`` (else ``ATTN_SETUP_DIST_TIMEOUT``, else 60 s) and
    ``--max-memory-imbalance`` (else its variable, else 0.1) are checked with one rank too."""
    from pipeline.setup.distributed import check_timeout, init_from_env
    from pipeline.setup.distributed import max_imbalance_from
    from pipeline.setup.rank_watch import timeout_from_env

    timeout = timeout_from_env(60.0) if ns.dist_timeout is None else check_timeout(ns.dist_timeout)
    spread = max_imbalance_from(ns.max_memory_imbalance)
    group = init_from_env(device_of(ns).canonical, timeout_s=timeout, max_memory_imbalance=spread)
    if group is not None:
        ns.rank, ns.world_size, ns.device = group.rank, group.world_size, group.device
    return group


def _join(ns: argparse.Namespace) -> tuple[Any, Optional[AttnSetupError]]:
    """:func:`_rank_group`, and a rendezvous that failed (``rank_exchange_failed``, exit 1) kept instead of raised,
    so that the run opens its log and ends as every failed start does (headline, log, ``run_failed``, verdict);
    ``ns.rank`` / ``ns.world_size`` are then torchrun's (checked before the rendezvous). A bad launch variable or
    timeout (a UsageError, exit 2) is still raised: refused as the flags are. The wait is ``ns._rendezvous``
    (seconds, detail), a child of the startup summary's ``startup``."""
    import time

    from pipeline.core.errors import RankExchangeError
    from pipeline.setup.distributed import check_launch_env

    t0 = time.perf_counter()
    try:
        group = _rank_group(ns)
    except RankExchangeError as e:
        ns.rank, ns.world_size, _ = check_launch_env()
        ns._rendezvous = (time.perf_counter() - t0, f"failed: {e.info.code}")
        return None, e
    if group is not None:
        ns._rendezvous = (time.perf_counter() - t0, f"{group.world_size} ranks joined")
    return group, None


def cmd(ns: argparse.Namespace) -> int:
    """Run the runner flow, verify every instance and the stack's steps, print the report; returns the exit code.

    Flags, model configs and the log path are refused before torch is imported. Every exit once the log is open
    writes a terminal record: ``run_failed`` for a refusal, a crash or a failed verification (``run_interrupted``
    first on SIGINT/SIGTERM), and on every exit it controls ``command_finished`` with the exit code — ``inspect``
    calls the launch ok only when that says 0. SIGINT ends with exit 130 and SIGTERM with 143, after the unwinding
    released what was built, in the log and in the process alike (both ignored from ``command_finished`` on). A
    trace-file write that fails stops the run there: exit 2 naming ``--log-file`` (``log_write_failed``), what was
    built released. A report that cannot be written (stdout or stderr, other than a closed pipe) makes an ok run exit
    2 (``output_write_failed``, :func:`pipeline.cli.output.settle`); ``command_finished`` comes after the report.
    """
    import time

    from pipeline.cli.startup import warn_env_lookalikes
    from pipeline.observe.startup import timed_torch_import
    from pipeline.runtime.runner import Runner
    from pipeline.core.eventlog import new_run_id

    log_path(ns.log_file, "0", ns.rank), request_from(ns, on_gpu=is_gpu_device(ns.device))  # before torch
    ns._torch_import = _import_torch_whole(timed_torch_import)  # named in the startup summary (cold start)
    group, joined = _join(ns)
    request = request_from(ns, on_gpu=is_gpu_device(ns.device))  # ns.device: torchrun's rank's, once joined
    notices = _notices(ns, request, group is not None) if joined is None else []
    run_id = group.run_id if group is not None else new_run_id()
    log_file = checked_log_path(ns, run_id, request.rank)  # path_conflict again, the run id known
    log = ns._log = open_log(log_file, ns.log_file, run_id, request.rank, tuple(request.secrets.values()))
    t0 = time.perf_counter()
    t_start = _process_start(ns)
    ns._slow_watch = _watch_slow_phases(ns, log, t_start)
    error: Optional[ErrorInfo] = None
    code, runner, checked, progress = EXIT_OK, None, None, None
    try:
        try:
            _install_handlers(log)
            log.emit(ev.CommandStarted, state="args", command="run", argv=list(getattr(ns, "_argv", [])))
            notices += warn_env_lookalikes(log)
            if joined is not None:  # the rendezvous failed before the log could exist: its failure is this run's
                raise joined
            progress = _progress(ns, log, request)
            runner = Runner(runner_config(ns, request), log=log, rank_group=group)
            preflight(ns, runner, log, group)
            runner.initialize()
            checked = runner.verify(ns.decode_steps)  # the runner checks what it built; its results make the report
            error, code = checked.error, EXIT_OK if checked.error is None else EXIT_FAILED
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any crash becomes an exit code with its ErrorInfo
            error, code = _ended_by(device_as_written(e, ns.device), log)  # --device as the user wrote it
        finally:
            error, code, summary = _close_run(ns, log, runner, group, progress, error, code, t_start)
        report = _report(log, run_id, code, checked, log_file, error)
        report["warnings"] += slow_warnings(log.records)
        report["summary"] = summary_obj(summary)
        _print(ns, report, log.records, request, error, code, notices=notices)
        code = settle(code)  # a report lost to a write error (not a closed pipe) fails an ok run: exit 2
    except BaseException as e:  # the code main() will return for it, in the trace too
        code = exit_code_of(e, log)
        raise
    finally:
        finish_log(log, code, t0)  # command_finished with the process's exit code, last, on every way out
    return code
