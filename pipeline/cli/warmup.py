"""``attn-setup warmup``: compile every FlashInfer kernel variant a configuration needs, in parallel.

Resolves exactly as ``run`` would on this machine (same flags, same device), lists the kernel
variants the resolved backends JIT-compile for every attention layer kind of the model (each registry
entry's :meth:`~pipeline.backends.registry.BackendEntry.jit_variants`), and compiles them in ``--jobs`` processes, each variant its
own module, so the first real start finds them cached instead of "hanging" in a silent JIT.
Exit codes as README: 0 every variant cached or compiled (also when nothing needs compiling),
1 a compile failed, 2 usage, 3 configuration refused.
"""

from __future__ import annotations

import argparse
from typing import Any
from pipeline.core.numbers import ascii_int


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pipeline.cli.flags import add_setup_flags

    p = sub.add_parser("warmup", help="compile the FlashInfer kernel variants a configuration needs")
    add_setup_flags(p)
    p.add_argument("--jobs", type=ascii_int, default=4, help="parallel compile processes (default 4)")
    return p


def _record_times(variants: list[Any], results: list[dict[str, Any]], arch: str) -> None:
    """Record each compiled variant's seconds beside FlashInfer's cache (``plan``'s compile-time estimate)."""
    from pipeline.backends.flashinfer.jit import flashinfer_version, module_name, record_seconds

    version = flashinfer_version()
    done = [(module_name(v), r["seconds"]) for v, r in zip(dict.fromkeys(variants), results) if r["status"] == "compiled"]
    if version and done:
        try:
            record_seconds(version, arch, done)
        except OSError:  # the estimate is a convenience: a read-only cache directory costs only it
            pass


def variants_for_request(request: Any, facts: Any, pair: Any) -> list[Any]:
    """Kernel variants the resolved pair's backends JIT-compile for the served model (each registry entry's)."""
    from pipeline.backends import registry
    from pipeline.core.dtypes import kv_dtype, model_dtype

    model = request.served_model
    q, kv = model_dtype(request.args, model), kv_dtype(request.args, model)
    out: list[Any] = []
    for name in dict.fromkeys((pair.prefill, pair.decode)):
        out += registry.get(name).jit_variants(model.layer_kinds(), q, kv, facts.arch or "")
    return list(dict.fromkeys(out))


def cmd(ns: argparse.Namespace) -> int:
    """Resolve, list the variants, compile them; prints a table or one JSON object."""
    from pipeline.cli import report as rp
    from pipeline.backends.packages import installed_by_import
    from pipeline.cli.request import is_gpu_device, request_from
    from pipeline.backends.flashinfer.jit import warmup_variants
    from pipeline.platforms import parse_device, platform_for
    from states import resolve

    request = request_from(ns, on_gpu=is_gpu_device(ns.device))
    facts = platform_for(request.device).device_facts(parse_device(request.device)[1])
    res = resolve.decide(request.args, request.served_model, facts, is_draft_worker=request.is_draft_worker,
                         target=request.model,
                         installed=installed_by_import())
    variants = variants_for_request(request, facts, res.pair)
    results = warmup_variants(variants, jobs=ns.jobs) if variants else []
    _record_times(variants, results, facts.arch or "")
    ok = all(r["status"] != "failed" for r in results)
    report = {"ok": ok, "resolved": rp.resolved_obj(res), "variants": results,
              "note": None if variants else "the resolved backends use no FlashInfer JIT kernels"}
    if ns.json:
        rp.emit_json(report)
    else:
        from pipeline.cli.console import console, print_line

        c = console()
        print_line(c, f"resolved: prefill={res.pair.prefill} decode={res.pair.decode}")
        for r in results:
            print_line(c, f"  {r['status']:9} {r['seconds']:7.1f} s  {r['variant']}  {r.get('error') or ''}".rstrip(),
                       indent="    ")
        if not variants:
            print_line(c, report["note"])
        c.print("[bold green]ok[/]" if ok else "[bold red]failed[/]", soft_wrap=True)  # one word, never wrapped
    return 0 if ok else 1
