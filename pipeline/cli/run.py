"""``attn-setup run``: the runner flow, then verification on real batches.

Every device goes through the same runner states (:mod:`pipeline.runtime.runner`): init-distributed,
load-model (``--num-layers``, default 2 on every device), init-memory-pool (``--mem-fraction`` /
``--mem-bytes`` / ``--num-token-slots``), attention (the six-state pipeline), capture-cuda-graphs
(skipped with its reason on CPU or for backends without CUDA graphs), ready. Then every built
instance is verified on a batch against the float64 reference, and the attention stack runs an
extend, a chunked extend and decode steps (replayed from graphs where captured) checked against
the dense float64 stack reference.
"""

from __future__ import annotations

import argparse
import sys
import re
import os
from typing import Any, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.cli import report as rp
from pipeline.core.contracts import ErrorInfo, ModelSpec, SetupRequest
from pipeline.cli.request import is_gpu_device, request_from
from pipeline.core.errors import (
    EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, AttnSetupError, ConfigError, UsageError, error_info_from,
)

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


def open_log(path: str, template: str, run_id: str, rank: int, secrets: tuple[str, ...]) -> Any:
    """The run's EventLog; an unwritable path or one that is not a regular file (a FIFO, ``/dev/full``)
    is a UsageError naming ``--log-file`` (exit 2, nothing started)."""
    from pipeline.core.eventlog import EventLog

    try:
        return EventLog(run_id, rank, path, secrets=secrets, flag="--log-file", raise_write_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write the log file {path!r}: {e.strerror or e}", code="usage",
                         flags=[("--log-file", template)], remedy="pick a writable path for --log-file") from None


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

    check_startup_flags(ns)
    if ns.decode_steps < 0:
        raise UsageError(f"--decode-steps {ns.decode_steps} must be >= 0", code="usage",
                         flags=[("--decode-steps", ns.decode_steps)], allowed=[">= 0"], remedy="pass --decode-steps 3")
    check_context(runner.request, ns.decode_steps)
    pre = runner.preflight()
    if pre.refused is None:
        check_warm_cache(ns, runner, pre)
        return
    state, err = pre.refused
    if state == "attention":  # logged where it happened in the setup machine
        build_attention_backends(attention_request(runner), log=log, rank_group=group, decided=pre[state])
    raise err


def check_context(request: SetupRequest, decode_steps: int) -> None:
    """Refuse a ``--max-context-len`` shorter than the longest request ``run``'s checks reach: the built instances
    are verified on a 5-request batch and the model steps on a 4-request one
    (:func:`pipeline.runtime.verify.context_needed`, :func:`pipeline.runtime.model_steps.context_needed`);
    ConfigError ``invalid_value`` naming the minimum."""
    from pipeline.core.validation import MAX_POOL_DIM
    from pipeline.runtime import model_steps, verify

    p = request.pool
    ctx = max(verify.context_needed(p.max_reqs, decode_steps), model_steps.context_needed(p.max_reqs, decode_steps))
    if p.max_context_len < ctx:
        raise ConfigError(f"--max-context-len {p.max_context_len} is shorter than the {ctx} tokens the longest "
                          f"verification request reaches with --decode-steps {decode_steps}", code="invalid_value",
                          flags=[("max_context_len", p.max_context_len), ("decode_steps", decode_steps)],
                          allowed=[f">= {ctx}"],
                          remedy=f"pass --max-context-len {ctx} or more" if ctx <= MAX_POOL_DIM else
                          f"lower --decode-steps (--max-context-len is at most {MAX_POOL_DIM})")


def check_warm_cache(ns: argparse.Namespace, runner: Any, pre: Any) -> None:
    """``--require-warm-cache``: refuse (ConfigError ``cold_jit_cache``, exit 3) a run whose FlashInfer variants
    would compile at startup, from the decisions the preflight made (the device facts and the resolved pair the
    run then takes), before anything is allocated."""
    if not getattr(ns, "require_warm_cache", False):
        return
    from pipeline.cli.jit import check_warm, cold_report
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
    :func:`pipeline.runtime.verify.slots_needed`, :func:`pipeline.runtime.model_steps.slots_needed`)."""
    from pipeline.core.model_spec import layers_covering_every_kind
    from pipeline.runtime import model_steps, verify
    from pipeline.runtime.runner import RunnerConfig

    default = layers_covering_every_kind(request.served_model, DEFAULT_LAYERS)
    layers = ns.num_layers if ns.num_layers is not None else max(default, 1)
    p, ps, steps = request.pool, request.args.page_size, max(ns.decode_steps, 0)
    need = max(verify.slots_needed(p.max_reqs, ps, steps), model_steps.slots_needed(p.max_reqs, ps, steps))
    return RunnerConfig(request=request, num_layers=layers, num_token_slots=ns.num_token_slots,
                        mem_bytes=ns.mem_bytes, mem_fraction=ns.mem_fraction, min_token_slots=need,
                        min_token_slots_for=f"the verification batches with --decode-steps {steps}")


def _model_steps(runner: Any, log: Any, decode_steps: int) -> list[dict[str, Any]]:
    from pipeline.runtime.model_steps import verify_model_steps

    out = []
    for c in verify_model_steps(runner, decode_steps=decode_steps):
        log.emit(ev.ModelStepVerified, state="ready", outcome="ok" if c.passed else "failed", step=c.step,
                 mode=c.mode, batch_size=c.batch_size, graph=c.graph, max_rel_err=c.max_rel_err, tol=c.tol,
                 passed=c.passed)
        out.append({"step": c.step, "mode": c.mode, "batch_size": c.batch_size, "graph": c.graph,
                    "max_rel_err": c.max_rel_err, "tol": c.tol, "passed": c.passed})
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
    run.add_argument("--decode-steps", type=int, default=3, help="decode steps verified after the extend")
    run.add_argument("--num-layers", type=int, default=None,
                     help=f"build only the first N attention layers (default {DEFAULT_LAYERS}, or as many as it takes "
                          "to include every attention layer kind; a hybrid model's linear-attention / mamba layers "
                          "are skipped, not counted)")
    run.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                     help="under torchrun (WORLD_SIZE > 1): seconds to wait for the rendezvous (then "
                          "rank_exchange_failed) and for every rank at each of our waits (then rank_stalled, naming "
                          "the rank, its last state and what it was doing) "
                          "(default: $ATTN_SETUP_DIST_TIMEOUT, else 60)")
    run.add_argument("--max-memory-imbalance", type=float, default=None, metavar="FRACTION",
                     help="under torchrun: the allowed spread of free device memory between ranks at device-init, "
                          "a fraction of the largest; more fails every rank with memory_imbalance "
                          "(default: $ATTN_SETUP_MAX_MEMORY_IMBALANCE, else 0.1 as sglang; 1 = no check)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--mem-fraction", type=float, default=None,
                        help="size the KV pool from this share of device memory (sglang's mem_fraction_static; "
                             "default: unset, the pool has --num-token-slots slots)")
    budget.add_argument("--mem-bytes", type=int, default=None,
                        help="size the KV pool from this many bytes (default: unset, as --mem-fraction)")
    from pipeline.cli.startup import add_startup_flags

    add_startup_flags(run)
    return run


def _print_notices(ns: argparse.Namespace, request: SetupRequest, on_gpu: bool, in_group: bool) -> None:
    """Print :func:`pipeline.cli.notices.run_notices` on stderr (never stdout: ``--json`` stays one object)."""
    from pipeline.cli.notices import run_notices

    try:
        lines = run_notices(ns, request, runner_config(ns, request).num_layers, in_group)
    except AttnSetupError:
        return  # a request the checks that follow refuse, with the error that names it: nothing to announce
    for line in lines:
        print(f"notice: {line}", file=sys.stderr, flush=True)


def _progress(ns: argparse.Namespace, log: Any, request: SetupRequest) -> Any:
    """The terminal progress line (:mod:`pipeline.observe.progress`), started; nothing on a non-TTY / --json / --no-progress."""
    from pipeline.observe.progress import progress_for

    p = progress_for(ns, log, request)
    p.__enter__()
    return p


def _process_start(ns: argparse.Namespace) -> Optional[int]:
    from pipeline.observe.startup import process_start_ns

    return process_start_ns()


def _summary(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], start_ns: Optional[int]) -> Any:
    """``startup_summary`` (and ``slow_phase`` warnings, the ``--metrics-file``); never raises (an exit path)."""
    from pipeline.cli.startup import finish_startup

    return finish_startup(ns, log, jit, start_ns)


def _jit(runner: Any) -> list[dict[str, Any]]:
    """The FlashInfer JIT variants the runner's backends loaded, read before ``close()`` releases them."""
    from pipeline.cli.startup import jit_reports

    try:
        return jit_reports(runner)
    except Exception:  # noqa: BLE001 - an exit path: the summary goes on without them
        return []


def summary_obj(summary: Any) -> Any:
    return None if summary is None else msgspec.to_builtins(summary)


def _ended(log: Any) -> bool:
    return any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in log.records)


def _rank_group(ns: argparse.Namespace) -> Any:
    """Under torchrun (WORLD_SIZE > 1) the launch's RankGroup, its rank, world size and device written back into
    ``ns``; None otherwise. ``--dist-timeout`` (else ``ATTN_SETUP_DIST_TIMEOUT``, else 60 s) and
    ``--max-memory-imbalance`` (else its variable, else 0.1) are checked with one rank too."""
    from pipeline.setup.distributed import check_timeout, init_from_env
    from pipeline.setup.rank_digest import max_imbalance_from
    from pipeline.setup.rank_watch import timeout_from_env

    timeout = timeout_from_env(60.0) if ns.dist_timeout is None else check_timeout(ns.dist_timeout)
    spread = max_imbalance_from(ns.max_memory_imbalance)
    group = init_from_env(ns.device, timeout_s=timeout, max_memory_imbalance=spread)
    if group is not None:
        ns.rank, ns.world_size, ns.device = group.rank, group.world_size, group.device
    return group


def cmd(ns: argparse.Namespace) -> int:
    """Run the runner flow, verify every instance and the stack's steps, print the report; returns the exit code.

    Every exit once the log is open writes a terminal record: ``run_failed`` for a refusal, a
    crash or a failed verification (``run_interrupted`` first on SIGINT/SIGTERM), and on every
    exit it controls ``command_finished`` with the exit code — ``inspect`` calls the launch ok
    only when that says 0. SIGINT ends with exit 130 (as SIGTERM ends with its signal), after
    the unwinding released what was built. A trace-file write that fails stops the run there: exit 2
    naming ``--log-file`` (``log_write_failed``), what was built released.
    """
    import time

    from pipeline.runtime.runner import Runner
    from pipeline.setup.build import new_run_id

    from pipeline.observe.startup import timed_torch_import

    ns._torch_import = timed_torch_import()  # named in the startup summary and the progress line (cold start)
    check_num_layers(ns)
    group = _rank_group(ns)
    on_gpu = is_gpu_device(ns.device)
    request = request_from(ns, on_gpu=on_gpu)
    _print_notices(ns, request, on_gpu, group is not None)
    run_id = group.run_id if group is not None else new_run_id()
    log_file = log_path(ns.log_file, run_id, request.rank)
    log = open_log(log_file, ns.log_file, run_id, request.rank, tuple(request.secrets.values()))
    t0 = time.perf_counter()
    t_start = _process_start(ns)
    error: Optional[ErrorInfo] = None
    code, runner, verified, steps, progress = EXIT_OK, None, [], [], None
    try:
        log.install_signal_handlers()
        log.emit(ev.CommandStarted, state="args", command="run", argv=list(getattr(ns, "_argv", [])))
        from pipeline.cli.startup import warn_env_lookalikes

        warn_env_lookalikes(log)
        progress = _progress(ns, log, request)
        runner = Runner(runner_config(ns, request), log=log, rank_group=group)
        preflight(ns, runner, log, group)
        runner.initialize()
        verified, steps, error = _verify_runner(runner, log, ns.decode_steps)
        code = EXIT_OK if error is None else EXIT_FAILED
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any crash becomes an exit code with its ErrorInfo
        error, code = _ended_by(e, log)
    finally:
        if progress is not None:
            progress.__exit__(None, None, None)
        jit = _jit(runner)  # before close(): closing releases the backends that know what they loaded
        try:
            if runner is not None:
                runner.close()
            if group is not None:
                group.close()
        finally:
            if log.write_error is not None and code == EXIT_OK:
                error, code = log.write_error.info, log.write_error.exit_code
            summary = _summary(ns, log, jit, t_start)
            log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
                     duration_ms=(time.perf_counter() - t0) * 1e3)
            log.close()
            log.restore_signal_handlers()
    report = _report(log, run_id, code, verified, steps, log_file, error)
    report["warnings"] += rp.layer_rule_warnings(request)
    report["summary"] = summary_obj(summary)
    _print(ns, report, log.records, request, error, code)
    return code


def check_num_layers(ns: argparse.Namespace) -> None:
    """Refuse ``--num-layers`` below 1 as the flags are read (UsageError, exit 2, before any rendezvous, log or
    model load), naming the range the model allows (``1..`` its attention layers). A value above that range is the
    preflight's refusal (``invalid_value``, exit 3: the flag is well-formed, the model has fewer layers)."""
    if ns.num_layers is None or ns.num_layers >= 1:
        return
    from pipeline.cli.request import load_models
    from pipeline.core.model_spec import layers_covering_every_kind
    from pipeline.core.spec import attention_layer_ids

    model, draft = load_models(ns)
    served = draft if draft is not None and ns.draft_worker else model
    top = len(attention_layer_ids(served))
    raise UsageError(f"--num-layers {ns.num_layers} builds no layer: it counts the attention layers to build, "
                     f"1..{top} for {served.model_type}", code="usage", flags=[("--num-layers", ns.num_layers)],
                     allowed=[f"1..{top}"], remedy=f"pass --num-layers between 1 and {top}, or drop it (default "
                     f"{max(layers_covering_every_kind(served, DEFAULT_LAYERS), 1)} for this model)")


def _verify_runner(runner: Any, log: Any, decode_steps: int) -> tuple[list, list, Optional[ErrorInfo]]:
    """Verify every built instance and the stack's steps (each logged); a failure is logged as ``run_failed``
    (:func:`pipeline.observe.runview.verification_failure`, the one builder ``inspect`` also uses)."""
    from pipeline.observe.runview import verification_failure

    verified = _verify(runner.backends, runner.request, log, decode_steps, runner.pools)
    steps = _model_steps(runner, log, decode_steps)
    error = verification_failure(log.records)
    if error is not None:
        log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    return verified, steps, error


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
        code = EXIT_INTERRUPTED
    else:
        error, code = error_info_from(e, log.current_state), EXIT_FAILED
    if not _ended(log):
        if isinstance(e, KeyboardInterrupt):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal", signal="SIGINT",
                     error=error)
        else:
            log.emit(ev.RunFailed, state=error.state if isinstance(e, AttnSetupError) else log.current_state,
                     outcome="failed", error=error)
    return error, code


def _print(ns: argparse.Namespace, report: dict[str, Any], records: Any, request: SetupRequest,
           error: Optional[ErrorInfo], code: int = EXIT_OK) -> None:
    """``--json``'s object (unchanged), or the runner timeline, the tables and — for a failed run, last, where the
    eye lands when the prompt returns — the error in the command line's flags under a red rule that says the run
    failed and its exit code (new-user trial #2: the error sat between the tables)."""
    if ns.json:
        rp.emit_json(report)
        return
    _render_runner(report, records, request)
    rp.render_tables({**report, "states": []})  # the setup states are in the runner timeline above
    from pipeline.cli.startup import render_summary

    render_summary(report["summary"])
    if error is not None:
        from pipeline.cli.console import console
        from pipeline.cli.wording import cli_error, command_dests

        sys.stdout.flush()  # the tables are out before the error (one terminal, two streams)
        console(stderr=True).rule(f"[bold red]attn-setup run failed (exit {code})[/]", style="red", align="left")
        rp.render_error(cli_error(error, command_dests("run")))


def _report(log: Any, run_id: str, code: int, verified: list, steps: list, log_file: str,
            error: Optional[ErrorInfo]) -> dict[str, Any]:
    """Run's JSON object; the error's remedy in this command line's flags."""
    from pipeline.cli.wording import cli_error, command_dests
    from pipeline.observe.runview import outcomes

    return {
        "ok": code == EXIT_OK, "run_id": run_id, "states": outcomes(log.records, "setup"),
        "resolved": rp.resolved_from(log.records), "plan": rp.plan_from(log.records),
        "skips": rp.skips_from(log.records), "warnings": rp.warnings_from(log.records), "verified": verified,
        "log_file": os.path.abspath(log_file),
        "error": None if error is None else msgspec.to_builtins(cli_error(error, command_dests("run"))),
        "runner_states": outcomes(log.records, "runner"), "model_steps": steps,
    }


def model_line(request: SetupRequest, records: Any) -> str:
    """``model: llama (LlamaForCausalLM) from PATH, 2 of 32 layers built`` (+ the draft model on a draft worker)."""
    built = next((r.num_layers for r in records if isinstance(r, ev.ModelLoaded)), None)

    def one(m: ModelSpec, serves: bool) -> str:
        arch = f" ({', '.join(m.architectures)})" if m.architectures else ""
        layers = f", {built} of {m.num_hidden_layers} layers built" if serves and built is not None else ""
        return f"{m.model_type}{arch} from {m.source or 'a dict'}{layers}"

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


def _graph_line(records: Any) -> Optional[str]:
    """``CUDA graphs: 4 sizes captured, graph pool 2.0 MiB (estimated 2.0 MiB), capture step took 60.0 MiB of the
    device (estimated 78.0 MiB)`` from the ``cuda_graph_memory`` event (None without one)."""
    m = next((r for r in records if isinstance(r, ev.CudaGraphMemory)), None)
    if m is None:
        return None
    return (f"CUDA graphs: {len(m.batch_sizes)} sizes captured, graph pool {rp.fmt_bytes(m.pool_bytes)} (estimated "
            f"{rp.fmt_bytes(m.pool_estimate)}), capture step took {rp.fmt_bytes(m.step_device_bytes)} of the device "
            f"(estimated {rp.fmt_bytes(m.total_estimate)})")


def _render_runner(report: dict[str, Any], records: Any = (), request: Optional[SetupRequest] = None) -> None:
    """The model, the timeline (runner states with the setup states nested) and the stack's verified steps,
    at the terminal's width (:mod:`pipeline.cli.console`)."""
    from pipeline.cli.console import console, print_line, print_table

    c = console()
    if request is not None:
        print_line(c, model_line(request, records))
    for line in (_pool_line(records), _graph_line(records)):
        if line:
            print_line(c, line)
    rows = timeline_rows(report)
    if rows:
        print_table(c, timeline_title(report), ["state", "outcome", "duration ms"],
                    [[label, outcome, f"{ms:.1f}"] for label, outcome, ms in rows])
    if report["model_steps"]:
        print_table(c, "attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                    ["step", "bs", "graph", "max rel err", "tol", "passed"],
                    [[s["step"], str(s["batch_size"]), "yes" if s["graph"] else "no", f"{s['max_rel_err']:.2e}",
                      f"{s['tol']:.0e}", "yes" if s["passed"] else "NO"] for s in report["model_steps"]])
