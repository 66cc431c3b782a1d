"""``attn-setup run``: the runner flow, then verification on real batches.

Every device goes through the same runner states (:mod:`pipeline.runtime.runner`): init-distributed,
load-model (``--num-layers``, default 2 on every device), init-memory-pool (``--mem-fraction`` /
``--mem-bytes`` / ``--num-token-slots``), attention (the six-state pipeline), capture-cuda-graphs
(skipped with its reason on CPU or for backends without CUDA graphs), ready. Then every built
instance is verified on a batch against the float64 reference, and the attention stack runs an
extend, a chunked extend and decode steps (replayed from graphs where captured) checked against
the dense float64 stack reference. Its flag checks are in :mod:`pipeline.cli.run_checks`, its report in
:mod:`pipeline.cli.run_report`, its ending (terminal records, exit code) in :mod:`pipeline.cli.run_exit`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.cli import report as rp
from pipeline.core.contracts import ErrorInfo, ModelSpec, SetupRequest  # noqa: F401
from pipeline.cli.request import device_as_written, device_of, is_gpu_device, request_from
from pipeline.core.errors import (
    EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, AttnSetupError, ConfigError, UsageError, error_info_from,  # noqa: F401
)
from pipeline.cli.run_checks import (  # noqa: F401 - run's flag checks moved; importable from here
    _PLACEHOLDER, DEFAULT_LAYERS, check_context, check_pool_for_checks, check_warm_cache, checked_log_path, log_path,
    open_log, runner_config,
)
from pipeline.cli.outstreams import settle
from pipeline.cli.run_exit import _close_run, _ended_by, exit_code_of, finish_log
from pipeline.cli.startup import slow_warnings
from pipeline.cli.run_report import (  # noqa: F401 - the report moved; its names stay importable from here
    _graph_line, _pool_line, _print, _render_runner, _report, model_line, timeline_rows, timeline_title,
)
from pipeline.core.numbers import ascii_float, ascii_int


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

    check_startup_flags(ns)  # the flags' domains were checked as they were read (pipeline.cli.domains)
    check_context(runner.request, ns.decode_steps)
    pre = runner.preflight()
    if pre.refused is None:
        check_warm_cache(ns, runner, pre)
        return
    state, err = pre.refused
    if state == "attention":  # logged where it happened in the setup machine
        build_attention_backends(attention_request(runner), log=log, rank_group=group, decided=pre[state])
    raise err


def _model_steps(runner: Any, log: Any, decode_steps: int) -> list[dict[str, Any]]:
    from pipeline.runtime.model_steps import verify_model_steps

    out = []
    for c in verify_model_steps(runner, decode_steps=decode_steps):
        log.emit(ev.ModelStepVerified, state="ready", outcome="ok" if c.passed else "failed", step=c.step,
                 mode=c.mode, batch_size=c.batch_size, graph=c.graph, max_rel_err=c.max_rel_err, tol=c.tol,
                 passed=c.passed, reference=c.reference)
        out.append({"step": c.step, "mode": c.mode, "batch_size": c.batch_size, "graph": c.graph,
                    "max_rel_err": c.max_rel_err, "tol": c.tol, "passed": c.passed, "reference": c.reference})
    return out


def _verify(backends: Any, request: SetupRequest, log: Any, decode_steps: int,
            pools: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    from pipeline.runtime.verify import verify_built

    out = []
    for r in verify_built(backends, request, pools=pools, decode_steps=decode_steps):
        log.emit(ev.InstanceVerified, state="done", outcome="ok" if r.passed else "failed", role=r.role,
                 backend=r.backend, max_rel_err=r.max_rel_err, tol=r.tol, passed=r.passed, duration_ms=r.duration_ms)
        out.append({"role": r.role, "backend": r.backend, "max_rel_err": r.max_rel_err, "passed": r.passed,
                    "tol": r.tol, "detail": r.detail})
    return out


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
    """:func:`pipeline.cli.notices.run_notices` as ``notice:`` lines, printed on stderr with the report (never
    stdout: ``--json`` stays one object), after a failed run's headline (:func:`pipeline.cli.run_report._print`)."""
    from pipeline.cli.notices import run_notices

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

    Every exit once the log is open writes a terminal record: ``run_failed`` for a refusal, a
    crash or a failed verification (``run_interrupted`` first on SIGINT/SIGTERM), and on every
    exit it controls ``command_finished`` with the exit code — ``inspect`` calls the launch ok
    only when that says 0. SIGINT ends with exit 130 (as SIGTERM ends with its signal), after
    the unwinding released what was built. A trace-file write that fails stops the run there: exit 2
    naming ``--log-file`` (``log_write_failed``), what was built released. A report that cannot be written (stdout
    or stderr, other than a closed pipe) makes an ok run exit 2 (``output_write_failed``,
    :func:`pipeline.cli.outstreams.settle`); ``command_finished`` comes after the report, with that code.
    """
    import time

    from pipeline.cli.startup import warn_env_lookalikes
    from pipeline.observe.startup import timed_torch_import
    from pipeline.runtime.runner import Runner
    from pipeline.core.eventlog import new_run_id

    ns._torch_import = timed_torch_import()  # named in the startup summary and the progress line (cold start)
    group, joined = _join(ns)
    on_gpu = is_gpu_device(ns.device)
    request = request_from(ns, on_gpu=on_gpu)
    notices = _notices(ns, request, group is not None) if joined is None else []
    run_id = group.run_id if group is not None else new_run_id()
    log_file = checked_log_path(ns, run_id, request.rank)  # s13: path_conflict again, the run id known
    log = open_log(log_file, ns.log_file, run_id, request.rank, tuple(request.secrets.values()))
    t0 = time.perf_counter()
    t_start = _process_start(ns)
    ns._slow_watch = _watch_slow_phases(ns, log, t_start)
    error: Optional[ErrorInfo] = None
    code, runner, verified, steps, progress = EXIT_OK, None, [], [], None
    try:
        try:
            log.install_signal_handlers()
            log.emit(ev.CommandStarted, state="args", command="run", argv=list(getattr(ns, "_argv", [])))
            notices += warn_env_lookalikes(log)
            if joined is not None:  # the rendezvous failed before the log could exist: its failure is this run's
                raise joined
            progress = _progress(ns, log, request)
            runner = Runner(runner_config(ns, request), log=log, rank_group=group)
            preflight(ns, runner, log, group)
            runner.initialize()
            verified, steps, error = _verify_runner(runner, log, ns.decode_steps)
            code = EXIT_OK if error is None else EXIT_FAILED
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any crash becomes an exit code with its ErrorInfo
            error, code = _ended_by(device_as_written(e, ns.device), log)  # --device as the user wrote it
        finally:
            error, code, summary = _close_run(ns, log, runner, group, progress, error, code, t_start)
        report = _report(log, run_id, code, verified, steps, log_file, error)
        report["warnings"] += rp.layer_rule_warnings(request) + slow_warnings(log.records)
        report["summary"] = summary_obj(summary)
        _print(ns, report, log.records, request, error, code, notices=notices)
        code = settle(code)  # a report lost to a write error (not a closed pipe) fails an ok run: exit 2
    except BaseException as e:  # the code main() will return for it, in the trace too
        code = exit_code_of(e, log)
        raise
    finally:
        finish_log(log, code, t0)  # command_finished with the process's exit code, last, on every way out
    return code


def _verify_runner(runner: Any, log: Any, decode_steps: int) -> tuple[list, list, Optional[ErrorInfo]]:
    """Verify every built instance and the stack's steps (each logged); a failure is logged as ``run_failed``
    (:func:`pipeline.observe.runs.verification_failure`, the one builder ``inspect`` also uses)."""
    from pipeline.observe.runs import verification_failure

    verified = _verify(runner.backends, runner.request, log, decode_steps, runner.pools)
    steps = _model_steps(runner, log, decode_steps)
    error = verification_failure(log.records)
    if error is not None:
        log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    return verified, steps, error
