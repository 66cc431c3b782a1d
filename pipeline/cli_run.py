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
DEFAULT_LAYERS = 2  # a verification run: enough for every alternating layer pattern, quick on CPU


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
    memory, the pool against what ``run`` verifies (:func:`check_pool_for_checks`), and the resolution; a refused resolution is run through the pipeline so the log
    records device-init → resolve → failed with the ErrorInfo (nothing is allocated there).
    """
    from pipeline import settings
    from pipeline.build import build_attention_backends, installed_by_import
    from pipeline.platforms import parse_device, platform_for
    from states import resolve

    if ns.decode_steps < 0:
        raise UsageError(f"--decode-steps {ns.decode_steps} must be >= 0", code="usage",
                         flags=[("--decode-steps", ns.decode_steps)], allowed=[">= 0"], remedy="pass --decode-steps 3")
    settings.zbal_local_mem_size(request.args)
    settings.flashinfer_workspace_size(request.args, request.served_model)
    facts = platform_for(request.device).device_facts(parse_device(request.device)[1])
    if ns.mem_bytes is not None and facts.total_memory_bytes and ns.mem_bytes > facts.total_memory_bytes:
        raise ConfigError(f"--mem-bytes {ns.mem_bytes} exceeds the device's {facts.total_memory_bytes} bytes",
                          code="invalid_value", flags=[("mem_bytes", ns.mem_bytes)],
                          allowed=[f"<= {facts.total_memory_bytes}"], remedy="lower --mem-bytes or use --mem-fraction")
    if ns.mem_fraction is not None:
        from pipeline.pool_sizing import check_mem_fraction

        check_mem_fraction(ns.mem_fraction)
    check_pool_for_checks(ns, request)
    try:
        resolve.decide(request.args, request.served_model, facts, is_draft_worker=request.is_draft_worker,
                       installed=installed_by_import())
    except ConfigError:
        build_attention_backends(request, log=log, rank_group=group)  # fails in resolve, logged, nothing allocated
        raise


def check_pool_for_checks(ns: argparse.Namespace, request: SetupRequest) -> None:
    """Refuse, before the model loads, a pool too small for what ``run`` verifies.

    The built instances are verified on a 5-request batch and the model steps on a 4-request one
    (:func:`pipeline.verify.slots_needed`, :func:`pipeline.runner_verify.slots_needed`, whole pages
    each): :func:`pipeline.pool_sizing.size_pools` is asked for at least that many slots from
    ``--num-token-slots`` or a ``--mem-bytes`` budget (``--mem-fraction`` is sized after the weights
    load, since they count against it). Raises ConfigError ``pool_budget_too_small`` naming the flag.
    """
    from pipeline import runner_verify, verify
    from pipeline.pool_sizing import size_pools
    from states.capability_check import kv_dtype

    if ns.num_token_slots is None and ns.mem_bytes is None:
        return
    p, ps, steps, model = request.pool, request.args.page_size, max(ns.decode_steps, 0), request.served_model
    need = max(verify.slots_needed(p.max_reqs, ps, steps), runner_verify.slots_needed(p.max_reqs, ps, steps))
    n = model.num_hidden_layers
    layers = min(ns.num_layers if ns.num_layers is not None and ns.num_layers > 0 else min(DEFAULT_LAYERS, n), n)
    size_pools(model.layer_kinds(), layers, kv_dtype(request.args, model), page_size=ps, max_reqs=p.max_reqs,
               max_context_len=p.max_context_len, num_token_slots=ns.num_token_slots, budget_bytes=ns.mem_bytes,
               source="bytes", min_slots=need, min_slots_for=f"the verification batches with --decode-steps {steps}")


def request_from(ns: argparse.Namespace, *, on_gpu: bool) -> SetupRequest:
    from pipeline.cli import attention_args_from
    from pipeline.eventlog import secrets_from_env

    args = attention_args_from(ns)
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
    """The RunnerConfig from the flags (default: the first 2 layers on every device)."""
    from pipeline.runner import RunnerConfig

    n = request.served_model.num_hidden_layers
    layers = ns.num_layers if ns.num_layers is not None else min(DEFAULT_LAYERS, n)
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
    from pipeline.verify import verify_backend
    from states.capability_check import model_dtype

    model, pools = request.served_model, pools or backends.pools
    targets = [(i.role, i.backend, backends.instances[i.role]) for i in backends.plan.instances]
    top = backends.attn_backend
    if top is not backends.instances.get(backends.plan.instances[0].role):
        targets.append((f"{backends.plan.mode.value}.wrapper", type(top).__name__, top))
    out = []
    for role, name, backend in targets:
        r = verify_backend(backend, role=role, name=name, model=model,
                           req_to_token_pool=pools["req_to_token_pool"], kv_pool=pools["kv_pool"],
                           torch_device=backends.torch_device, dtype=model_dtype(request.args, model),
                           decode_steps=decode_steps)
        log.emit(ev.InstanceVerified, state="done", outcome="ok" if r.passed else "failed", role=role,
                 backend=name, max_rel_err=r.max_rel_err, tol=r.tol, passed=r.passed)
        out.append({"role": role, "backend": name, "max_rel_err": r.max_rel_err, "passed": r.passed,
                    "tol": r.tol, "detail": r.detail})
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.cli import add_setup_flags

    run = sub.add_parser("run", help="run the pipeline and verify every built backend on a real batch")
    add_setup_flags(run)
    run.add_argument("--log-file", default="./attn-setup-logs/{run_id}.rank{rank}.jsonl",
                     help="JSON-lines trace path; {run_id} and {rank} are filled in")
    run.add_argument("--decode-steps", type=int, default=3, help="decode steps verified after the extend")
    run.add_argument("--num-layers", type=int, default=None,
                     help=f"build only the first N layers (default {DEFAULT_LAYERS}, on every device)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--mem-fraction", type=float, default=None,
                        help="size the KV pool from this share of device memory (sglang's mem_fraction_static)")
    budget.add_argument("--mem-bytes", type=int, default=None, help="size the KV pool from this many bytes")
    return run


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

    from pipeline.distributed import init_from_env

    group = init_from_env(ns.device)  # None unless launched with WORLD_SIZE > 1 (torchrun)
    if group is not None:
        ns.rank, ns.world_size, ns.device = group.rank, group.world_size, group.device
    on_gpu = _on_gpu(ns.device)
    request = request_from(ns, on_gpu=on_gpu)
    run_id = group.run_id if group is not None else new_run_id()
    log_file = log_path(ns.log_file, run_id, request.rank)
    log = open_log(log_file, ns.log_file, run_id, request.rank, tuple(request.secrets.values()))
    t0 = time.perf_counter()
    error: Optional[ErrorInfo] = None
    code, runner, verified, steps = EXIT_OK, None, [], []
    try:
        log.install_signal_handlers()
        log.emit(ev.CommandStarted, state="args", command="run", argv=list(getattr(ns, "_argv", [])))
        preflight(ns, request, log, group)
        runner = Runner(runner_config(ns, request, on_gpu), log=log, rank_group=group)
        runner.initialize()
        verified = _verify(runner.backends, runner.request, log, ns.decode_steps, runner.pools)
        steps = _model_steps(runner, log, ns.decode_steps)
        bad = [v["role"] for v in verified if not v["passed"]] + [f"model:{s['step']}" for s in steps if not s["passed"]]
        if bad:
            error = ErrorInfo(code="verification_failed", state="done", message=f"failed verification: {bad}",
                              remedy="the backend computes wrong attention for this model; report it with the log")
            code = EXIT_FAILED
            log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    except AttnSetupError as e:
        error, code = e.info, e.exit_code
        if not _ended(log):  # refused in preflight
            log.emit(ev.RunFailed, state=e.info.state, outcome="failed", error=e.info)
    except KeyboardInterrupt as e:  # SIGINT: the handler wrote run_interrupted; the unwinding released
        error, code = error_info_from(e, log.current_state), EXIT_INTERRUPTED
        if not _ended(log):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal", signal="SIGINT",
                     error=error)
    except Exception as e:  # noqa: BLE001 - any crash becomes exit 1 with its ErrorInfo, logged
        error, code = error_info_from(e, log.current_state), EXIT_FAILED
        if not _ended(log):
            log.emit(ev.RunFailed, state=log.current_state, outcome="failed", error=error)
    finally:
        try:
            if runner is not None:
                runner.close()
            if group is not None:
                group.close()
        finally:
            if log.write_error is not None and code == EXIT_OK:
                error, code = log.write_error.info, log.write_error.exit_code
            log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
                     duration_ms=(time.perf_counter() - t0) * 1e3)
            log.close()
            log.restore_signal_handlers()
    report = _report(log, run_id, code, verified, steps, log_file, error)
    if ns.json:
        rp.emit_json(report)
    else:
        _render_runner(report)
        rp.render_tables(report)
        if error is not None:
            rp.render_error(error)
    return code


def _report(log: Any, run_id: str, code: int, verified: list, steps: list, log_file: str,
            error: Optional[ErrorInfo]) -> dict[str, Any]:
    return {
        "ok": code == EXIT_OK, "run_id": run_id, "states": rp.states_from(log.records),
        "resolved": rp.resolved_from(log.records), "plan": rp.plan_from(log.records),
        "skips": rp.skips_from(log.records), "verified": verified, "log_file": os.path.abspath(log_file),
        "error": None if error is None else msgspec.to_builtins(error),
        "runner_states": runner_states(log.records), "model_steps": steps,
    }


def _render_runner(report: dict[str, Any]) -> None:
    """Runner states and the stack's verified steps as rich tables."""
    from rich.console import Console
    from rich.table import Table

    c = Console(highlight=False, soft_wrap=False, width=120)
    if report["runner_states"]:
        c.print(rp.states_table("runner states", report["runner_states"]))
    if report["model_steps"]:
        t = Table(title="attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                  title_justify="left")
        for col in ("step", "bs", "graph", "max rel err", "tol", "passed"):
            t.add_column(col)
        for s in report["model_steps"]:
            t.add_row(s["step"], str(s["batch_size"]), "yes" if s["graph"] else "no", f"{s['max_rel_err']:.2e}",
                      f"{s['tol']:.0e}", "yes" if s["passed"] else "NO")
        c.print(t)
