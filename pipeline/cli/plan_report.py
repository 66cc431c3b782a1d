"""The ``attn-setup plan`` report: the JSON objects (``resolved``, ``plan``, ``rejected``, ``skips``, ``warnings``,
``cuda_graphs``, ``npu_lazy_mem``, the CUDA-graph memory estimate) and their human lines, built from the setup
table's decide mode (:func:`pipeline.setup.build.decide_setup`); :mod:`pipeline.cli.plan` parses the flags and
prints. Nothing here imports torch."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.contracts import DeviceFacts, Resolution, SetupRequest
from pipeline.observe.runview import device_view


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


def graph_estimate_obj(request: SetupRequest, decided: Any, num_layers: Any = None) -> dict[str, Any]:
    """``{cuda_graph_bytes_estimate, cuda_graph_estimate}`` for the stack ``run`` builds with ``num_layers`` (None:
    run's default) — :func:`states.graph_memory.estimate_for_decided`, as run's pool sizing calls it; 0 and None
    when no decode graphs are captured. Raises ConfigError for ``num_layers`` outside the model's attention layers,
    and ``workspace_exceeds_memory`` / ``pool_exceeds_memory`` for workspaces, graphs or pools the device profile
    cannot hold (:func:`states.graph_memory_check.check_plan_memory`: run refuses them too)."""
    from pipeline.core.layer_span import span_fields, span_of
    from states.graph_memory import estimate_for_decided
    from states.graph_memory_bound import lower_bound_for_decided
    from states.graph_memory_check import check_plan_memory, refuse_early

    served, cut = request.served_model, run_stack(request, num_layers)
    if cut is None:
        return {"cuda_graph_bytes_estimate": 0, "cuda_graph_estimate": None}
    spec = cut.served_model
    total = decided["device-init"].facts.total_memory_bytes
    refuse_early(cut, decided, lower_bound_for_decided(cut, decided), total)  # s11: before estimating every size
    est = estimate_for_decided(cut, decided)
    check_plan_memory(cut, decided, est, total)
    if est is None:
        return {"cuda_graph_bytes_estimate": 0, "cuda_graph_estimate": None}
    return {"cuda_graph_bytes_estimate": est.total_bytes,
            "cuda_graph_estimate": {"num_layers": est.num_layers, **span_fields(span_of(spec, served)),
                                    "num_hidden_layers": served.num_hidden_layers, "batch_sizes": est.batch_sizes,
                                    "pool_bytes": est.pool_bytes, "state_bytes": est.state_bytes,
                                    "warmup_bytes": est.warmup_bytes, "blas_workspace_bytes": est.blas_workspace_bytes,
                                    "per_bs": {str(b): v for b, v in sorted(est.per_bs.items(), reverse=True)}}}


def _layers_built(e: dict[str, Any]) -> str:
    """``2 attention layers (layers 0-7: 6 linear-attention skipped)`` for a ``cuda_graph_estimate``."""
    from pipeline.core.layer_span import LayerSpan, span_detail
    from pipeline.core.spec import LayerGroup

    n = e.get("attention_layers", e["num_layers"])
    skipped = [LayerGroup(kind=g["kind"], layer_ids=g["layer_ids"]) for g in e.get("skipped_layers") or []]
    s = LayerSpan(n, e["num_layers"], e.get("num_hidden_layers", e["num_layers"]), skipped)
    return f"{n} attention layer{'' if n == 1 else 's'} ({span_detail(s)})"


def graph_estimate_line(report: dict[str, Any]) -> str:
    """The human line of the estimate (empty without graphs)."""
    from pipeline.cli.report import fmt_bytes

    e = report.get("cuda_graph_estimate")
    if not e:
        return ""
    sizes = e["batch_sizes"]
    span = f"bs {sizes[0]}" if len(sizes) == 1 else f"bs {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)"
    return (f"decode CUDA graphs: {fmt_bytes(report['cuda_graph_bytes_estimate'])} estimated for {span} over "
            f"{_layers_built(e)}: graph pool {fmt_bytes(e['pool_bytes'])}, replay state "
            f"{fmt_bytes(e['state_bytes'])}, warm-up stream {fmt_bytes(e['warmup_bytes'])} (cuBLAS workspace "
            f"{fmt_bytes(e['blas_workspace_bytes'])} of it); run takes it out of a --mem-fraction budget before "
            "sizing the KV pool")


def _retell_workspace_refusal(request: SetupRequest, decided: Any, device: DeviceFacts, num_layers: Any) -> None:
    """s12ws: a ``workspace_too_small`` refusal raised again with a remedy whose alternatives fit beside the KV pools
    and the graphs of the stack ``run`` builds (:func:`states.workspace_remedy_check.retell_workspace_refusal`);
    any other refusal, or a ``num_layers`` the model refuses (raised after the refusal, as before), left alone."""
    from pipeline.core.errors import AttnSetupError
    from states.workspace_remedy_check import retell_workspace_refusal

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
                num_layers: Any = None) -> dict[str, Any]:
    """The plan report for ``request`` on ``device`` (raises the typed error of a refusal).

    ``installed``: each package's presence (:data:`pipeline.backends.packages.Presence`); the report's
    ``installed`` says present or not, ``package_versions`` the version resolve checked (null: absent, or assumed by
    ``--installed``).

    The setup table in decide mode (:func:`pipeline.setup.build.decide_setup`): the decisions a run makes
    before allocating — resolve (``strict`` included), build-mode's plan, the CUDA-graph sizes against
    ``max_reqs``, each workspace against the largest batch it plans, npu-lazy-mem — so ``plan`` refuses what
    a run would refuse. ``warnings``: the reference fallback and every downgrade
    (:func:`states.resolve.warnings_for`), as a run logs them. ``num_layers``: the layers ``run`` would build,
    for the CUDA-graph memory estimate (:func:`graph_estimate_obj`).
    """
    from pipeline.cli import report as rp
    from pipeline.setup.build import decide_setup
    from states import resolve

    decided = decide_setup(request, facts=device, installed=installed)
    _retell_workspace_refusal(request, decided, device, num_layers)
    decided.raise_refusal()
    res, plan = decided["resolve"], decided["build-mode"].plan
    return {"ok": True, "device": device_view(device), "installed": {p: bool(v) for p, v in installed.items()},
            "package_versions": {p: v if isinstance(v, str) else None for p, v in installed.items()},
            "resolved": rp.resolved_obj(res), "plan": rp.plan_obj(plan), "rejected": rejected_obj(res),
            "skips": skips_of(decided),
            "warnings": warnings_obj(resolve.warnings_for(res, list(res.skips) + list(plan.skips), device))
            + rp.layer_rule_warnings(request),
            "cuda_graphs": cuda_graphs_obj(request, decided["build-mode"].graphs, device),
            "npu_lazy_mem": lazy_mem_obj(decided["npu-lazy-mem"]),
            **graph_estimate_obj(request, decided, num_layers)}


def cuda_graphs_obj(request: SetupRequest, graphs: Any, device: Optional[DeviceFacts] = None) -> dict[str, Any]:
    """``cuda_graphs`` of plan JSON: ``{capture, reason, batch_sizes, count, max_bs, max_bs_source, max_bs_from}`` —
    whether decode CUDA graphs are captured (:func:`states.graphs.decide_graphs`; ``reason`` when not), the decode
    batch sizes a run captures on ``device`` (:func:`states.graphs.capture_batch_sizes`: ``cuda_graph_bs``, else
    sglang's 1, 2, 4, 8, 16, 24, … up to ``cuda_graph_max_bs``, else up to sglang's default for the device's memory
    capped by ``max_reqs``; null when more than :data:`states.graphs.LISTED_SIZES`), how many and the largest (0
    without graphs), and where the top came from (:func:`states.graphs.graph_top`: ``max_bs_source`` one of
    ``cuda_graph_bs``, ``cuda_graph_max_bs``, ``default``, ``max_reqs``; ``max_bs_from`` in words, e.g.
    ``default for 131 GiB: 256 (sglang's rule)``; null without graphs)."""
    from states.graphs import graph_sizes, graph_top

    kw = dict(device=device, world_size=request.world_size)
    count, largest, sizes = graph_sizes(request.args, request.pool.max_reqs, graphs.capture, **kw)
    top = graph_top(request.args, request.pool.max_reqs, **kw) if graphs.capture else None
    return {"capture": graphs.capture, "reason": graphs.reason, "batch_sizes": sizes, "count": count,
            "max_bs": largest, "max_bs_source": top and top.source, "max_bs_from": top and top.text}


def lazy_mem_obj(lazy: Any) -> dict[str, Any]:
    """``npu_lazy_mem`` of plan JSON: ``{run, bytes, source, env_var, reason}`` — npu-lazy-mem's decision
    (:func:`states.npu_lazy_mem.decide`: zbal lazy memory on an NPU, not on a draft worker, with a size > 0), the
    size in bytes and where it came from (``field`` > ``env`` ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` > ``default`` 0), and
    why it is skipped."""
    d, s = lazy.decision, lazy.setting
    return {"run": d.run, "bytes": s.value, "source": s.source, "env_var": s.env_var, "reason": d.reason}


def decision_lines(report: dict[str, Any]) -> list[str]:
    """The human lines for ``cuda_graphs`` and ``npu_lazy_mem`` (sizes listed, shortened past 12)."""
    from pipeline.cli.report import fmt_bytes

    g, z = report["cuda_graphs"], report["npu_lazy_mem"]
    if g["capture"]:
        sizes = g["batch_sizes"]
        shown = ", ".join(map(str, sizes)) if sizes is not None and len(sizes) <= 12 else \
            ", ".join(map(str, (sizes or [1, 2, 4, 8])[:6])) + f", …, {g['max_bs']}"
        graphs = f"cuda graphs: decode batch sizes {shown} ({g['count']} sizes, largest {g['max_bs']})"
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
    # stay refused with every package assumed, and the note would be untrue (adversarial pass #5)
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
