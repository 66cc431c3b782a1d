"""``attn-setup plan``: resolution and build plan for a device profile, without importing torch.

``attn-setup plan --model CONFIG_JSON --device-profile NAME|auto [--installed PKG,…] [run flags]
[--draft-worker --draft-model CONFIG_JSON] [--json]`` runs the pure decisions of the pipeline
(resolve, build-mode, npu-lazy-mem) against a named :mod:`pipeline.profiles` record (or this
machine, found through NVML / ``nvidia-smi``) and prints the same ``resolved``, ``plan`` and
``skips`` objects as ``attn-setup run --json``, plus ``rejected: {prefill: [{backend, reasons}],
decode: […]}`` and the ``device`` facts used. Package presence comes from distribution metadata
(``importlib.metadata``) unless ``--installed`` lists the packages to assume.

Exit codes: 0 planned · 2 usage (bad flags, unreadable file, unknown profile or package) ·
3 configuration refused (one ErrorInfo printed). Nothing here imports torch, triton or flashinfer.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

import msgspec

from pipeline.contracts import DeviceFacts, Resolution, SetupRequest
from pipeline.errors import EXIT_OK, UsageError

PACKAGES = ("torch", "triton", "flashinfer-python")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.cli import add_setup_flags
    from pipeline.profiles import names

    plan = sub.add_parser("plan", help="resolve and plan for a device profile without importing torch")
    add_setup_flags(plan, device=False)
    plan.add_argument("--device-profile", default="auto", metavar="NAME",
                      help=f"a named profile ({', '.join(names())}); auto = this machine via NVML/nvidia-smi")
    plan.add_argument("--installed", default=None, metavar="PKG,…",
                      help=f"packages to assume installed, comma-separated, from {', '.join(PACKAGES)} "
                           "(default: read from package metadata, no import)")
    return plan


def installed_from(flag: str | None) -> dict[str, bool]:
    """Package presence: the ``--installed`` list, or distribution metadata (no import).

    Raises :class:`UsageError` (exit 2) for a package name outside :data:`PACKAGES`.
    """
    if flag is None:
        from pipeline.build import installed_by_metadata

        return installed_by_metadata(PACKAGES)
    given = [p.strip() for p in flag.split(",") if p.strip()]
    unknown = [p for p in given if p not in PACKAGES]
    if unknown:
        raise UsageError(f"--installed names unknown package(s) {unknown}", code="usage",
                         flags=[("--installed", flag)], allowed=list(PACKAGES),
                         remedy="list distribution names such as torch,triton,flashinfer-python (or '' for none)")
    return {p: p in given for p in PACKAGES}


def _workspace_bytes(request: SetupRequest):
    from pipeline import settings
    from pipeline.backends import registry

    def need(backend: str) -> int:
        if backend in ("flashinfer", "fa3"):
            return settings.flashinfer_workspace_size(request.args, request.served_model)[0]
        return registry.get(backend).capability.workspace_bytes

    return need


def _skips(res: Resolution, plan: Any, request: SetupRequest, device: DeviceFacts) -> list[dict[str, str]]:
    """Skips in run's order: resolve's downgrades, build-mode's, then the npu-lazy-mem step."""
    from pipeline import settings
    from states import npu_lazy_mem

    size, source = settings.zbal_local_mem_size(request.args)
    lazy = npu_lazy_mem.decide(device.type, size, source, request.is_draft_worker)
    out = [{"what": s.what, "reason": s.reason} for s in list(res.skips) + list(plan.skips)]
    if not lazy.run:
        out.append({"what": "npu_lazy_mem", "reason": lazy.reason})
    return out


def _check_workspaces(request: SetupRequest, res: Resolution, plan: Any, device: DeviceFacts) -> None:
    """build-mode's workspace check, so ``plan`` refuses the workspace sizes ``run`` refuses."""
    from pipeline import settings
    from pipeline.build import check_workspace_sizes

    no_graphs = any(s.what == "cuda_graph" for s in res.skips)
    graph_max_bs = 0 if no_graphs else settings.cuda_graph_max_bs(request.args, request.pool.max_reqs)
    check_workspace_sizes(plan, request.served_model.layer_kinds(), device, max_reqs=request.pool.max_reqs,
                          graph_max_bs=graph_max_bs)


def rejected_obj(res: Resolution) -> dict[str, list[dict[str, Any]]]:
    """``{prefill: [{backend, reasons}], decode: […]}`` (both halves always present)."""
    return {h: [{"backend": r.backend, "reasons": list(r.reasons)} for r in res.rejected.get(h, [])]
            for h in ("prefill", "decode")}


def plan_report(request: SetupRequest, device: DeviceFacts, installed: Mapping[str, bool]) -> dict[str, Any]:
    """The plan report for ``request`` on ``device`` (raises the typed error of a refusal)."""
    from pipeline import report as rp
    from states import build_mode, resolve

    res = resolve.decide(request.args, request.served_model, device, is_draft_worker=request.is_draft_worker,
                         installed=installed)
    plan = build_mode.decide(request.args, res.pair, is_draft_worker=request.is_draft_worker,
                             workspace_bytes=_workspace_bytes(request))
    _check_workspaces(request, res, plan, device)
    return {"ok": True, "device": msgspec.to_builtins(device), "installed": dict(installed),
            "resolved": rp.resolved_obj(res), "plan": rp.plan_obj(plan), "rejected": rejected_obj(res),
            "skips": _skips(res, plan, request, device)}


def cmd(ns: argparse.Namespace) -> int:
    """Resolve and plan for ``--device-profile``; print JSON or tables; returns the exit code."""
    from pipeline import report as rp
    from pipeline.cli_run import request_from
    from pipeline.profiles import get

    device = get(ns.device_profile)
    installed = installed_from(ns.installed)
    ns.device = device.device_str
    request = request_from(ns, on_gpu=device.type != "cpu")
    report = plan_report(request, device, installed)
    if ns.json:
        rp.emit_json(report)
    else:
        from rich.console import Console

        Console(highlight=False, width=120).print(
            f"device: {device.name or device.type} ({device.arch or device.type}) from {device.source}; "
            f"installed: {', '.join(p for p, ok in installed.items() if ok) or 'none'}")
        rp.render_tables(report, report["rejected"])
    return EXIT_OK
