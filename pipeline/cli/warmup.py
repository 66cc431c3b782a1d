"""``attn-setup warmup``: compile every FlashInfer kernel variant a configuration needs, in parallel.

Details: docs/internals.md, ``pipeline.cli.warmup``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

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
    from pipeline.cli import output as rp
    from pipeline.backends.packages import installed_by_import
    from pipeline.cli.flags import is_gpu_device, request_from
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
        from pipeline.cli.output import console, print_line

        c = console()
        print_line(c, f"resolved: prefill={res.pair.prefill} decode={res.pair.decode}")
        for r in results:
            print_line(c, f"  {r['status']:9} {r['seconds']:7.1f} s  {r['variant']}  {r.get('error') or ''}".rstrip(),
                       indent="    ")
        if not variants:
            print_line(c, report["note"])
        c.print("[bold green]ok[/]" if ok else "[bold red]failed[/]", soft_wrap=True)  # one word, never wrapped
    return 0 if ok else 1


# flags that are not setup flags: dropped from the warmup command of the remedy (with their value when they take one)
_NOT_SETUP = {"--require-warm-cache": 0, "--json": 0, "-v": 0, "--verbose": 0, "--no-progress": 0, "--log-file": 1,
              "--metrics-file": 1, "--slow-phase-s": 1, "--decode-steps": 1, "--num-layers": 1, "--dist-timeout": 1,
              "--mem-fraction": 1, "--mem-bytes": 1, "--device-profile": 1, "--installed": 1}


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--require-warm-cache", action="store_true",
                   help="refuse (exit 3, cold_jit_cache) when a FlashInfer kernel variant this configuration needs "
                        "is not in this machine's compile cache; the error names the warmup command that fixes it")


def warmup_command(argv: list[str]) -> str:
    """``attn-setup warmup`` with the setup flags of ``argv`` (``run``/``plan`` and their own flags dropped)."""
    out, skip, args = [], 0, list(argv)
    if args and args[0] in ("run", "plan"):
        args = args[1:]
    for a in args:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _NOT_SETUP:
            skip = _NOT_SETUP[name] if "=" not in a else 0
            continue
        out.append(a)
    import shlex

    return " ".join(["attn-setup", "warmup", *map(shlex.quote, out)])


def cold_report(request: Any, facts: Any, pair: Any) -> list[dict[str, Any]]:
    """The variants that would compile (:func:`pipeline.backends.flashinfer.jit.cold_variants`); [] without FlashInfer backends."""
    from pipeline.backends.flashinfer.jit import cold_variants

    variants = variants_for_request(request, facts, pair)
    return cold_variants(variants, facts.arch or "") if variants else []


def check_warm(ns: argparse.Namespace, cold: list[dict[str, Any]], state: str = "resolve") -> None:
    """With ``--require-warm-cache``, refuse the first variant that would compile (ConfigError, exit 3)."""
    from pipeline.core.errors import ConfigError

    if not getattr(ns, "require_warm_cache", False) or not cold:
        return
    c = cold[0]
    near = (f"; the nearest cached variant is {c['nearest']} (differs in {', '.join(c['differs'])})"
            if c["nearest"] else "; nothing of this FlashInfer version and arch is cached")
    version = c["flashinfer_version"] or "not installed"
    cmd = warmup_command(list(getattr(ns, "_argv", [])))
    profile = getattr(ns, "device_profile", None)
    where = ("on this machine" if profile in (None, "auto") else
             f"on the {profile} machine the plan is for (warmup compiles for the GPU it runs on)")
    raise ConfigError(
        f"{len(cold)} FlashInfer kernel variant(s) would compile at startup, first {c['variant']} "
        f"(module {c['module']}, FlashInfer {version}){near}", code="cold_jit_cache", state=state,
        flags=[("--require-warm-cache", True), ("variant", c["variant"])],
        allowed=["every needed variant cached (attn-setup warmup)"],
        remedy=f"run {cmd} {where} first, or drop --require-warm-cache")


def estimate_line(cold: list[dict[str, Any]]) -> Optional[str]:
    """``jit: N variant(s) would compile here (about S s from warmup records): …`` (None when all cached)."""
    if not cold:
        return None
    known = [c["estimate_s"] for c in cold if c["estimate_s"] is not None]
    est = (f"about {sum(known):.0f} s from warmup records" + (f", {len(cold) - len(known)} without one"
                                                             if len(known) < len(cold) else "")
           if known else "no warmup record beside the cache to estimate from")
    return f"jit: {len(cold)} variant(s) would compile here ({est}): " + ", ".join(c["variant"] for c in cold)

