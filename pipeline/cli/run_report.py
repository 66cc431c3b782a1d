"""``attn-setup run``'s report: the JSON object (``--json``) and what the terminal shows — the model line, the KV
pool and CUDA-graph lines, the runner timeline with the setup states nested, the stack's verified steps and, for a
failed run, the error last. Split out of :mod:`pipeline.cli.run` (the command flow), which re-exports every name
here; the records' outcomes come from :mod:`pipeline.observe.runs`, the shared tables from
:mod:`pipeline.cli.report`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

import msgspec
from rich.markup import escape

from pipeline.cli import report as rp
from pipeline.core import events as ev
from pipeline.core.contracts import ErrorInfo, ModelSpec, SetupRequest
from pipeline.core.errors import EXIT_OK, AttnSetupError


def _print(ns: argparse.Namespace, report: dict[str, Any], records: Any, request: SetupRequest,
           error: Optional[ErrorInfo], code: int = EXIT_OK, notices: Sequence[str] = ()) -> None:
    """``--json``'s object (the notices on stderr), or: for a failed run first its headline (:func:`headline`: the
    state, the error, its message and remedy — new-user trial #5: the cause was below the tables), the notices,
    the model and device, the runner timeline, the tables, the startup summary, the verdict (``ok`` / ``failed``:
    stdout's last line, as ``plan``'s) and — for a failed run, last, where the eye lands when the prompt returns —
    the error in full in the command line's flags under a red rule that says the run failed and its exit code
    (new-user trial #2: the error sat between the tables)."""
    from pipeline.cli.console import console, print_stderr_lines, width, wrap

    if ns.json:
        print_stderr_lines(notices)
        rp.emit_json(report)
        return
    if error is not None:
        from pipeline.cli.wording import cli_error, command_dests

        c = console(stderr=True)
        for line in wrap(headline(cli_error(error, command_dests("run")), code), width(c)):  # at the terminal's width
            c.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    print_stderr_lines(notices)
    _render_runner(report, records, request)
    rp.render_tables({**report, "states": []}, verdict=False)  # the setup states are in the runner timeline above
    from pipeline.cli.startup import render_summary

    render_summary(report["summary"], records)  # with the slow_phase warnings under it
    rp.render_verdict(report)  # stdout's last line, after the startup summary, as plan's (it sat above the summary)
    if error is not None:
        from pipeline.cli.wording import cli_error, command_dests

        sys.stdout.flush()  # the tables are out before the error (one terminal, two streams)
        console(stderr=True).rule(f"[bold red]attn-setup run failed (exit {code})[/]", style="red", align="left")
        rp.render_error(cli_error(error, command_dests("run")))


def headline(info: ErrorInfo, code: int) -> str:
    """A failed run's first line: ``attn-setup run failed (exit 3) in state resolve: backend_unavailable: <message>;
    remedy: <remedy>``."""
    return (f"attn-setup run failed (exit {code}) in state {info.state}: {info.code}: {info.message}"
            + (f"; remedy: {info.remedy}" if info.remedy else ""))


def device_line(report: dict[str, Any], request: Optional[SetupRequest]) -> Optional[str]:
    """``device: cuda:0 NVIDIA H200 (sm90), written as CUDA:0`` from the report's ``device``; the requested device
    when the run stopped before device-init read its facts."""
    from pipeline.observe.runs import device_text

    d = report.get("device")
    if d is not None:
        return f"device: {device_text(d)}"  # inspect prints the same line from the log
    if request is None:
        return None
    spelled = request.device_spelled_as
    return (f"device: {request.device} requested (the run stopped before device-init read its facts)"
            + (f", written as {spelled}" if spelled else ""))


def _report(log: Any, run_id: str, code: int, verified: list, steps: list, log_file: str,
            error: Optional[ErrorInfo]) -> dict[str, Any]:
    """Run's JSON object; the error's remedy in this command line's flags."""
    from pipeline.cli.wording import cli_error, command_dests
    from pipeline.observe.runs import device_from, outcomes

    return {
        "ok": code == EXIT_OK, "run_id": run_id, "states": outcomes(log.records, "setup"),
        "resolved": rp.resolved_from(log.records), "plan": rp.plan_from(log.records),
        "skips": rp.skips_from(log.records), "warnings": rp.warnings_from(log.records), "verified": verified,
        "log_file": os.path.abspath(log_file),
        "error": None if error is None else msgspec.to_builtins(cli_error(error, command_dests("run"))),
        "runner_states": outcomes(log.records, "runner"), "model_steps": steps, "device": device_from(log.records),
    }


def model_line(request: SetupRequest, records: Any) -> str:
    """``model: llama (LlamaForCausalLM) from PATH, 2 attention layers built (layers 0-1) of 32`` (+ the draft
    model on a draft worker); a hybrid names the layers of the span it skipped: ``2 attention layers built
    (layers 0-7: 6 linear-attention skipped) of 48`` (:func:`pipeline.core.layer_span.span_text`)."""
    from pipeline.core.layer_span import layer_span, span_text

    built = next((r.num_layers for r in records if isinstance(r, ev.ModelLoaded)), None)

    from pipeline.cli.inspect_text import _safe  # text from the config: terminal escapes shown escaped, as plan does

    def one(m: ModelSpec, serves: bool) -> str:
        arch = f" ({', '.join(map(_safe, m.architectures))})" if m.architectures else ""
        layers = ""
        if serves and built is not None:
            layers = ", " + span_text(layer_span(list(m.layer_types), built, m.num_hidden_layers))
        return f"{_safe(m.model_type)}{arch} from {_safe(m.source or 'a dict')}{layers}"

    draft = request.draft_model
    text = f"model: {one(request.model, draft is None or not request.is_draft_worker)}"
    if request.is_draft_worker:
        text += f"; draft worker serving {'the draft model: ' + one(draft, True) if draft else 'the model itself'}"
    return text


def timeline_title(report: dict[str, Any]) -> str:
    """The timeline's heading, true to its rows: the setup states are nested only when the runner reached its
    attention step; a start refused before the runner started shows the setup states alone."""
    runner = [s["state"] for s in report.get("runner_states") or []]
    if "attention" in runner:
        return "timeline (runner states, setup states under attention)"
    if runner:
        return "timeline (runner states; the setup machine did not start)" if not report.get("states") else \
            "timeline (runner states, then the setup states)"
    return "timeline (setup states; the runner did not start)"


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
    line = (f"KV pool: {r.num_token_slots} token slots x {rp.fmt_bytes(r.bytes_per_token)} = {rp.fmt_bytes(r.kv_bytes)} "
            f"(from {r.source}), req_to_token {r.max_reqs} x {r.max_context_len} = {rp.fmt_bytes(r.req_to_token_bytes)}")
    if r.graph_bytes_estimate:
        kept = ", kept out of the budget" if r.source == "mem_fraction" else ""
        line += f"; decode CUDA graphs {rp.fmt_bytes(r.graph_bytes_estimate)} estimated{kept}"
    return line


def _top_text(records: Any, request: Optional[SetupRequest]) -> str:
    """`` (top: default for 131 GiB: 256 (sglang's rule))``: where the largest captured size came from
    (:func:`states.build_mode.graph_top` on the initialized device); empty when that cannot be said."""
    from states.build_mode import graph_top

    init = next((r for r in records if isinstance(r, ev.DeviceInitialized)), None)
    if request is None or init is None:
        return ""
    try:
        top = graph_top(request.args, request.pool.max_reqs, device=init.facts, world_size=request.world_size)
    except AttnSetupError:
        return ""
    return f" (top: {top.text})"


def _graph_line(records: Any, request: Optional[SetupRequest] = None) -> Optional[str]:
    """``CUDA graphs: 4 sizes captured (top: default for 131 GiB: 256 (sglang's rule)), graph pool 2.0 MiB (estimated
    2.0 MiB), capture step took 76.0 MiB of the device (estimated 76.0 MiB kept, 78.0 MiB at its peak)`` from the
    ``cuda_graph_memory`` event (None without one)."""
    m = next((r for r in records if isinstance(r, ev.CudaGraphMemory)), None)
    if m is None:
        return None
    return (f"CUDA graphs: {len(m.batch_sizes)} sizes captured{_top_text(records, request)}, graph pool "
            f"{rp.fmt_bytes(m.pool_bytes)} (estimated "
            f"{rp.fmt_bytes(m.pool_estimate)}), capture step took {rp.fmt_bytes(m.step_device_bytes)} of the device "
            f"(estimated {rp.fmt_bytes(m.kept_estimate)} kept, {rp.fmt_bytes(m.total_estimate)} at its peak)"
            + (f", after {rp.fmt_bytes(m.prime_device_bytes)} of one-time capture setup before the pools were sized"
               if m.prime_device_bytes else ""))


def _render_runner(report: dict[str, Any], records: Any = (), request: Optional[SetupRequest] = None) -> None:
    """The model, the timeline (runner states with the setup states nested) and the stack's verified steps,
    at the terminal's width (:mod:`pipeline.cli.console`)."""
    from pipeline.cli.console import console, print_line, print_table

    c = console()
    if request is not None:
        print_line(c, model_line(request, records))
    for line in (device_line(report, request), _pool_line(records), _graph_line(records, request)):
        if line:
            print_line(c, line)
    rows = timeline_rows(report)
    if rows:
        print_table(c, timeline_title(report), ["state", "outcome", "duration ms"],
                    [[label, outcome, f"{ms:.1f}"] for label, outcome, ms in rows])
    if report["model_steps"]:
        from pipeline.observe.runs import tol_text

        steps = report["model_steps"]
        # an MLA stack is judged against two references per step: the table names them (module model_steps)
        refs = any(s.get("reference", "").startswith("mla-") for s in steps)
        print_table(c, "attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                    ["step", "bs", "graph"] + (["reference"] if refs else []) + ["max rel err", "tol", "passed"],
                    [[s["step"], str(s["batch_size"]), "yes" if s["graph"] else "no"]
                     + ([s.get("reference", "")] if refs else [])
                     + [f"{s['max_rel_err']:.2e}", tol_text(s["tol"]), "yes" if s["passed"] else "NO"]
                     for s in steps])
