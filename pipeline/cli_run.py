"""``attn-setup run``: the pipeline, then verification of every built instance on a real batch."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Optional

from pipeline import events as ev
from pipeline import report as rp
from pipeline.contracts import ErrorInfo, ModelSpec, PoolFacts, SetupRequest
from pipeline.errors import EXIT_FAILED, EXIT_OK, AttnSetupError, UsageError, error_info_from

BUNDLED_MODEL = "llama-3.1-8b.json"


def default_model_path() -> str:
    """The bundled Llama-3.1-8B config (package data; same file as examples/configs/)."""
    return str(Path(__file__).parent / "data" / "configs" / BUNDLED_MODEL)


def load_models(ns: argparse.Namespace) -> tuple[ModelSpec, Optional[ModelSpec]]:
    from pipeline.model_spec import load_model_spec

    model = load_model_spec(ns.model or default_model_path())
    draft = load_model_spec(ns.draft_model) if ns.draft_model else None
    if draft is not None and not ns.draft_worker:
        raise UsageError("--draft-model is only meaningful with --draft-worker", code="usage",
                         flags=[("--draft-model", ns.draft_model)], remedy="add --draft-worker, or drop --draft-model")
    return model, draft


def pool_facts(ns: argparse.Namespace, args: Any, on_gpu: bool) -> PoolFacts:
    """Pool sizes from the flags, with CPU-friendly defaults; slots rounded up to whole pages."""
    slots = ns.num_token_slots or (65536 if on_gpu else 1024)
    ps = args.page_size
    slots = -(-slots // ps) * ps
    return PoolFacts(max_reqs=ns.max_reqs or 8, max_context_len=ns.max_context_len or 1024,
                     num_token_slots=slots, page_size=ps)


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


def _verify(backends: Any, request: SetupRequest, log: Any, decode_steps: int) -> list[dict[str, Any]]:
    from pipeline.verify import verify_backend
    from states.capability_check import model_dtype

    model = request.served_model
    targets = [(i.role, i.backend, backends.instances[i.role]) for i in backends.plan.instances]
    top = backends.attn_backend
    if top is not backends.instances.get(backends.plan.instances[0].role):
        targets.append((f"{backends.plan.mode.value}.wrapper", type(top).__name__, top))
    out = []
    for role, name, backend in targets:
        r = verify_backend(backend, role=role, name=name, model=model,
                           req_to_token_pool=backends.pools["req_to_token_pool"], kv_pool=backends.pools["kv_pool"],
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
    return run


def cmd(ns: argparse.Namespace) -> int:
    """Run the pipeline, verify every instance, print the report; returns the exit code."""
    from pipeline.build import build_attention_backends, new_run_id
    from pipeline.eventlog import EventLog

    request = request_from(ns, on_gpu=_on_gpu(ns.device))
    run_id = new_run_id()
    log_file = ns.log_file.format(run_id=run_id, rank=request.rank)
    log = EventLog(run_id, request.rank, log_file, secrets=tuple(request.secrets.values()))
    log.install_signal_handlers()
    error: Optional[ErrorInfo] = None
    code, backends, verified = EXIT_OK, None, []
    try:
        backends = build_attention_backends(request, log=log)
        verified = _verify(backends, request, log, ns.decode_steps)
        if not all(v["passed"] for v in verified):
            bad = [v["role"] for v in verified if not v["passed"]]
            error = ErrorInfo(code="verification_failed", state="done", message=f"instances failed verification: {bad}",
                              remedy="the backend computes wrong attention for this model; report it with the log")
            code = EXIT_FAILED
    except AttnSetupError as e:
        error, code = e.info, e.exit_code
    except Exception as e:  # noqa: BLE001 - any crash becomes exit 1 with its ErrorInfo
        error, code = error_info_from(e, log.records[-1].state if log.records else "device-init"), EXIT_FAILED
    finally:
        if backends is not None:
            released = backends.close()
            log.emit(ev.ResourcesReleased, state="done", released=released)
        log.close()
    resolved = next((r for r in log.records if isinstance(r, ev.BackendsResolved)), None)
    planned = next((r for r in log.records if isinstance(r, ev.BuildPlanned)), None)
    report = {
        "ok": code == EXIT_OK, "run_id": run_id, "states": rp.states_from(log.records),
        "resolved": None if resolved is None else {
            "prefill": resolved.prefill, "decode": resolved.decode, "is_draft_override": resolved.is_draft_override,
            "rules": resolved.rules},
        "plan": None if planned is None else {
            "mode": planned.mode.value, "hybrid": planned.hybrid,
            "instances": [{"role": i.role, "backend": i.backend, "workspace": i.workspace} for i in planned.instances],
            "workspaces": [{"id": w.id, "owner": w.owner, "bytes": w.bytes, "shared_by": w.shared_by}
                           for w in planned.workspaces]},
        "skips": rp.skips_from(log.records), "verified": verified, "log_file": os.path.abspath(log_file),
        "error": None if error is None else __import__("msgspec").to_builtins(error),
    }
    if ns.json:
        rp.emit_json(report)
    else:
        rp.render_tables(report)
        if error is not None:
            rp.render_error(error)
    return code
