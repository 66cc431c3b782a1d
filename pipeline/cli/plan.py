"""``attn-setup plan``: resolution and build plan for a device profile, without importing torch.

``attn-setup plan --model CONFIG_JSON --device-profile NAME|auto [--installed PKG,…] [run flags]
[--draft-worker --draft-model CONFIG_JSON] [--json]`` runs the pure decisions of the pipeline
(resolve, build-mode, npu-lazy-mem) against a named :mod:`pipeline.platforms.profiles` record (or this
machine, found through NVML / ``nvidia-smi``) and prints the same ``resolved``, ``plan`` and
``skips`` objects as ``attn-setup run --json``, plus ``rejected: {prefill: [{backend, reasons}],
decode: […]}``, ``warnings`` (reference fallback and downgrades, as ``run`` reports them) and the
``device`` facts used. It refuses what a run would refuse before allocating (``--strict``, graph
sizes above ``--max-reqs``, a FlashInfer workspace too small). Package presence comes from distribution metadata
(``importlib.metadata``) unless ``--installed`` lists the packages to assume. ``cuda_graph_bytes_estimate`` (and
``cuda_graph_estimate``: the graph pool, the replay state and the warm-up stream, the pool per batch size, the
layers, the cuBLAS workspace) is the decode CUDA graphs' memory
:mod:`states.graph_memory` estimates for the stack ``attn-setup run`` builds with the same flags (``--num-layers``,
default as ``run``'s) — what ``run`` takes out of a ``--mem-fraction`` budget before sizing the KV pool.

Exit codes: 0 planned · 2 usage (bad flags, unreadable file, unknown profile or package) ·
3 configuration refused (one ErrorInfo printed). Nothing here imports torch, triton or flashinfer.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

import msgspec

from pipeline.core.contracts import DeviceFacts, SetupRequest
from pipeline.core.errors import EXIT_OK, AttnSetupError, Flag, UsageError
from pipeline.cli.console import print_stderr_lines
from pipeline.cli.plan_report import decision_lines, graph_estimate_line, installed_note, plan_report
from pipeline.core.numbers import ascii_int


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.backends import packages
    from pipeline.cli.flags import add_setup_flags
    from pipeline.platforms.profiles import names

    plan = sub.add_parser("plan", help="resolve and plan for a device profile without importing torch")
    add_setup_flags(plan, device=False)
    plan.add_argument("--device-profile", default="auto", metavar="NAME",
                      help=f"a named profile ({', '.join(names())}); auto = this machine via NVML/nvidia-smi")
    plan.add_argument("--installed", default=None, metavar="PKG,…",
                      help=f"the complete set of packages to assume installed, comma-separated, from "
                           f"{', '.join(packages.names())} (or their import names); it replaces what is installed "
                           "here, it does not add to it: a GPU plan needs torch,triton,… too; '' = none "
                           "(default: read from package metadata, no import)")
    plan.add_argument("--num-layers", type=ascii_int, default=None,
                      help="the attention layers `attn-setup run` builds with these flags, for the CUDA-graph memory "
                           "estimate (default as run's: 2, or as many as it takes to include every attention kind)")
    from pipeline.cli.jit import add_flag

    add_flag(plan)
    return plan


def installed_from(flag: str | None) -> dict[str, bool | str]:
    """Package presence: the ``--installed`` list (present, at a supported version: assumed), or distribution
    metadata (no import: the installed version, checked by resolve, or False).

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


def _installed_text(installed: Mapping[str, bool | str]) -> str:
    """``torch 2.13.0+cpu, triton 3.9.0`` (a package assumed by ``--installed``: its name alone), or ``none``."""
    return ", ".join(p if v is True else f"{p} {v}" for p, v in installed.items() if v) or "none"


def installed_hint(err: AttnSetupError, request: SetupRequest, device: DeviceFacts,
                   installed: Mapping[str, bool]) -> None:
    """When an explicit ``--installed`` set is why ``plan`` fails, point the remedy at the full set.

    ``--installed`` replaces the assumed set (it does not add to what is installed here), so
    ``--installed flashinfer`` alone lacks torch and triton. If the plan succeeds with every package
    of :func:`pipeline.backends.packages.names` assumed (checked offline, no import), ``err``'s remedy becomes
    ``pass --installed torch,triton,flashinfer`` (import names) naming what the given set lacks, and
    ``--installed`` joins its flags; otherwise packages are not the problem and ``err`` is left alone.
    """
    from pipeline.backends import packages

    dists = packages.names()
    if all(installed.get(p) for p in dists):
        return
    try:
        plan_report(request, device, {p: True for p in dists})
    except AttnSetupError:
        return
    short = packages.import_name
    given = ",".join(short(p) for p in dists if installed.get(p))
    lacks = ", ".join(short(p) for p in dists if not installed.get(p))
    remedy = (f"pass --installed {','.join(short(p) for p in dists)} (--installed replaces the assumed "
              f"set, it does not add to it; {given or 'an empty set'} lacks {lacks})")
    flags = [f for f in err.info.flags if f.name != "--installed"] + [Flag(name="--installed", value=given)]
    err.info = msgspec.structs.replace(err.info, remedy=remedy, flags=flags)


def headline(err: AttnSetupError) -> str:
    """A refused plan's first line when lines follow before its error block: ``attn-setup plan refused (exit 3) in
    state resolve: capability_mismatch: <message>; remedy: <remedy>`` (in the command line's flags), as a failed
    ``run`` leads with :func:`pipeline.cli.run_report.headline`."""
    from pipeline.cli.wording import cli_error, command_dests

    info = cli_error(err.info, command_dests("plan"))
    return (f"attn-setup plan refused (exit {err.exit_code}) in state {info.state}: {info.code}: {info.message}"
            + (f"; remedy: {info.remedy}" if info.remedy else ""))


def _print_refusal(ns: argparse.Namespace, err: AttnSetupError, warnings: list[str]) -> None:
    """A refused plan: with ``--json`` the ``{ok: false, error}`` object on stdout (the warnings on stderr); else, on
    stderr, the refusal first — the error block, whose first line names the state, the code and the message; with
    warning lines to show, a :func:`headline` first, the warnings, then the error block closing the output, as a
    failed ``run`` prints it."""
    from rich.markup import escape

    from pipeline.cli import print_error
    from pipeline.cli.console import console, width, wrap

    if warnings and not ns.json:
        c = console(stderr=True)
        for line in wrap(headline(err), width(c)):  # at the terminal's width
            c.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    print_stderr_lines(warnings)
    print_error(err, ns.json, "plan")


def _decide(ns: argparse.Namespace) -> tuple[dict[str, Any], DeviceFacts, dict[str, bool]]:
    """The plan report for ``ns`` (the JIT variants that would compile included), the device profile and the packages
    assumed. Raises the typed error of a refusal (``--require-warm-cache`` with a cold variant among them)."""
    from types import SimpleNamespace

    from pipeline.cli.jit import check_warm, cold_report
    from pipeline.cli.request import request_from
    from pipeline.cli.run_checks import check_plan_minimums
    from pipeline.platforms.profiles import get

    device = get(ns.device_profile)
    installed = installed_from(ns.installed)
    ns.device = device.device_str
    request = request_from(ns, on_gpu=device.type != "cpu")
    check_plan_minimums(request)  # what run refuses from its flags alone (its verification batches' needs)
    try:
        report = plan_report(request, device, installed, getattr(ns, "num_layers", None))
    except AttnSetupError as e:
        if ns.installed is not None:
            installed_hint(e, request, device, installed)
        raise
    report["jit_cold"] = cold_report(request, device, SimpleNamespace(**{h: report["resolved"][h]
                                                                         for h in ("prefill", "decode")}))
    check_warm(ns, report["jit_cold"])
    return report, device, installed


def cmd(ns: argparse.Namespace) -> int:
    """Resolve and plan for ``--device-profile``; print JSON or the report; returns the exit code (0, or a refusal's).

    Human output, in order: the look-alike environment variables' ``warning:`` lines (stderr), the device and the
    packages assumed, the resolution and plan tables, skips and warnings, the CUDA-graph and NPU lazy-memory lines, the
    CUDA-graph memory estimate, the JIT line, and the verdict ``ok`` last. A refusal is printed by
    :func:`_print_refusal` (its error first) and returns the error's exit code (2 usage, 3 refused).
    """
    from pipeline.cli import report as rp
    from pipeline.cli.startup import env_lookalike_lines

    warnings = env_lookalike_lines()
    try:
        report, device, installed = _decide(ns)
    except AttnSetupError as e:
        _print_refusal(ns, e, warnings)
        return e.exit_code
    except BaseException:  # a flag value msgspec refuses (main reports it), Ctrl-C or a bug: the warnings still shown
        print_stderr_lines(warnings)
        raise
    if ns.json:
        print_stderr_lines(warnings)
        rp.emit_json(report)
        return EXIT_OK
    from pipeline.cli.console import console, print_line
    from pipeline.cli.jit import estimate_line

    print_stderr_lines(warnings)
    print_line(console(), f"device: {device.name or device.type} ({device.arch or device.type}) from "
                          f"{device.source}; installed: {_installed_text(installed)}")
    rp.render_tables(report, report["rejected"], verdict=False)
    for line in decision_lines(report):
        print_line(console(), line)
    if report.get("cuda_graph_estimate"):
        print_line(console(), graph_estimate_line(report))
    for line in (estimate_line(report["jit_cold"]), installed_note(report, installed, ns.device_profile,
                                                                      ns.installed)):
        if line:
            print_line(console(), line)
    rp.render_verdict(report)  # last, where the eye lands when the prompt returns (new user: 'ok' sat mid-report)
    return EXIT_OK
