"""``attn-setup run``: the runner flow, then verification on real batches.

Every device goes through the same runner states (:mod:`pipeline.runner`): init-distributed,
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
from pathlib import Path
from typing import Any, Optional

import msgspec

from pipeline import events as ev
from pipeline import report as rp
from pipeline.contracts import ErrorInfo, ModelSpec, PoolFacts, SetupRequest
from pipeline.errors import (
    EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, AttnSetupError, ConfigError, UsageError, error_info_from,
)

BUNDLED_MODEL = "llama-3.1-8b.json"
DEFAULT_LAYERS = 2  # a verification run: at least 2 layers, more when a layer kind first appears later (quick on CPU)


def default_model_path() -> str:
    """The bundled Llama-3.1-8B config (package data; same file as examples/configs/)."""
    return str(Path(__file__).parent / "data" / "configs" / BUNDLED_MODEL)


def _load_spec(path: str, flag: str) -> ModelSpec:
    """load_model_spec, with file errors (unreadable, not a regular file, too large) naming ``flag`` too."""
    from pipeline.contracts import Flag
    from pipeline.model_spec import load_model_spec

    try:
        return load_model_spec(path)
    except UsageError as e:
        e.info = msgspec.structs.replace(e.info, flags=[Flag(name=flag, value=path), *e.info.flags],
                                         remedy=e.info.remedy.replace(" as path", f" as {flag}"))
        raise


def load_models(ns: argparse.Namespace) -> tuple[ModelSpec, Optional[ModelSpec]]:
    model = _load_spec(ns.model, "--model") if ns.model else _load_spec(default_model_path(), "--model")
    draft = _load_spec(ns.draft_model, "--draft-model") if ns.draft_model else None
    if draft is not None and not ns.draft_worker:
        raise UsageError("--draft-model is only meaningful with --draft-worker", code="usage",
                         flags=[("--draft-model", ns.draft_model)], remedy="add --draft-worker, or drop --draft-model")
    return model, draft


def pool_facts(ns: argparse.Namespace, args: Any, on_gpu: bool) -> PoolFacts:
    """Pool sizes from the flags (explicit values are checked, never replaced); defaults are CPU-friendly.

    Raises ConfigError for a ``--num-token-slots`` that is not whole pages (only the default is
    rounded up to whole pages) and, via PoolFacts, for values below 1.
    """
    ps = args.page_size
    if ns.num_token_slots is not None and ns.num_token_slots > 0 and ns.num_token_slots % ps:
        raise ConfigError(f"--num-token-slots {ns.num_token_slots} is not a whole number of pages of {ps} tokens",
                          code="invalid_value", flags=[("num_token_slots", ns.num_token_slots), ("page_size", ps)],
                          allowed=[f"a multiple of {ps}"],
                          remedy=f"use --num-token-slots {-(-ns.num_token_slots // ps) * ps} (or another multiple)")
    slots = ns.num_token_slots if ns.num_token_slots is not None else -(-(65536 if on_gpu else 1024) // ps) * ps
    return PoolFacts(max_reqs=8 if ns.max_reqs is None else ns.max_reqs,
                     max_context_len=1024 if ns.max_context_len is None else ns.max_context_len,
                     num_token_slots=slots, page_size=ps)


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
    from pipeline.eventlog import EventLog

    try:
        return EventLog(run_id, rank, path, secrets=secrets, flag="--log-file", raise_write_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write the log file {path!r}: {e.strerror or e}", code="usage",
                         flags=[("--log-file", template)], remedy="pick a writable path for --log-file") from None


def preflight(ns: argparse.Namespace, request: SetupRequest, log: Any, group: Any) -> None:
    """Refuse, before the runner loads the model or sizes the pools, what the pipeline would refuse.

    Checks flag values, the env settings, that the device exists, ``--mem-bytes`` against its
    memory, the pool against what ``run`` verifies (:func:`check_pool_for_checks`), and every decision
    up to allocation (:func:`pipeline.build.decide_offline`: the resolution with ``--strict``, the
    CUDA-graph sizes against ``--max-reqs`` and the FlashInfer workspace bound) on every device. A
    refusal is run through the pipeline so the log records device-init → resolve (or build-mode) →
    failed with the ErrorInfo (it fails before the pools, so nothing is allocated there).
    """
    from pipeline import settings
    from pipeline.build import build_attention_backends, decide_offline, installed_by_import
    from pipeline.platforms import parse_device, platform_for

    from pipeline.cli_startup import check_startup_flags

    check_startup_flags(ns)
    if ns.decode_steps < 0:
        raise UsageError(f"--decode-steps {ns.decode_steps} must be >= 0", code="usage",
                         flags=[("--decode-steps", ns.decode_steps)], allowed=[">= 0"], remedy="pass --decode-steps 3")
    settings.zbal_local_mem_size(request.args)
    settings.flashinfer_workspace_size(request.args, request.served_model)
    platform, index = platform_for(request.device), parse_device(request.device)[1]
    facts = platform.device_facts(index)
    if ns.mem_bytes is not None and facts.total_memory_bytes and ns.mem_bytes > facts.total_memory_bytes:
        raise ConfigError(f"--mem-bytes {ns.mem_bytes} exceeds the device's {facts.total_memory_bytes} bytes",
                          code="invalid_value", flags=[("mem_bytes", ns.mem_bytes)],
                          allowed=[f"<= {facts.total_memory_bytes}"], remedy="lower --mem-bytes or use --mem-fraction")
    if ns.mem_fraction is not None:
        from pipeline.pool_sizing import check_mem_fraction

        try:
            check_mem_fraction(ns.mem_fraction)
        except ConfigError as e:  # "such as 0.8" is not true everywhere (0.8 of a CPU host's memory is refused)
            raise ConfigError(f"--mem-fraction {ns.mem_fraction} is outside (0, 1]", code=e.info.code,
                              flags=[("mem_fraction", ns.mem_fraction)], allowed=list(e.info.allowed),
                              remedy=_fraction_remedy(ns, request, platform, index)) from None
    check_pool_for_checks(ns, request, platform, index)
    try:
        res, _ = decide_offline(request, facts, installed_by_import())
        from pipeline.cli_jit import check_warm, cold_report

        if getattr(ns, "require_warm_cache", False):
            check_warm(ns, cold_report(request, facts, res.pair))
    except ConfigError:
        # fails again in resolve or build-mode, before the pools: logged, nothing allocated
        build_attention_backends(request, log=log, rank_group=group)
        raise


def _fraction_remedy(ns: argparse.Namespace, request: SetupRequest, platform: Any, index: int) -> str:
    """A ``--mem-fraction`` remedy that is true on this device: the largest share (in hundredths, up to 0.9)
    whose pools both hold the verification batches and fit its free memory (:func:`check_pool_for_checks`,
    sizing only — nothing is allocated), or, when none does, the default sizing (drop the flag)."""
    given = ns.mem_fraction
    try:
        for pct in range(90, 0, -1):
            ns.mem_fraction = pct / 100
            try:
                check_pool_for_checks(ns, request, platform, index)
            except ConfigError:
                continue
            return (f"pass --mem-fraction {pct / 100:g} or less (the largest share of this device's memory whose "
                    "pools fit and hold the verification batches; sglang's mem_fraction_static), or drop it")
    finally:
        ns.mem_fraction = given
    return "drop --mem-fraction (the pools are then sized from --num-token-slots)"


def check_pool_for_checks(ns: argparse.Namespace, request: SetupRequest, platform: Any = None,
                          index: int = 0) -> None:
    """Refuse, before the model loads, a pool too small for what ``run`` verifies or too big for memory.

    The built instances are verified on a 5-request batch and the model steps on a 4-request one:
    ``--max-context-len`` must hold their longest request (:func:`pipeline.verify.context_needed`,
    :func:`pipeline.runner_verify.context_needed`; ConfigError ``invalid_value`` naming the minimum),
    and :func:`pipeline.pool_sizing.size_pools` is asked for at least the slots they take
    (:func:`pipeline.verify.slots_needed`, :func:`pipeline.runner_verify.slots_needed`, whole pages each)
    from ``--num-token-slots`` or a ``--mem-bytes`` budget (``--mem-fraction``'s floor is checked after
    the weights load, since they count against it); ConfigError ``pool_budget_too_small`` naming the flag.
    With ``platform``, the pools these flags give (the default slots, or ``--mem-fraction`` of the
    device's memory) must fit its free memory (:func:`pipeline.pool_sizing.check_fits`).
    """
    from pipeline import runner_verify, verify
    from pipeline.model_spec import attention_layer_ids, attention_prefix, layers_covering_every_kind
    from pipeline.pool_sizing import available_bytes, budget_from_fraction, check_fits, size_pools
    from states.capability_check import kv_dtype

    p, ps, steps, model = request.pool, request.args.page_size, max(ns.decode_steps, 0), request.served_model
    ctx = max(verify.context_needed(p.max_reqs, steps), runner_verify.context_needed(p.max_reqs, steps))
    if p.max_context_len < ctx:
        from pipeline.validation import MAX_POOL_DIM

        raise ConfigError(f"--max-context-len {p.max_context_len} is shorter than the {ctx} tokens the longest "
                          f"verification request reaches with --decode-steps {steps}", code="invalid_value",
                          flags=[("max_context_len", p.max_context_len), ("decode_steps", steps)],
                          allowed=[f">= {ctx}"],
                          remedy=f"pass --max-context-len {ctx} or more" if ctx <= MAX_POOL_DIM else
                          f"lower --decode-steps (--max-context-len is at most {MAX_POOL_DIM})")
    n = len(attention_layer_ids(model))  # --num-layers counts attention layers (a hybrid's others hold no KV)
    if n == 0:
        return  # nothing to size: resolve refuses a model without attention layers
    default = layers_covering_every_kind(model, DEFAULT_LAYERS)
    attn = min(ns.num_layers if ns.num_layers is not None and ns.num_layers > 0 else default, n)
    layers = attention_prefix(model, attn)
    kinds, kvd = model.layer_kinds(), kv_dtype(request.args, model)
    total, allocated = 0, 0
    need = max(verify.slots_needed(p.max_reqs, ps, steps), runner_verify.slots_needed(p.max_reqs, ps, steps))
    if ns.num_token_slots is not None or ns.mem_bytes is not None:
        s = size_pools(kinds, layers, kvd, page_size=ps, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
                       num_token_slots=ns.num_token_slots, budget_bytes=ns.mem_bytes, source="bytes", min_slots=need,
                       min_slots_for=f"the verification batches with --decode-steps {steps}")
    elif ns.mem_fraction is not None and platform is not None:
        total, allocated = platform.device_facts(index).total_memory_bytes, platform.memory_allocated(index)
        budget = budget_from_fraction(ns.mem_fraction, total, allocated)
        s = size_pools(kinds, layers, kvd, page_size=ps, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
                       budget_bytes=max(budget, 0), source="mem_fraction", mem_fraction=ns.mem_fraction)
    else:
        # the default slots too must hold the verification batches: a remedy naming only the two-page floor
        # was not enough when followed (--page-size 4096 asked for 8192 slots, then for 24576)
        s = size_pools(kinds, layers, kvd, page_size=ps, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
                       num_token_slots=p.num_token_slots, min_slots=need,
                       min_slots_for=f"the verification batches with --decode-steps {steps}")
    if platform is not None:
        check_fits(s, available_bytes(platform, index), device=platform.torch_device(index), total_bytes=total,
                   allocated_bytes=allocated, mem_fraction=ns.mem_fraction)


def request_from(ns: argparse.Namespace, *, on_gpu: bool) -> SetupRequest:
    from pipeline import settings
    from pipeline.cli import attention_args_from
    from pipeline.eventlog import secrets_from_env

    args = attention_args_from(ns)
    settings.check_env()  # SGLANG_* size variables pass the same check as their flags
    model, draft = load_models(ns)
    return SetupRequest(args=args, model=model, draft_model=draft, is_draft_worker=ns.draft_worker,
                        device=getattr(ns, "device", "cpu"), rank=ns.rank, world_size=ns.world_size,
                        pool=pool_facts(ns, args, on_gpu), secrets=secrets_from_env())


def _on_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def runner_config(ns: argparse.Namespace, request: SetupRequest, on_gpu: bool) -> Any:
    """The RunnerConfig from the flags (default on every device: the first 2 attention layers, or as many as
    it takes to include one layer of every attention kind, e.g. 4 for Llama-4, 6 for Gemma-3)."""
    from pipeline.model_spec import layers_covering_every_kind
    from pipeline.runner import RunnerConfig

    default = layers_covering_every_kind(request.served_model, DEFAULT_LAYERS)
    layers = ns.num_layers if ns.num_layers is not None else max(default, 1)
    return RunnerConfig(request=request, num_layers=layers, num_token_slots=ns.num_token_slots,
                        mem_bytes=ns.mem_bytes, mem_fraction=ns.mem_fraction)


def runner_states(records: Any) -> list[dict[str, Any]]:
    """``[{state, outcome, duration_ms}]`` of the runner's outer machine, from its transition records."""
    skipped = {r.state for r in records if isinstance(r, ev.StepSkipped) and r.what == "cuda_graph_capture"}
    out, last = [], None
    for r in records:
        if isinstance(r, ev.RunnerTransition):
            outcome = "failed" if r.to == "failed" else ("skipped" if r.from_state in skipped else "ok")
            out.append({"state": r.from_state, "outcome": outcome, "duration_ms": round(r.duration_ms, 3)})
            last = r.to
    if last in ("ready", "failed"):
        out.append({"state": last, "outcome": "ok" if last == "ready" else "failed", "duration_ms": 0.0})
    return out


def _model_steps(runner: Any, log: Any, decode_steps: int) -> list[dict[str, Any]]:
    from pipeline.runner_verify import verify_model_steps

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
    from pipeline.verify import verify_built

    out = []
    for r in verify_built(backends, request, pools=pools, decode_steps=decode_steps):
        log.emit(ev.InstanceVerified, state="done", outcome="ok" if r.passed else "failed", role=r.role,
                 backend=r.backend, max_rel_err=r.max_rel_err, tol=r.tol, passed=r.passed, duration_ms=r.duration_ms)
        out.append({"role": r.role, "backend": r.backend, "max_rel_err": r.max_rel_err, "passed": r.passed,
                    "tol": r.tol, "detail": r.detail})
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.cli import add_setup_flags

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
    from pipeline.cli_startup import add_startup_flags

    add_startup_flags(run)
    return run


def _print_notices(ns: argparse.Namespace, request: SetupRequest, on_gpu: bool, in_group: bool) -> None:
    """Print :func:`pipeline.run_notices.run_notices` on stderr (never stdout: ``--json`` stays one object)."""
    from pipeline.run_notices import run_notices

    try:
        lines = run_notices(ns, request, runner_config(ns, request, on_gpu).num_layers, in_group)
    except AttnSetupError:
        return  # a request the checks that follow refuse, with the error that names it: nothing to announce
    for line in lines:
        print(f"notice: {line}", file=sys.stderr, flush=True)


def _progress(ns: argparse.Namespace, log: Any, request: SetupRequest) -> Any:
    """The terminal progress line (:mod:`pipeline.progress`), started; nothing on a non-TTY / --json / --no-progress."""
    from pipeline.progress import progress_for

    p = progress_for(ns, log, request)
    p.__enter__()
    return p


def _process_start(ns: argparse.Namespace) -> Optional[int]:
    from pipeline.startup import process_start_ns

    return process_start_ns()


def _summary(ns: argparse.Namespace, log: Any, runner: Any, start_ns: Optional[int]) -> Any:
    """``startup_summary`` (and ``slow_phase`` warnings, the ``--metrics-file``); never raises (an exit path)."""
    from pipeline.cli_startup import finish_startup

    return finish_startup(ns, log, runner, start_ns)


def summary_obj(summary: Any) -> Any:
    return None if summary is None else msgspec.to_builtins(summary)


def _ended(log: Any) -> bool:
    return any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in log.records)


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

    from pipeline.build import new_run_id
    from pipeline.runner import Runner

    from pipeline.distributed import check_timeout, init_from_env
    from pipeline.rank_watch import timeout_from_env

    from pipeline.rank_digest import max_imbalance_from

    timeout = timeout_from_env(60.0) if ns.dist_timeout is None else check_timeout(ns.dist_timeout)
    spread = max_imbalance_from(ns.max_memory_imbalance)  # checked with one rank too
    group = init_from_env(ns.device, timeout_s=timeout, max_memory_imbalance=spread)  # None unless WORLD_SIZE > 1
    if group is not None:
        ns.rank, ns.world_size, ns.device = group.rank, group.world_size, group.device
    on_gpu = _on_gpu(ns.device)
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
        from pipeline.cli_startup import warn_env_lookalikes

        warn_env_lookalikes(log)
        progress = _progress(ns, log, request)
        preflight(ns, request, log, group)
        runner = Runner(runner_config(ns, request, on_gpu), log=log, rank_group=group)
        runner.initialize()
        verified = _verify(runner.backends, runner.request, log, ns.decode_steps, runner.pools)
        steps = _model_steps(runner, log, ns.decode_steps)
        bad = [v["role"] for v in verified if not v["passed"]] + [f"model:{s['step']}" for s in steps if not s["passed"]]
        if bad:
            error = ErrorInfo(code="verification_failed", state="done", message=f"failed verification: {', '.join(bad)}",
                              remedy="the backend computes wrong attention for this model; report it with the log")
            code = EXIT_FAILED
            log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    except AttnSetupError as e:
        error, code = e.info, e.exit_code
        if not _ended(log):  # refused in preflight
            log.emit(ev.RunFailed, state=e.info.state, outcome="failed", error=e.info)
    except KeyboardInterrupt as e:  # SIGINT: the handler wrote run_interrupted; the unwinding released
        # report the state the signal arrived in (the handler's record), not 'failed', where the unwinding ended
        seen = next((r for r in reversed(log.records) if isinstance(r, ev.RunInterrupted)), None)
        error = seen.error if seen is not None else error_info_from(e, next(
            (r.state for r in reversed(log.records) if r.state != "failed"), log.current_state))
        code = EXIT_INTERRUPTED
        if not _ended(log):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal", signal="SIGINT",
                     error=error)
    except Exception as e:  # noqa: BLE001 - any crash becomes exit 1 with its ErrorInfo, logged
        error, code = error_info_from(e, log.current_state), EXIT_FAILED
        if not _ended(log):
            log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    finally:
        if progress is not None:
            progress.__exit__(None, None, None)
        try:
            if runner is not None:
                runner.close()
            if group is not None:
                group.close()
        finally:
            if log.write_error is not None and code == EXIT_OK:
                error, code = log.write_error.info, log.write_error.exit_code
            summary = _summary(ns, log, runner, t_start)
            log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
                     duration_ms=(time.perf_counter() - t0) * 1e3)
            log.close()
            log.restore_signal_handlers()
    report = _report(log, run_id, code, verified, steps, log_file, error)
    report["summary"] = summary_obj(summary)
    if ns.json:
        rp.emit_json(report)
    else:
        _render_runner(report, log.records, request)
        rp.render_tables({**report, "states": []})  # the setup states are in the runner timeline above
        from pipeline.cli_startup import render_summary

        render_summary(report["summary"])
        if error is not None:
            from pipeline.wording import cli_error

            rp.render_error(cli_error(error))
    return code


def _report(log: Any, run_id: str, code: int, verified: list, steps: list, log_file: str,
            error: Optional[ErrorInfo]) -> dict[str, Any]:
    """Run's JSON object; the error's remedy in this command line's flags."""
    from pipeline.wording import cli_error

    return {
        "ok": code == EXIT_OK, "run_id": run_id, "states": rp.states_from(log.records),
        "resolved": rp.resolved_from(log.records), "plan": rp.plan_from(log.records),
        "skips": rp.skips_from(log.records), "warnings": rp.warnings_from(log.records), "verified": verified,
        "log_file": os.path.abspath(log_file),
        "error": None if error is None else msgspec.to_builtins(cli_error(error)),
        "runner_states": runner_states(log.records), "model_steps": steps,
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
    return (f"KV pool: {r.num_token_slots} token slots x {rp.fmt_bytes(r.bytes_per_token)} = {rp.fmt_bytes(r.kv_bytes)} "
            f"(from {r.source}), req_to_token {r.max_reqs} x {r.max_context_len} = {rp.fmt_bytes(r.req_to_token_bytes)}")


def _render_runner(report: dict[str, Any], records: Any = (), request: Optional[SetupRequest] = None) -> None:
    """The model, the timeline (runner states with the setup states nested) and the stack's verified steps."""
    from rich.console import Console
    from rich.table import Table

    c = Console(highlight=False, soft_wrap=False, width=120)
    if request is not None:
        c.print(model_line(request, records), markup=False, soft_wrap=True)
    pool = _pool_line(records)
    if pool:
        c.print(pool, markup=False, soft_wrap=True)
    rows = timeline_rows(report)
    if rows:
        t = Table(title="timeline (setup states under attention)", title_justify="left")
        for col in ("state", "outcome", "duration ms"):
            t.add_column(col)
        for label, outcome, ms in rows:
            t.add_row(label, outcome, f"{ms:.1f}")
        c.print(t)
    if report["model_steps"]:
        t = Table(title="attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                  title_justify="left")
        for col in ("step", "bs", "graph", "max rel err", "tol", "passed"):
            t.add_column(col)
        for s in report["model_steps"]:
            t.add_row(s["step"], str(s["batch_size"]), "yes" if s["graph"] else "no", f"{s['max_rel_err']:.2e}",
                      f"{s['tol']:.0e}", "yes" if s["passed"] else "NO")
        c.print(t)
