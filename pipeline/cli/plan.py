"""``attn-setup plan``: resolution and build plan for a device profile, without importing torch.

``attn-setup plan --model CONFIG_JSON --device-profile NAME|auto [--installed PKG,…] [run flags]
[--draft-worker --draft-model CONFIG_JSON] [--json]`` runs the pure decisions of the pipeline
(resolve, build-mode, npu-lazy-mem) against a named :mod:`pipeline.platforms.profiles` record (or this
machine, found through NVML / ``nvidia-smi``) and prints the same ``resolved``, ``plan`` and
``skips`` objects as ``attn-setup run --json``, plus ``rejected: {prefill: [{backend, reasons}],
decode: […]}``, ``warnings`` (reference fallback and downgrades, as ``run`` reports them) and the
``device`` facts used. It refuses what a run would refuse before allocating (``--strict``, graph
sizes above ``--max-reqs``, a FlashInfer workspace too small). Package presence comes from distribution metadata
(``importlib.metadata``) unless ``--installed`` lists the packages to assume.

Exit codes: 0 planned · 2 usage (bad flags, unreadable file, unknown profile or package) ·
3 configuration refused (one ErrorInfo printed). Nothing here imports torch, triton or flashinfer.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

import msgspec

from pipeline.core.contracts import DeviceFacts, Resolution, SetupRequest
from pipeline.core.errors import EXIT_OK, UsageError



def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.backends import packages
    from pipeline.cli.flags import add_setup_flags
    from pipeline.platforms.profiles import names

    plan = sub.add_parser("plan", help="resolve and plan for a device profile without importing torch")
    add_setup_flags(plan, device=False)
    plan.add_argument("--device-profile", default="auto", metavar="NAME",
                      help=f"a named profile ({', '.join(names())}); auto = this machine via NVML/nvidia-smi")
    plan.add_argument("--installed", default=None, metavar="PKG,…",
                      help=f"packages to assume installed, comma-separated, from {', '.join(packages.names())} "
                           "(or their import names; default: read from package metadata, no import)")
    return plan


def installed_from(flag: str | None) -> dict[str, bool]:
    """Package presence: the ``--installed`` list, or distribution metadata (no import).

    Accepts the distribution names the backends need (:func:`pipeline.backends.packages.names`) and their
    import names, case-insensitively (:func:`pipeline.backends.packages.canonical`).
    Raises :class:`UsageError` (exit 2) for any other name, listing both spellings.
    """
    from pipeline.backends import packages

    dists = packages.names()
    if flag is None:
        return packages.installed_by_metadata(dists)
    given = [p.strip() for p in flag.split(",") if p.strip()]
    canon = [packages.canonical(p) for p in given]
    unknown = [p for p, c in zip(given, canon) if c is None]
    if unknown:
        imports = list(dict.fromkeys(packages.import_name(d) for d in dists))
        raise UsageError(f"--installed names unknown package(s): {', '.join(unknown)}", code="usage",
                         flags=[("--installed", flag)],
                         allowed=list(dists) + [i for i in imports if i not in dists],
                         remedy=f"list distribution names ({', '.join(dists)}) or import names ({', '.join(imports)}), "
                                "comma-separated, or '' for none")
    return {p: p in canon for p in dists}


def skips_of(decided: Any) -> list[dict[str, str]]:
    """``[{what, reason}]`` of every step's skips and downgrades, in the order a run logs them (table order)."""
    from pipeline.setup.table import SETUP

    return [{"what": s.what, "reason": s.reason} for step in SETUP.steps if step.skips is not None
            for s in step.skips(None, decided[step.state])]


def rejected_obj(res: Resolution) -> dict[str, list[dict[str, Any]]]:
    """``{prefill: [{backend, reasons}], decode: […]}`` (both halves always present)."""
    return {h: [{"backend": r.backend, "reasons": list(r.reasons)} for r in res.rejected.get(h, [])]
            for h in ("prefill", "decode")}


def warnings_obj(warnings: Any) -> list[dict[str, Any]]:
    """The ``warnings`` list of plan/run JSON: ``[{code, what, message, avoid, rejected}]``."""
    return [msgspec.to_builtins(w) for w in warnings]


def plan_report(request: SetupRequest, device: DeviceFacts, installed: Mapping[str, bool]) -> dict[str, Any]:
    """The plan report for ``request`` on ``device`` (raises the typed error of a refusal).

    The setup table in decide mode (:func:`pipeline.setup.build.decide_setup`): the decisions a run makes
    before allocating — resolve (``strict`` included), build-mode's plan, the CUDA-graph sizes against
    ``max_reqs``, each workspace against the largest batch it plans, npu-lazy-mem — so ``plan`` refuses what
    a run would refuse. ``warnings``: the reference fallback and every downgrade
    (:func:`states.resolve.warnings_for`), as a run logs them.
    """
    from pipeline.cli import report as rp
    from pipeline.setup.build import decide_setup
    from states import resolve

    decided = decide_setup(request, facts=device, installed=installed).raise_refusal()
    res, plan = decided["resolve"], decided["build-mode"].plan
    return {"ok": True, "device": msgspec.to_builtins(device), "installed": dict(installed),
            "resolved": rp.resolved_obj(res), "plan": rp.plan_obj(plan), "rejected": rejected_obj(res),
            "skips": skips_of(decided),
            "warnings": warnings_obj(resolve.warnings_for(res, list(res.skips) + list(plan.skips), device))}


def cmd(ns: argparse.Namespace) -> int:
    """Resolve and plan for ``--device-profile``; print JSON or tables; returns the exit code."""
    from pipeline.cli import report as rp
    from pipeline.cli.request import request_from
    from pipeline.platforms.profiles import get

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
