"""``attn-setup plan``: resolution and build plan for a device profile, without importing torch.

Details: docs/internals.md, ``pipeline.cli.plan``.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Optional

import msgspec

from pipeline.cli.output import print_stderr_lines
from pipeline.core.contracts import DeviceFacts, Resolution, SetupRequest
from pipeline.core.errors import AttnSetupError, EXIT_OK, Flag, UsageError
from pipeline.core.numbers import ascii_float, ascii_int
from pipeline.observe.runs import device_view


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


def run_stack(request: SetupRequest, num_layers: Any = None) -> Optional[SetupRequest]:
    """``request`` with its served model cut to the stack ``run`` builds with ``num_layers`` (None: run's default,
    as many as it takes to include every attention kind), which ``plan``'s memory checks count; None for a model
    without attention layers. Raises ConfigError for ``num_layers`` outside the model's attention layers."""
    from pipeline.core.model_spec import layers_covering_every_kind
    from pipeline.core.spec import attention_layer_ids, truncate_spec

    from pipeline.cli.run import DEFAULT_LAYERS

    served = request.served_model
    if not attention_layer_ids(served):
        return None
    n = num_layers if num_layers is not None else max(layers_covering_every_kind(served, DEFAULT_LAYERS), 1)
    field = "draft_model" if request.is_draft_worker and request.draft_model is not None else "model"
    return msgspec.structs.replace(request, **{field: truncate_spec(served, n)})


def pool_obj(s: Any, budget: Any, total: int) -> dict[str, Any]:
    """``pool`` of plan JSON: the KV pool ``run`` sizes with these flags — ``source`` (``slots``, ``bytes`` from
    ``--mem-bytes``, ``mem_fraction``), ``mem_fraction``/``mem_bytes`` as given, the profile's ``total_memory_bytes``,
    the ``budget_bytes`` left for the pools (null for ``slots``), ``num_token_slots``, ``bytes_per_token``,
    ``kv_bytes``, ``req_to_token_bytes``, and the decode graphs' ``graph_reserve_bytes`` a ``--mem-fraction`` budget
    is reduced by first."""
    return {"source": s.source, "mem_fraction": budget.mem_fraction, "mem_bytes": budget.mem_bytes,
            "total_memory_bytes": total, "budget_bytes": s.budget_bytes, "num_token_slots": s.facts.num_token_slots,
            "page_size": s.facts.page_size, "bytes_per_token": s.bytes_per_token, "kv_bytes": s.kv_bytes,
            "req_to_token_bytes": s.req_to_token_bytes, "graph_reserve_bytes": s.graph_reserve_bytes}


def pool_line(report: dict[str, Any]) -> str:
    """``KV pool: 1,234 token slots x 4.0 KiB = … from --mem-fraction 0.8 of 141 GiB (graphs' 2 GiB first)``."""
    from pipeline.cli.output import fmt_bytes

    p = report.get("pool")
    if not p:
        return ""
    head = (f"KV pool: {p['num_token_slots']} token slots x {fmt_bytes(p['bytes_per_token'])} = "
            f"{fmt_bytes(p['kv_bytes'])}, req_to_token {fmt_bytes(p['req_to_token_bytes'])}")
    head += " for the layers run builds (--num-layers), not a server's whole model"
    if p["source"] == "mem_fraction":
        return (head + f" (from --mem-fraction {p['mem_fraction']:g} of the profile's "
                f"{fmt_bytes(p['total_memory_bytes'])}: {fmt_bytes(p['budget_bytes'])} for the pools after the decode "
                f"graphs' {fmt_bytes(p['graph_reserve_bytes'])})")
    if p["source"] == "bytes":
        return head + f" (from --mem-bytes {p['mem_bytes']})"
    return head + " (from --num-token-slots)"


def graph_estimate_obj(request: SetupRequest, decided: Any, num_layers: Any = None, budget: Any = None
                       ) -> dict[str, Any]:
    """``{cuda_graph_bytes_estimate, cuda_graph_estimate}`` for the stack ``run`` builds with ``num_layers`` (None:
    run's default) — :func:`pipeline.memory.graphs.estimate_for_decided`, as run's pool sizing calls it; 0 and None
    when no decode graphs are captured. Raises ConfigError for ``num_layers`` outside the model's attention layers,
    and ``workspace_exceeds_memory`` / ``pool_exceeds_memory`` for workspaces, graphs or pools the device profile
    cannot hold (:func:`pipeline.memory.fits.check_plan_memory`: run refuses them too)."""
    from pipeline.core.layer_span import span_fields, span_of
    from pipeline.memory.graphs import estimate_for_decided
    from pipeline.memory.graphs import lower_bound_for_decided
    from pipeline.memory.fits import Budget, check_plan_memory, plan_pools, refuse_early

    budget = budget or Budget()
    served, cut = request.served_model, run_stack(request, num_layers)
    if cut is None:
        return {"cuda_graph_bytes_estimate": 0, "cuda_graph_estimate": None}
    spec = cut.served_model
    total = decided["device-init"].facts.total_memory_bytes
    refuse_early(cut, decided, lower_bound_for_decided(cut, decided), total, budget=budget)  # before every size
    est = estimate_for_decided(cut, decided)
    check_plan_memory(cut, decided, est, total, budget=budget)
    pool = pool_obj(plan_pools(cut, est, decided["build-mode"].plan.workspace_bytes, budget, total), budget, total)
    if est is None:
        return {"cuda_graph_bytes_estimate": 0, "cuda_graph_estimate": None, "pool": pool}
    return {"pool": pool, "cuda_graph_bytes_estimate": est.total_bytes,
            "cuda_graph_estimate": {"num_layers": est.num_layers, **span_fields(span_of(spec, served)),
                                    "num_hidden_layers": served.num_hidden_layers, "batch_sizes": est.batch_sizes,
                                    **({"first_layer": served.shard.layer_range[0], "pp_rank": served.shard.pp_rank}
                                       if served.shard is not None and served.shard.pp_size > 1 else {}),
                                    "pool_bytes": est.pool_bytes, "state_bytes": est.state_bytes,
                                    "warmup_bytes": est.warmup_bytes, "blas_workspace_bytes": est.blas_workspace_bytes,
                                    "per_bs": {str(b): v for b, v in sorted(est.per_bs.items(), reverse=True)},
                                    **({"mode": est.mode, "tokens_per_req": est.tokens_per_req}
                                       if est.mode != "decode" else {})}}


def _layers_built(e: dict[str, Any]) -> str:
    """``2 attention layers (layers 0-7: 6 linear-attention skipped)`` for a ``cuda_graph_estimate``; a pipeline
    stage's ``(layers 16-17 of pipeline stage 1)``."""
    from pipeline.core.layer_span import LayerSpan, span_detail
    from pipeline.core.spec import LayerGroup

    n = e.get("attention_layers", e["num_layers"])
    skipped = [LayerGroup(kind=g["kind"], layer_ids=g["layer_ids"]) for g in e.get("skipped_layers") or []]
    s = LayerSpan(n, e["num_layers"], e.get("num_hidden_layers", e["num_layers"]), skipped)
    if "first_layer" in e:  # a pipeline stage: its layers by their ids in the whole model
        a = e["first_layer"]
        skip = "".join(f", {len(g.layer_ids)} {g.kind.replace('_', '-')} skipped" for g in skipped)
        return (f"{n} attention layer{'' if n == 1 else 's'} (layers {a}-{a + s.span - 1} of pipeline stage "
                f"{e['pp_rank']}{skip})")
    return f"{n} attention layer{'' if n == 1 else 's'} ({span_detail(s)})"


def graph_estimate_line(report: dict[str, Any]) -> str:
    """The human line of the estimate (empty without graphs)."""
    from pipeline.cli.output import fmt_bytes

    e = report.get("cuda_graph_estimate")
    if not e:
        return ""
    sizes = e["batch_sizes"]
    span = f"bs {sizes[0]}" if len(sizes) == 1 else f"bs {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
    mode = e.get("mode", "decode")
    if mode != "decode":  # a speculative worker captures its own step, tokens_per_req rows per request
        span += f" x {e['tokens_per_req']} {'tokens' if mode == 'target_verify' else 'branches'} per request"
    return (f"{mode.replace('_', '-')} CUDA graphs: {fmt_bytes(report['cuda_graph_bytes_estimate'])} estimated for "
            f"{span} over "
            f"{_layers_built(e)}: graph pool {fmt_bytes(e['pool_bytes'])}, replay state "
            f"{fmt_bytes(e['state_bytes'])}, warm-up stream {fmt_bytes(e['warmup_bytes'])} (cuBLAS workspace "
            f"{fmt_bytes(e['blas_workspace_bytes'])} of it); run takes it out of a --mem-fraction budget before "
            "sizing the KV pool")


def _retell_workspace_refusal(request: SetupRequest, decided: Any, device: DeviceFacts, num_layers: Any) -> None:
    """A ``workspace_too_small`` refusal raised again with a remedy whose alternatives fit beside the KV pools
    and the graphs of the stack ``run`` builds (:func:`pipeline.memory.fits.retell_workspace_refusal`);
    any other refusal, or a ``num_layers`` the model refuses (raised after the refusal, as before), left alone."""
    from pipeline.core.errors import AttnSetupError
    from pipeline.memory.fits import retell_workspace_refusal

    err = decided.refused[1] if decided.refused is not None else None
    if not isinstance(err, AttnSetupError) or err.info.code != "workspace_too_small":
        return
    try:
        stack = run_stack(request, num_layers)
    except AttnSetupError:
        return
    if stack is not None:
        retell_workspace_refusal(request, stack, decided, device.total_memory_bytes)


def plan_report(request: SetupRequest, device: DeviceFacts, installed: Mapping[str, bool | str],
                num_layers: Any = None, budget: Any = None) -> dict[str, Any]:
    """The plan report for ``request`` on ``device`` (raises the typed error of a refusal).

    ``installed``: each package's presence (:data:`pipeline.backends.packages.Presence`); the report's
    ``installed`` says present or not, ``package_versions`` the version resolve checked (null: absent, or assumed by
    ``--installed``).

    The setup table in decide mode (:func:`pipeline.setup.build.decide_setup`): the decisions a run makes
    before allocating — resolve (``strict`` included), build-mode's plan, the CUDA-graph sizes against
    ``max_reqs``, each workspace against the largest batch it plans, npu-lazy-mem — so ``plan`` refuses what
    a run would refuse. ``warnings``: the reference fallback and every downgrade
    (:func:`states.fallback.warnings_for`), as a run logs them. ``num_layers``: the layers ``run`` would build,
    for the CUDA-graph memory estimate (:func:`graph_estimate_obj`); ``budget``: ``--mem-fraction`` / ``--mem-bytes``
    (:class:`pipeline.memory.fits.Budget`), the KV pool sized from them against the profile's memory (``pool``).
    """
    from pipeline.cli import output as rp
    from pipeline.core.shard import shard_fields
    from pipeline.setup.build import decide_setup
    from states.fallback import warnings_for

    decided = decide_setup(request, facts=device, installed=installed)
    _retell_workspace_refusal(request, decided, device, num_layers)
    decided.raise_refusal()
    res, plan = decided["resolve"], decided["build-mode"].plan
    return {"ok": True, "device": device_view(device), "installed": {p: bool(v) for p, v in installed.items()},
            "package_versions": {p: v if isinstance(v, str) else None for p, v in installed.items()},
            "resolved": rp.resolved_obj(res), "plan": rp.plan_obj(plan), "rejected": rejected_obj(res),
            "skips": skips_of(decided),
            "warnings": warnings_obj(warnings_for(res, list(res.skips) + list(plan.skips), device)),
            "cuda_graphs": cuda_graphs_obj(request, decided["build-mode"].graphs, device, res.speculative),
            "npu_lazy_mem": lazy_mem_obj(decided["npu-lazy-mem"]), "shard": shard_fields(request),
            **graph_estimate_obj(request, decided, num_layers, budget)}


def cuda_graphs_obj(request: SetupRequest, graphs: Any, device: Optional[DeviceFacts] = None,
                    spec: Any = None) -> dict[str, Any]:
    """``cuda_graphs`` of plan JSON: ``{capture, reason, batch_sizes, count, max_bs, max_bs_source, max_bs_from,
    mode}`` — ``mode`` the captured step (``decode``; with speculative decoding ``target_verify`` on a target worker,
    ``draft_decode`` on a draft worker: :func:`states.build_mode.graph_mode`), and
    whether decode CUDA graphs are captured (:func:`states.build_mode.decide_graphs`; ``reason`` when not), the decode
    batch sizes a run captures on ``device`` (:func:`states.build_mode.capture_batch_sizes`: ``cuda_graph_bs``, else
    sglang's 1, 2, 4, 8, 16, 24, … up to ``cuda_graph_max_bs``, else up to sglang's default for the device's memory
    capped by ``max_reqs``; null when more than :data:`states.build_mode.LISTED_SIZES`), how many and the largest (0
    without graphs), and where the top came from (:func:`states.build_mode.graph_top`: ``max_bs_source`` one of
    ``cuda_graph_bs``, ``cuda_graph_max_bs``, ``default``, ``max_reqs``; ``max_bs_from`` in words, e.g.
    ``default for 131 GiB: 256 (sglang's rule)``; null without graphs)."""
    from states.build_mode import graph_mode, graph_sizes, graph_top

    kw = dict(device=device, world_size=request.tp_size)
    count, largest, sizes = graph_sizes(request.args, request.pool.max_reqs, graphs.capture, **kw)
    top = graph_top(request.args, request.pool.max_reqs, **kw) if graphs.capture else None
    return {"capture": graphs.capture, "reason": graphs.reason, "batch_sizes": sizes, "count": count,
            "max_bs": largest, "max_bs_source": top and top.source, "max_bs_from": top and top.text,
            "mode": graph_mode(spec, request.is_draft_worker)}


def lazy_mem_obj(lazy: Any) -> dict[str, Any]:
    """``npu_lazy_mem`` of plan JSON: ``{run, bytes, source, env_var, reason}`` — npu-lazy-mem's decision
    (:func:`states.npu_lazy_mem.decide`: zbal lazy memory on an NPU, not on a draft worker, with a size > 0), the
    size in bytes and where it came from (``field`` > ``env`` ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` > ``default`` 0), and
    why it is skipped."""
    d, s = lazy.decision, lazy.setting
    return {"run": d.run, "bytes": s.value, "source": s.source, "env_var": s.env_var, "reason": d.reason}


def decision_lines(report: dict[str, Any]) -> list[str]:
    """The human lines for ``cuda_graphs`` and ``npu_lazy_mem`` (sizes listed, shortened past 12)."""
    from pipeline.cli.output import fmt_bytes

    g, z = report["cuda_graphs"], report["npu_lazy_mem"]
    if g["capture"]:
        sizes = g["batch_sizes"]
        shown = ", ".join(map(str, sizes)) if sizes is not None and len(sizes) <= 12 else \
            ", ".join(map(str, (sizes or [1, 2, 4, 8])[:6])) + f", …, {g['max_bs']}"
        mode = g.get("mode", "decode").replace("_", "-")
        graphs = f"cuda graphs: {mode} batch sizes {shown} ({g['count']} sizes, largest {g['max_bs']})"
        if g.get("max_bs_from"):
            graphs += f"; top: {g['max_bs_from']}"
    else:
        graphs = f"cuda graphs: not captured: {g['reason']}"
    where = f"from {z['source']}" + (f" {z['env_var']}" if z["source"] == "env" and z["env_var"] else "")
    lazy = (f"npu lazy memory: {fmt_bytes(z['bytes'])} of zbal lazy memory ({where})" if z["run"]
            else f"npu lazy memory: not initialized: {z['reason']}")
    return [graphs, lazy]


def installed_note(report: dict[str, Any], installed: Mapping[str, bool | str], profile: str,
                   given: Optional[str]) -> Optional[str]:
    """A human line for a plan of a named device profile whose backends were rejected only because this machine
    lacks their packages (or has them at versions attn-setup does not support): ``plan`` read the packages from this
    machine's metadata (no ``--installed``), which is the wrong question when planning for another machine, and the
    rejection's own remedy (``pip install …``) would be the wrong fix here. Names the packages missing (with the
    version, for one at an unsupported version) and the ``--installed`` value that assumes every backend's packages.
    None for ``--device-profile auto`` (this machine: installing is the fix), with ``--installed`` given, or when no
    backend was rejected for a package."""
    from pipeline.backends import packages

    if given is not None or profile.lower() == "auto":
        return None
    # only backends whose every reason is a missing package: one also refused for the arch (b200's sm100) would
    # stay refused with every package assumed, and the note would be untrue
    rejected = sorted({r["backend"] for side in report["rejected"].values() for r in side
                       if r["reasons"] and all(_only_packages_missing(reason) for reason in r["reasons"])})
    missing = [p if not v else f"{p} {v}" for p, v in installed.items()
               if not v or packages.unsupported(p, v) is not None]
    if not rejected or not missing:
        return None
    full = ",".join(dict.fromkeys(packages.import_name(p) for p in packages.names()))
    return (f"note: packages were read from this machine, which lacks {', '.join(missing)}; {', '.join(rejected)} "
            f"{'was' if len(rejected) == 1 else 'were'} rejected for that. To plan for the {profile} profile with them, "
            f"pass --installed {full}")


def _only_packages_missing(reason: str) -> bool:
    """Whether a rejection reason (``"; "``-joined parts) says nothing but that packages are not installed, or not
    at a version attn-setup supports."""
    return all("is not installed" in part or "a version attn-setup does not support" in part
               for part in reason.split("; "))


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
                           "here, it does not add to it: a GPU plan needs torch,triton,… too; NAME==VERSION assumes "
                           "that version (the measured table's evidence compares versions); '' = none "
                           "(default: read from package metadata, no import)")
    plan.add_argument("--num-layers", type=ascii_int, default=None,
                      help="the attention layers `attn-setup run` builds with these flags, for the CUDA-graph memory "
                           "estimate (default as run's: 2, or as many as it takes to include every attention kind)")
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--mem-fraction", type=ascii_float, default=None,
                        help="size the KV pool as run does from this share of the profile's device memory (sglang's "
                             "mem_fraction_static), less the decode graphs' estimate; reported as 'pool' "
                             "(default: unset, the pool has --num-token-slots slots)")
    budget.add_argument("--mem-bytes", type=ascii_int, default=None,
                        help="size the KV pool as run does from this many bytes (default: unset, as --mem-fraction)")
    from pipeline.cli.warmup import add_flag

    add_flag(plan)
    return plan


def _budget(ns: argparse.Namespace) -> Any:
    from pipeline.memory.fits import Budget

    return Budget(mem_fraction=getattr(ns, "mem_fraction", None), mem_bytes=getattr(ns, "mem_bytes", None))


def installed_from(flag: str | None) -> dict[str, bool | str]:
    """Package presence: the ``--installed`` list (present, at a supported version: assumed; ``NAME==VERSION``:
    at that version, checked by resolve), or distribution metadata (no import: the installed version, or False).

    Accepts the distribution names the backends need (:func:`pipeline.backends.packages.names`) and their
    import names, case-insensitively (:func:`pipeline.backends.packages.canonical`).
    Raises :class:`UsageError` (exit 2) for any other name, listing both spellings.
    """
    from pipeline.backends import packages

    dists = packages.names()
    if flag is None:
        return packages.installed_by_metadata(dists)
    entries = [x.strip() for x in flag.split(",")] if flag.strip() else []
    pairs = [(e.split("==", 1) + [""])[:2] for e in entries]
    pins = dict(pairs)
    given = [name for name, _ in pairs]
    canon = [packages.canonical(p) for p in given]
    unknown = [p for p, c in zip(given, canon) if c is None]
    twice = sorted({c for c in canon if c is not None and canon.count(c) > 1})
    if "" in given or twice:
        what = f"names {', '.join(twice)} more than once" if twice else "has an empty entry"
        raise UsageError(f"--installed {what}: {flag!r}", code="usage", flags=[("--installed", flag)],
                         allowed=["each package once, comma-separated (NAME or NAME==VERSION)"],
                         remedy="list each package once, e.g. --installed torch==2.11.0,triton==3.6.0,"
                                "flashinfer-python==0.7.2")
    if unknown:
        imports = list(dict.fromkeys(packages.import_name(d) for d in dists))
        raise UsageError(f"--installed names unknown package(s): {', '.join(unknown)}", code="usage",
                         flags=[("--installed", flag)],
                         allowed=list(dists) + [i for i in imports if i not in dists],
                         remedy=f"list distribution names ({', '.join(dists)}) or import names ({', '.join(imports)}), "
                                "comma-separated, or '' for none")
    vers = {c: pins[g].strip() for g, c in zip(given, canon) if pins[g].strip()}
    return {p: vers.get(p, p in canon) for p in dists}


def _installed_text(installed: Mapping[str, bool | str]) -> str:
    """``torch 2.13.0+cpu, triton 3.9.0`` (a package assumed by ``--installed``: its name alone), or ``none``."""
    return ", ".join(p if v is True else f"{p} {v}" for p, v in installed.items() if v) or "none"


def installed_hint(err: AttnSetupError, request: SetupRequest, device: DeviceFacts,
                   installed: Mapping[str, bool | str]) -> None:
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
    ``run`` leads with :func:`pipeline.cli.run.headline`."""
    from pipeline.cli.output import cli_error, command_dests

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
    from pipeline.cli.output import console, width, wrap

    if warnings and not ns.json:
        c = console(stderr=True)
        for line in wrap(headline(err), width(c)):  # at the terminal's width
            c.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    print_stderr_lines(warnings)
    print_error(err, ns.json, "plan")


def _decide(ns: argparse.Namespace) -> tuple[dict[str, Any], DeviceFacts, dict[str, bool | str]]:
    """The plan report for ``ns`` (the JIT variants that would compile included), the device profile and the packages
    assumed. Raises the typed error of a refusal (``--require-warm-cache`` with a cold variant among them)."""
    from types import SimpleNamespace

    from pipeline.cli.warmup import check_warm, cold_report
    from pipeline.cli.flags import request_from
    from pipeline.cli.run import check_plan_minimums
    from pipeline.core.shard import shard_summary
    from pipeline.platforms.profiles import get
    from pipeline.setup.distributed import check_launch_env

    check_launch_env()  # torchrun's variables refused as run refuses them (RANK outside WORLD_SIZE, no MASTER_ADDR)
    device = get(ns.device_profile)
    installed = installed_from(ns.installed)
    ns.device = device.device_str
    request = request_from(ns, on_gpu=device.type != "cpu")
    check_plan_minimums(request)  # what run refuses from its flags alone (its verification batches' needs)
    try:
        report = plan_report(request, device, installed, getattr(ns, "num_layers", None), _budget(ns))
    except AttnSetupError as e:
        if ns.installed is not None:
            installed_hint(e, request, device, installed)
        raise
    report["jit_cold"] = cold_report(request, device, SimpleNamespace(**{h: report["resolved"][h]
                                                                         for h in ("prefill", "decode")}))
    check_warm(ns, report["jit_cold"])
    report["_shard_line"] = shard_summary(request)
    return report, device, installed


def cmd(ns: argparse.Namespace) -> int:
    """Resolve and plan for ``--device-profile``; print JSON or the report; returns the exit code (0, or a refusal's).

    Human output, in order: the look-alike environment variables' ``warning:`` lines (stderr), the device and the
    packages assumed, the resolution and plan tables, skips and warnings, the CUDA-graph and NPU lazy-memory lines, the
    CUDA-graph memory estimate, the JIT line, and the verdict ``ok`` last. A refusal is printed by
    :func:`_print_refusal` (its error first) and returns the error's exit code (2 usage, 3 refused).
    """
    from pipeline.cli import output as rp
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
        report.pop("_shard_line")
        print_stderr_lines(warnings)
        rp.emit_json(report)
        return EXIT_OK
    from pipeline.cli.output import console, print_line
    from pipeline.cli.warmup import estimate_line

    print_stderr_lines(warnings)
    print_line(console(), f"device: {device.name or device.type} ({device.arch or device.type}) from "
                          f"{device.source}; installed: {_installed_text(installed)}")
    print_line(console(), report.pop("_shard_line"))
    rp.render_tables(report, report["rejected"], verdict=False)
    for line in decision_lines(report):
        print_line(console(), line)
    if report.get("cuda_graph_estimate"):
        print_line(console(), graph_estimate_line(report))
    for line in (pool_line(report), estimate_line(report["jit_cold"]), installed_note(report, installed, ns.device_profile,
                                                                      ns.installed)):
        if line:
            print_line(console(), line)
    rp.render_verdict(report)  # last, where the eye lands when the prompt returns (new user: 'ok' sat mid-report)
    return EXIT_OK

