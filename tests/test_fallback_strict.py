"""Issue 13 §4: no silent reference fallback, and a strict mode.

A generated matrix (every device profile × every bundled config × flags × installed packages ×
target/draft worker) checks, against an expectation computed here from the capability facts
(torch_native: the only backend without CUDA graphs; every device but ``cpu`` is an accelerator):

- ``plan``'s ``warnings`` hold exactly the reference fallback (auto landed on torch_native on an
  accelerator) and the downgrades (CUDA graphs off on a CUDA device; TBO dropped on a draft worker);
- with ``strict`` the same request is refused iff there is a warning (``reference_fallback`` /
  ``downgrade_refused``, exit 3, state resolve), and every fix its remedy proposes, applied,
  resolves under strict with no warning left;
- a refusal without ``strict`` stays the same refusal with it.

Then the library (events, replay, nothing allocated) and the CLI (one warning line, ``--json``
``warnings`` equal between run and plan, ``--strict`` exit 3 and its remedy working).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from conftest import CONFIGS
from pipeline.core import events as ev
from pipeline.cli import output as rp
from pipeline.setup.build import build_attention_backends
from pipeline.cli import main
from pipeline.cli.plan import plan_report
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.platforms.profiles import PROFILES
from remedy_fixes import apply, fixes_of
from states.fallback import StrictRefusal
from states.resolve import auto_candidates

MODELS = {p.stem: load_model_spec(p) for p in sorted(CONFIGS.glob("*.json"))}
ALL = {"torch": True, "triton": True, "flashinfer-python": True}
INSTALLS = {"all": ALL, "torch-only": {"torch": True, "triton": False, "flashinfer-python": False}}
SPEC = {"speculative_algorithm": "EAGLE"}
FLAGS = {
    "auto": {},
    "kv-fp8": {"kv_cache_dtype": "fp8_e4m3"},
    "tn": {"attention_backend": "torch_native"},
    "tn-nograph": {"attention_backend": "torch_native", "disable_cuda_graph": True},
    "decode-tn": {"decode_attention_backend": "torch_native"},
    "nograph": {"disable_cuda_graph": True},
    "bf16": {"dtype": "bfloat16"},
    "tbo": {"enable_two_batch_overlap": True, "moe_a2a_backend": "deepep"},
}
REFERENCE = "torch_native"


def _request(model: str, flags: dict, draft: bool, strict: bool = False) -> SetupRequest:
    args = AttentionArgs(**{**flags, **(SPEC if draft else {})}, strict=strict)
    return SetupRequest(args=args, model=MODELS[model], is_draft_worker=draft, device="cpu",
                        pool=PoolFacts(max_reqs=8, page_size=args.page_size, num_token_slots=64 * args.page_size))


def _expected(out: dict, device, args: AttentionArgs, draft: bool) -> list[tuple[str, str]]:
    """(code, what) of every warning, written from the facts, not from resolve's code."""
    res = out["resolved"]
    fell = [h for h in ("prefill", "decode") if res["rules"][h] == "auto" and res[h] == REFERENCE]
    want = [("reference_fallback", "+".join(fell))] if fell and device.type != "cpu" else []
    if device.type == "cuda" and not args.disable_cuda_graph and res["decode"] == REFERENCE:
        want.append(("feature_downgraded", "cuda_graph"))
    if draft and args.enable_two_batch_overlap:
        want.append(("feature_downgraded", "two_batch_overlap"))
    return want


CASES = [(p, m, f, i, d) for p in PROFILES for m in MODELS for f in FLAGS for i in INSTALLS for d in (False, True)
         if not (d and f == "tbo" and m != "llama-3.1-8b")]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_warnings_and_strict_over_the_matrix(profile):
    """Per profile: every config × flags × packages × worker — warnings as expected, strict refuses exactly
    those, and each fix a strict remedy proposes resolves under strict with no warning left."""
    device = PROFILES[profile]
    seen = {"ok": 0, "warned": 0, "refused": 0}
    for p, model, flag, inst, draft in CASES:
        if p != profile:
            continue
        installed = INSTALLS[inst]
        req = _request(model, FLAGS[flag], draft)
        ctx = (profile, model, flag, inst, draft)
        try:
            out = plan_report(req, device, installed)
        except ConfigError as e:
            seen["refused"] += 1
            with pytest.raises(ConfigError) as strict_err:
                plan_report(_request(model, FLAGS[flag], draft, strict=True), device, installed)
            assert strict_err.value.info.code == e.info.code and not isinstance(strict_err.value, StrictRefusal), ctx
            continue
        got = [(w["code"], w["what"]) for w in out["warnings"]]
        assert got == _expected(out, device, req.args, draft), ctx
        for w in out["warnings"]:
            assert w["message"] and w["avoid"], ctx
            if w["code"] == "reference_fallback":  # every rejected candidate with its reasons
                assert all(r["reasons"] for rs in w["rejected"].values() for r in rs), ctx
                assert w["rejected"] == {h: out["rejected"][h] for h in w["what"].split("+")}, ctx
        strict_req = _request(model, FLAGS[flag], draft, strict=True)
        if not got:
            seen["ok"] += 1
            assert plan_report(strict_req, device, installed)["resolved"] == out["resolved"], ctx
            continue
        seen["warned"] += 1
        with pytest.raises(StrictRefusal) as ei:
            plan_report(strict_req, device, installed)
        info = ei.value.info
        want_code = "reference_fallback" if got[0][0] == "reference_fallback" else "downgrade_refused"
        assert (info.code, info.state, ei.value.exit_code) == (want_code, "resolve", 3), ctx
        assert ("strict", True) in [(f.name, f.value) for f in info.flags], ctx
        fixes = fixes_of(info.remedy)
        assert fixes and any(f.fields == {"strict": False} for f in fixes), (ctx, info.remedy)
        for fix in fixes:
            fixed, inst2 = apply(strict_req, installed, fix)
            again = plan_report(fixed, device, inst2)
            assert again["warnings"] == [] or fix.fields == {"strict": False}, (ctx, fix, again["warnings"])
            if fix.fields != {"strict": False}:  # accepting the reference backend keeps the same pair
                assert (again["resolved"]["prefill"], again["resolved"]["decode"]) == (
                    out["resolved"]["prefill"], out["resolved"]["decode"]), (ctx, fix)
    assert sum(seen.values()) > 0
    if device.type != "cpu":
        assert seen["warned"] > 0  # every accelerator profile has a reference fallback somewhere in the matrix


@pytest.mark.parametrize("profile,flags,model", [
    ("b200", {}, "llama-3.1-8b"), ("mi300x", {}, "llama-3.1-8b"), ("rtx-pro-6000", {}, "llama-3.1-8b"),
    # DeepSeek (MLA) and fp8 KV on GQA resolve flashinfer; fp8 KV on MLA layers is served by no
    # GPU record (FlashInfer's MLA wrapper takes no k_scale/v_scale, triton has no fp8)
    ("h100", {"kv_cache_dtype": "fp8_e4m3"}, "deepseek-v2-lite"),
    ("h200", {"kv_cache_dtype": "fp8_e5m2"}, "deepseek-v2-lite"),
])
def test_the_issues_silent_cases_now_warn_and_strict_refuses(profile, flags, model):
    """The issue's list (every package assumed installed): a reference_fallback warning naming each rejected
    candidate with reasons and a cuda_graph downgrade; strict: exit 3 reference_fallback naming the fix."""
    out = plan_report(_request(model, flags, False), PROFILES[profile], ALL)
    assert [(w["code"], w["what"]) for w in out["warnings"]] == [("reference_fallback", "prefill+decode"),
                                                                 ("feature_downgraded", "cuda_graph")]
    fb = out["warnings"][0]
    # auto's order (an MLA model on sm90 tries the measured MLA table first: flashinfer, triton, then fa3)
    assert [r["backend"] for r in fb["rejected"]["decode"]] == auto_candidates(PROFILES[profile], MODELS[model])[:3]
    assert sorted(r["backend"] for r in fb["rejected"]["decode"]) == ["fa3", "flashinfer", "triton"]
    assert fb["avoid"] == {"attention_backend": "torch_native"}
    assert out["warnings"][1]["avoid"] == {"disable_cuda_graph": True}
    with pytest.raises(StrictRefusal) as ei:
        plan_report(_request(model, flags, False, strict=True), PROFILES[profile], ALL)
    info = ei.value.info
    assert info.code == "reference_fallback"
    assert info.remedy.startswith("set attention_backend='torch_native' and disable_cuda_graph=True")
    assert all(b in info.message for b in ("flashinfer:", "fa3:", "triton:"))


def test_explicit_reference_backend_is_not_a_fallback_but_graphs_off_is_a_downgrade():
    """--attention-backend torch_native on an H200: no reference_fallback (the user chose it), one cuda_graph
    downgrade; with --disable-cuda-graph nothing; on CPU (graphs do not apply) nothing either."""
    h200, cpu = PROFILES["h200"], PROFILES["cpu"]
    out = plan_report(_request("llama-3.1-8b", FLAGS["tn"], False), h200, ALL)
    assert [(w["code"], w["what"]) for w in out["warnings"]] == [("feature_downgraded", "cuda_graph")]
    assert plan_report(_request("llama-3.1-8b", FLAGS["tn-nograph"], False), h200, ALL)["warnings"] == []
    out = plan_report(_request("llama-3.1-8b", {}, False), cpu, ALL)
    assert out["warnings"] == [] and [s["what"] for s in out["skips"]][0] == "cuda_graph"


# --- library: events, nothing allocated, replay --------------------------------------------------------

def _fake(profile: str) -> FakePlatform:
    """A platform that reports ``profile``'s facts while tensors live on the CPU (torch_native runs)."""
    facts = msgspec.structs.replace(PROFILES[profile], source="test")
    return FakePlatform(facts, "cpu")


def test_library_logs_reference_fallback_and_downgrade_as_plan_reports_them(tmp_path):
    """A B200 start (faked, tensors on CPU): reference_fallback + feature_downgraded warning events, the same
    warnings plan computes, and the trace replays the same (fallback halves included)."""
    from pipeline.observe.replay import replay

    req = msgspec.structs.replace(_request("llama-3.1-8b", {}, False), device="cuda:0")
    log = tmp_path / "b200.jsonl"
    with build_attention_backends(req, platform=_fake("b200"), installed=ALL, log_file=str(log)) as out:
        fb = [r for r in out.events if isinstance(r, ev.ReferenceFallback)]
        assert len(fb) == 1 and fb[0].halves == ["prefill", "decode"] and fb[0].level == "warning"
        assert [r.backend for r in fb[0].rejected["prefill"]] == ["flashinfer", "fa3", "triton"]
        assert rp.warnings_from(out.events) == plan_report(req, PROFILES["b200"], ALL)["warnings"]
    assert replay(str(log)).same


def test_library_strict_refuses_in_resolve_before_anything_is_allocated():
    """strict=True on the faked B200: StrictRefusal in resolve, run_failed with its code, no backend or pool."""
    from pipeline.core.eventlog import EventLog

    req = msgspec.structs.replace(_request("llama-3.1-8b", {}, False, strict=True), device="cuda:0")
    log = EventLog("strict-test")
    with pytest.raises(StrictRefusal) as ei:
        build_attention_backends(req, platform=_fake("b200"), installed=ALL, log=log)
    assert ei.value.info.code == "reference_fallback" and ei.value.info.state == "resolve"
    names = [ev.event_name(type(r)) for r in log.records]
    assert "backend_built" not in names and "build_planned" not in names and names[-1] == "run_failed"
    assert log.records[-1].error.code == "reference_fallback"


def test_cpu_cuda_graph_skip_is_a_step_skipped_not_a_warning(llama, small_pool):
    """On CPU, CUDA graphs do not apply: a step_skipped record (info), no feature_downgraded, resolve not 'skipped'."""
    from pipeline.observe.runs import Run

    req = SetupRequest(args=AttentionArgs(strict=True), model=llama, pool=small_pool, device="cpu")
    with build_attention_backends(req, installed=ALL) as out:
        skips = [r for r in out.events if isinstance(r, ev.StepSkipped) and r.state == "resolve"]
        assert [s.what for s in skips] == ["cuda_graph"]
        assert not any(isinstance(r, (ev.FeatureDowngraded, ev.ReferenceFallback)) for r in out.events)
        rows = {r["state"]: r["outcome"] for r in Run(run_id=out.run_id, rank=0, records=list(out.events)).states()}
        assert rows["resolve"] == "ok" and rows["npu-lazy-mem"] == "skipped"


# --- the command line ---------------------------------------------------------------------------------

def _warnings(out: str) -> list[str]:
    """The 'warning:' lines of a report, each with its wrapped continuation lines joined (width-independent)."""
    found, lines = [], out.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("warning:"):
            rest = [x.strip() for x in lines[i + 1:]]
            more = next((k for k, x in enumerate(lines[i + 1:]) if not x.startswith("  ")), len(rest))
            found.append(" ".join([ln, *rest[:more]]))
    return found


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_plan_prints_one_warning_line_and_json_warnings(capsys):
    """plan on b200: exactly one 'warning:' line naming the flags that accept it; --json has the warnings list."""
    base = ["plan", "--device-profile", "b200", "--installed", "torch,triton,flashinfer"]
    code, out, err = _cli(capsys, *base)
    lines = _warnings(out)
    assert code == 0 and len(lines) == 1 and "warning" not in err
    assert "--attention-backend torch_native --disable-cuda-graph" in lines[0] and "--strict" in lines[0]
    code, out, _ = _cli(capsys, *base, "--json")
    fallback = [w for w in json.loads(out)["warnings"] if w["code"] == "reference_fallback"]
    assert fallback and all(w["message"] in lines[0] for w in fallback)  # the reason too, as --json gives it
    assert [w["code"] for w in json.loads(out)["warnings"]] == ["reference_fallback", "feature_downgraded"]
    code, out, _ = _cli(capsys, "plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer")
    assert code == 0 and "warning:" not in out


@pytest.mark.parametrize("profile", ["ascend-910b", "b200", "mi300x"])
def test_human_warning_gives_the_reason_json_gives(capsys, profile):
    """The human warning line carries each warning's message — the device and why nothing else serves it
    (ascend-910b: "on npu: no other backend is registered for it") —, as --json's warnings do."""
    base = ["plan", "--device-profile", profile, "--installed", "torch,triton,flashinfer"]
    code, out, _ = _cli(capsys, *base, "--json")
    warns = json.loads(out)["warnings"]
    code, out, _ = _cli(capsys, *base)
    (line,) = _warnings(out)
    assert code == 0 and warns
    for w in warns:
        assert (w["message"] if w["code"] == "reference_fallback" else f"{w['what']} downgraded: ") in line, line
    if profile == "ascend-910b":
        assert "on npu: no other backend is registered for it" in line


def test_plan_strict_exit_3_and_its_remedy_flags_work(capsys):
    """plan --strict on b200: exit 3, code reference_fallback, remedy in flags; those flags then plan cleanly."""
    base = ["plan", "--device-profile", "b200", "--installed", "torch,triton,flashinfer", "--strict", "--json"]
    code, out, _ = _cli(capsys, *base)
    err = json.loads(out)["error"]
    assert code == 3 and err["code"] == "reference_fallback"
    assert err["remedy"].startswith("set --attention-backend torch_native and --disable-cuda-graph")
    code, out, _ = _cli(capsys, *base, "--attention-backend", "torch_native", "--disable-cuda-graph")
    assert code == 0 and json.loads(out)["warnings"] == []


SMALL = ["--num-layers", "1", "--decode-steps", "0", "--max-reqs", "4", "--max-context-len", "64"]


def test_run_cpu_warning_line_json_equals_plan_and_strict_refuses(tmp_path, capsys):
    """run --device cpu on a draft worker with TBO: one warning line, not repeated on stderr (only with -v),
    run's --json warnings equal plan's; --strict: exit 3 downgrade_refused in resolve before the model loads,
    remedy 'drop --enable-two-batch-overlap', and without that flag the strict run succeeds."""
    flags = ["--draft-worker", "--enable-two-batch-overlap", "--moe-a2a-backend", "deepep", "--speculative-algorithm",
             "EAGLE"]
    run = ["run", "--device", "cpu", "--log-file", str(tmp_path / "{run_id}.jsonl"), *SMALL]
    code, out, err = _cli(capsys, *run, *flags)
    lines = _warnings(out)
    assert code == 0 and len(lines) == 1 and "two_batch_overlap downgraded" in lines[0]
    assert "drop --enable-two-batch-overlap" in lines[0] and "feature_downgraded" not in err
    code, out, err = _cli(capsys, "-v", *run, "--json", *flags)
    run_w = json.loads(out)["warnings"]
    assert code == 0 and "feature_downgraded" in err  # -v: the full record on stderr too
    code, out, _ = _cli(capsys, "plan", "--device-profile", "cpu", "--json", *flags)
    assert run_w == json.loads(out)["warnings"] and [w["what"] for w in run_w] == ["two_batch_overlap"]
    code, out, _ = _cli(capsys, *run, "--json", "--strict", *flags)
    res = json.loads(out)
    assert code == 3 and res["error"]["code"] == "downgrade_refused" and res["error"]["state"] == "resolve"
    assert res["error"]["remedy"].startswith("drop --enable-two-batch-overlap")
    assert res["runner_states"] == []  # refused in preflight: the model never loaded
    flags.remove("--enable-two-batch-overlap")
    code, out, _ = _cli(capsys, *run, "--json", "--strict", *flags)
    assert code == 0 and json.loads(out)["warnings"] == []


def test_strict_is_an_attention_args_field_with_a_flag():
    """strict is a library field (engines get it) and the generated --strict flag of run/plan/warmup."""
    from pipeline.cli import build_parser

    assert AttentionArgs().strict is False and "strict" in AttentionArgs.__struct_fields__
    ns = build_parser().parse_args(["plan", "--strict"])
    assert ns.strict is True
