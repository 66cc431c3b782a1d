"""Issue 13 §5: remedies that are true, "did you mean", --installed import names, one wording.

The property, over every refusal of the bad-input corpus (tests/data/bad_inputs) and of the resolve
table (tests/test_resolve_table.py) — each row also with ``strict`` and with every known backend
name, mistyped ones included, forced on every profile: each backend named in ``allowed`` or in the
remedy, and each change the remedy proposes, applied to the same request, resolves (plan's
decisions, nothing skipped). Hypothesis adds random requests with several faults at once: each
proposed fix resolves the whole request (remedies are completed with what the rest needs).
Messages and remedies never hold a Python list repr; library remedies name fields, the CLI shows
its flags.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CONFIGS
from pipeline.backends import registry
from pipeline.cli import build_parser, main
from pipeline.cli.plan import installed_from
from pipeline.cli.plan import plan_report
from pipeline.cli.flags import request_from
from pipeline.core.contracts import AttentionArgs, ErrorInfo
from pipeline.core.errors import ConfigError, UsageError
from pipeline.platforms.profiles import PROFILES
from pipeline.cli.output import cli_dests, to_cli
from remedy_fixes import Fix, apply, backends_named, fixes_of
from test_bad_inputs import CASES, DATA

# the corpus's refusals (exit 2/3); its log-reader, interrupt and success cases are tests/test_bad_inputs.py's alone
CORPUS = [c for c in CASES if c.get("command", "run") != "read" and c["exit"] in (2, 3)
          and not c.get("setup") and not c.get("interrupt")]
from test_resolve_table import ROWS, _model
from conftest import run_main

ALL = {"torch": True, "triton": True, "flashinfer-python": True}
BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                 "speculative_draft_attention_backend")
LIST_REPR = re.compile(r"\[\s*['\"]|\[-?\d+(, -?\d+){2,}\]")  # ['a', …] or [1, 2, 3]; an interval [1, 4096] is fine


SHOWN_CONFIG_VALUE = re.compile(r"\$[\w.\[\]]*=\S+")  # `$.torch_dtype=["bfloat16"]`: the user's own JSON value


def _no_list_repr(info: ErrorInfo) -> None:
    for text in (info.message, info.remedy):
        assert not LIST_REPR.search(SHOWN_CONFIG_VALUE.sub("", text)), text


def _check_remedy(request, device, installed, info: ErrorInfo) -> int:
    """Every backend in allowed/remedy and every fix resolves for ``request``; returns how many were applied."""
    _no_list_repr(info)
    named_flag = re.search(r"\bset (\w+) to one of: ", info.remedy)  # the field `allowed` is for
    flag = named_flag.group(1) if named_flag else next(
        (f.name for f in info.flags if f.name in BACKEND_FLAGS and f.value is not None), None)
    applied, covered = 0, set()
    for name in info.allowed:
        if name in registry.known_names():
            assert flag is not None, info
            fixed, inst = apply(request, installed, Fix(fields={flag: name}))
            plan_report(fixed, device, inst)
            applied, covered = applied + 1, covered | {name}
    for fix in fixes_of(info.remedy):
        fixed, inst = apply(request, installed, fix)
        plan_report(fixed, device, inst)
        applied += 1
        covered |= {v for v in fix.fields.values() if isinstance(v, str)}
    refused = {f.value for f in info.flags if f.name in BACKEND_FLAGS}  # quoted as context ("the inherited 'triton'")
    named = backends_named(info.remedy) - refused
    assert named <= covered, (named - covered, info.remedy)
    return applied


# --- the resolve table -----------------------------------------------------------------------------

def _table_request(row, **extra):
    from pipeline.core.contracts import PoolFacts, SetupRequest

    args = AttentionArgs(**{**row.flags, **extra})
    draft = _model(row.draft_config) if row.draft_config else None
    req = SetupRequest(args=args, model=_model(row.config), draft_model=draft, is_draft_worker=row.draft,
                       device="cpu", pool=PoolFacts(page_size=args.page_size, num_token_slots=64 * args.page_size))
    installed = {p: p in row.installed.split(",") for p in ALL}
    return req, installed


@pytest.mark.parametrize("strict", [False, True])
def test_every_resolve_table_refusal_has_a_true_remedy(strict):
    """Each refused row (and, with strict, each row strict refuses): allowed backends and remedy fixes resolve."""
    checked = refused = 0
    for row in ROWS:
        req, installed = _table_request(row, strict=strict)
        try:
            plan_report(req, PROFILES[row.profile], installed)
        except ConfigError as e:
            refused += 1
            checked += _check_remedy(req, PROFILES[row.profile], installed, e.info)
    assert refused >= (22 if not strict else 30) and checked >= refused


FORCED_PROFILES = ("cpu", "a100", "h200", "b200", "mi300x", "ascend-910b")  # one per distinct rule set
FORCED_MODELS = ("llama-3.1-8b", "deepseek-v2-lite", "gpt-oss-20b", "gemma-2-9b")  # GQA, MLA, sinks, fp32+softcap
FORCED_NAMES = (sorted(registry.names()) + ["flashmla", "aiter", "trtllm_mha", "ascend"]
                + ["flashinfr", "tritn", "fa", "torch_nativ", "TRITON", "torch-native", "xyzzy"])


def test_forced_names_on_every_profile_and_model():
    """Registered, sglang-only, mistyped and unknown names forced on each distinct profile × model (global flag,
    and the decode flag under strict, where the other half falls back): every refusal's remedy is true."""
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    models = [load_model_spec(CONFIGS / f"{m}.json") for m in FORCED_MODELS]
    refusals = 0
    for prof in FORCED_PROFILES:
        for model in models:
            for name in FORCED_NAMES:
                for flag, strict in (("attention_backend", False), ("attention_backend", True),
                                     ("decode_attention_backend", True)):
                    req = SetupRequest(args=AttentionArgs(**{flag: name}, strict=strict), model=model, device="cpu",
                                       pool=PoolFacts())
                    try:
                        plan_report(req, PROFILES[prof], ALL)
                    except ConfigError as e:
                        refusals += 1
                        _check_remedy(req, PROFILES[prof], ALL, e.info)
    assert refusals > 500


# --- the bad-input corpus --------------------------------------------------------------------------

# Cases refused by `run`'s own checks before any request exists, or by what only `run` knows (environment
# variables, the machine's memory, flags only `run` has): checked through `run` with their environment, as
# tests/test_bad_inputs.py runs them — their remedies must name no backend (none is the fix) and no list repr.
RUN_ONLY = {"page_size_text", "unknown_flag", "device_bogus", "draft_model_without_draft_worker",
            "model_missing_file", "model_is_directory", "num_layers_beyond_attention_layers", "max_context_len_one",
            "page_size_4096_default_slots"}  # its remedy is followed in test_trial_fixes.py
RUN_ONLY_CODES = {"pool_exceeds_memory", "workspace_exceeds_memory", "weights_exceed_memory"}  # this machine's memory


def _run_only(case: dict) -> bool:
    if case["name"] in RUN_ONLY or case.get("code") in RUN_ONLY_CODES or case["exit"] == 2:
        return True
    if case.get("env") or case.get("unset") or case.get("command", "run") != "run":
        return True
    argv = [a.format(data=DATA, configs=CONFIGS, tmp="/tmp") for a in case["argv"]]
    try:
        build_parser().parse_args(["plan", "--device-profile", "cpu", *argv])
    except (UsageError, SystemExit):
        return True
    return False


def _profile_plan(case: dict) -> bool:
    """A ``plan`` case on a named GPU profile whose refusal is a backend's (resolve): its remedy names backends.
    A refusal for what ``--installed`` leaves out is the CLI's (its remedy is the ``--installed`` set that plans,
    followed through ``main`` below)."""
    return (case.get("command") == "plan" and not case.get("env") and not case.get("unset")
            and case.get("flag") != "--installed"
            and case.get("code") == "capability_mismatch" and "--device-profile" in case["argv"])


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_every_corpus_refusal_has_a_true_remedy(case, tmp_path, capsys, monkeypatch):
    """The corpus request as plan builds it: its refusal's allowed backends and remedy fixes resolve on cpu."""
    argv = [a.format(data=DATA, configs=CONFIGS, tmp=tmp_path) for a in case["argv"]]
    installed = installed_from(None)
    if _profile_plan(case):  # a GPU profile's refusal: its remedy checked on that profile and --installed
        from pipeline.platforms.profiles import get

        ns = build_parser().parse_args(["plan", *argv])
        device, inst = get(ns.device_profile), installed_from(ns.installed)
        ns.device = device.device_str
        req = request_from(ns, on_gpu=device.type != "cpu")
        with pytest.raises(ConfigError) as ei:
            plan_report(req, device, inst)
        assert ei.value.info.code == case["code"] and ei.value.exit_code == case["exit"]
        _check_remedy(req, device, inst, ei.value.info)
        return
    if _run_only(case):
        for var in case.get("unset", []):
            monkeypatch.delenv(var, raising=False)
        for var, value in case.get("env", {}).items():
            monkeypatch.setenv(var, value.replace("{free_port}", "1"))
        command = case.get("command", "run")
        head = (["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "r.jsonl")] if command == "run"
                else [command, "--json"])
        code = main([*head, *argv])
        err = json.loads(capsys.readouterr().out)["error"]
        named = re.search(r"pass --installed (\S+)", err["remedy"]) if command == "plan" else None
        if named:  # follow it: it must plan
            fix = named.group(1)
            at = argv.index("--installed")
            assert main([*head, *argv[:at], "--installed", fix, *argv[at + 2:]]) == 0
            capsys.readouterr()
            return
        # --moe-a2a-backend's own choices include 'flashinfer' (FlashInfer's MoE all-to-all, not its attention)
        assert code == case["exit"] and (not backends_named(err["remedy"]) or case["flag"] == "--moe-a2a-backend")
        assert not LIST_REPR.search(SHOWN_CONFIG_VALUE.sub("", err["message"]))
        return

    def plan_request(args: list[str]):
        ns = build_parser().parse_args(["plan", "--device-profile", "cpu", *args])
        ns.device = "cpu"
        return request_from(ns, on_gpu=False)

    try:
        req = plan_request(argv)
    except ConfigError as e:  # refused while reading the config or the flags (no request yet): apply by flag
        assert case["exit"] == 3 and not set(e.info.allowed) & set(registry.known_names())
        _no_list_repr(e.info)
        for name in backends_named(e.info.remedy):
            flag = next(f.name for f in e.info.flags if f.name in BACKEND_FLAGS)
            plan_report(plan_request([*argv, "--" + flag.replace("_", "-"), name]), PROFILES["cpu"], installed)
        return
    try:
        plan_report(req, PROFILES["cpu"], installed)
    except ConfigError as e:
        assert e.info.code == case["code"]
        _check_remedy(req, PROFILES["cpu"], installed, e.info)
        return
    pytest.fail(f"{case['name']} is refused by run but planned by plan")


# --- did you mean ------------------------------------------------------------------------------------

def _refusal(profile, installed, **args):
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    req = SetupRequest(args=AttentionArgs(**args), model=load_model_spec(CONFIGS / "llama-3.1-8b.json"),
                       device="cpu", pool=PoolFacts())
    with pytest.raises(ConfigError) as ei:
        plan_report(req, PROFILES[profile], installed)
    return req, ei.value.info


@pytest.mark.parametrize("typo,profile,installed,guess,note", [
    ("flashinfr", "h200", ALL, "flashinfer", "did you mean 'flashinfer'?"),
    ("flashinfr", "h200", {**ALL, "flashinfer-python": False}, "flashinfer", "needs flashinfer-python"),
    ("flashinfr", "cpu", ALL, "flashinfer", "cannot serve this request here"),
    ("TRITON", "h200", ALL, "triton", "did you mean 'triton'?"),
    ("torch-native", "cpu", ALL, "torch_native", "did you mean 'torch_native'?"),
    ("flashml", "h200", ALL, "flashmla", "which attn-setup does not implement"),
    ("trtlm_mha", "b200", ALL, "trtllm_mha", "which attn-setup does not implement"),
])
def test_typo_gets_did_you_mean_over_every_known_name(typo, profile, installed, guess, note):
    """The closest known name (registered or sglang's, installed or not), what it needs, and a true remedy."""
    req, info = _refusal(profile, installed, attention_backend=typo)
    assert info.code == "backend_unknown" and f"did you mean {guess!r}?" in info.message and note in info.message
    _check_remedy(req, PROFILES[profile], installed, info)
    if guess in info.allowed:
        assert info.allowed[0] == guess and info.remedy.startswith(f"set attention_backend to one of: {guess}")


def test_missing_package_typo_remedy_installs_then_sets():
    """flashinfr without flashinfer-python: 'install flashinfer-python and set attention_backend='flashinfer'';
    applying both resolves to flashinfer."""
    inst = {**ALL, "flashinfer-python": False}
    req, info = _refusal("h200", inst, attention_backend="flashinfr")
    assert info.remedy.startswith("install flashinfer-python and set attention_backend='flashinfer'")
    fix = fixes_of(info.remedy)[0]
    fixed, inst2 = apply(req, inst, fix)
    assert plan_report(fixed, PROFILES["h200"], inst2)["resolved"]["prefill"] == "flashinfer"


def test_no_suggestion_for_a_name_close_to_nothing():
    """xyzzy: no 'did you mean'; the remedy lists what works here."""
    _, info = _refusal("h200", ALL, attention_backend="xyzzy")
    assert "did you mean" not in info.message and info.remedy == "set attention_backend to one of: fa3, flashinfer, " \
                                                                "torch_native, triton"


@pytest.mark.parametrize("profile,model,name,want", [
    ("h200", "deepseek-v2-lite", "flashmla", ["flashinfer", "torch_native", "triton"]),
    ("mi300x", "llama-3.1-8b", "aiter", ["torch_native"]),
])
def test_unavailable_sglang_names_advise_only_what_resolves(profile, model, name, want):
    """The issue's two false remedies: flashmla on an H200 MLA model offers exactly the backends serving MLA there
    (flashinfer, torch_native, triton since), aiter on an MI300X only torch_native."""
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    req = SetupRequest(args=AttentionArgs(attention_backend=name), model=load_model_spec(CONFIGS / f"{model}.json"),
                       device="cpu", pool=PoolFacts())
    with pytest.raises(ConfigError) as ei:
        plan_report(req, PROFILES[profile], ALL)
    info = ei.value.info
    assert info.allowed == want and ("triton" in info.remedy) == ("triton" in want)
    _check_remedy(req, PROFILES[profile], ALL, info)


# --- --installed import names --------------------------------------------------------------------------

@pytest.mark.parametrize("flag,want", [
    ("flashinfer", {"torch": False, "triton": False, "flashinfer-python": True}),
    ("torch,FlashInfer", {"torch": True, "triton": False, "flashinfer-python": True}),
    ("torch, triton, flashinfer_python", {"torch": True, "triton": True, "flashinfer-python": True}),
    ("flashinfer-python,torch", {"torch": True, "triton": False, "flashinfer-python": True}),
    ("", {"torch": False, "triton": False, "flashinfer-python": False}),
])
def test_installed_accepts_import_names(flag, want):
    """--installed flashinfer means the flashinfer-python distribution (case-insensitive)."""
    assert installed_from(flag) == want


def test_installed_unknown_name_is_a_usage_error_without_list_repr(capsys):
    """An unknown package: exit 2, names it, lists both spellings, no Python list repr."""
    assert main(["plan", "--device-profile", "cpu", "--installed", "torch,flash-attn", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert "flash-attn" in err["message"] and "flashinfer" in err["remedy"] and "[" not in err["message"]


def test_plan_with_import_name_resolves_flashinfer(capsys):
    """plan --installed torch,flashinfer on an H200 picks flashinfer (the alias counts as the distribution)."""
    assert main(["plan", "--device-profile", "h200", "--installed", "torch,flashinfer", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["prefill"] == "flashinfer"


# --- one wording -------------------------------------------------------------------------------------

@pytest.mark.parametrize("library,cli", [
    ("set attention_backend to one of: torch_native, triton", "set --attention-backend to one of: torch_native, triton"),
    ("set attention_backend='torch_native' and disable_cuda_graph=True to accept it, or drop strict",
     "set --attention-backend torch_native and --disable-cuda-graph to accept it, or drop --strict"),
    ("drop enable_pdmux or drop enable_two_batch_overlap", "drop --enable-pdmux or drop --enable-two-batch-overlap"),
    ("drop 113 from cuda_graph_bs (keeping 1, 2), or raise max_reqs to at least 113",
     "drop 113 from --cuda-graph-bs (keeping 1, 2), or raise --max-reqs to at least 113"),
    ("set cuda_graph_max_bs=212", "set --cuda-graph-max-bs 212"),
    ("pass device='cpu', or run on a machine with that device", "pass --device cpu, or run on a machine with that device"),
    ("build the pools from pool.max_reqs and SGLANG_FLASHINFER_WORKSPACE_SIZE",
     "build the pools from pool.max_reqs and SGLANG_FLASHINFER_WORKSPACE_SIZE"),
    ("already --attention-backend stays", "already --attention-backend stays"),
])
def test_cli_wording_rewrites_fields_into_flags(library, cli):
    """Field names and assignments become the flags the CLI accepted; prose, paths and env vars stay."""
    assert to_cli(library) == cli


def test_library_remedies_name_fields_and_cli_remedies_name_flags():
    """Over the resolve table (strict too): no library remedy names a CLI flag of an AttentionArgs field, and
    after the CLI rewrite no remedy names a bare snake_case field."""
    flags = {"--" + f.replace("_", "-") for f in AttentionArgs.__struct_fields__}
    snake = [d for d in cli_dests() if "_" in d]
    for row in ROWS:
        for strict in (False, True):
            req, installed = _table_request(row, strict=strict)
            try:
                plan_report(req, PROFILES[row.profile], installed)
            except ConfigError as e:
                r = e.info.remedy
                assert not any(f in r for f in flags), r
                cli = to_cli(r)
                assert not any(re.search(rf"(?<![\w.\-]){d}(?![\w\-])", cli) for d in snake), cli


def test_cli_json_and_text_errors_show_flags(capsys):
    """plan --json and the text error show '--attention-backend' in the remedy; the library error says attention_backend."""
    argv = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer", "--model",
            str(CONFIGS / "deepseek-v2-lite.json"), "--attention-backend", "flashmla"]
    assert main([*argv, "--json"]) == 3
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["remedy"] == "set --attention-backend to one of: flashinfer, torch_native, triton"
    assert err["allowed"] == ["flashinfer", "torch_native", "triton"]
    assert main(argv) == 3
    assert "remedy: set --attention-backend to one of: flashinfer, torch_native, triton" in capsys.readouterr().err


# --- random requests with several faults at once ------------------------------------------------------

MANY_NAMES = [None, None, *registry.names(), "trtllm_mha", "flashinfr"]


@st.composite
def faulty_requests(draw):
    """Any mix of backend flags (typos and sglang-only names too), modes (TBO with or without an EP all-to-all),
    EAGLE shapes (steps, top-k, draft tokens: chains, trees, too many tokens, parts missing), dtypes, strict, worker
    kind and device;
    torch installed (a remedy cannot install a package for a second fault), triton/flashinfer either way."""
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    names = st.sampled_from(MANY_NAMES)
    algorithm = draw(st.sampled_from([None, "EAGLE"]))
    draft_worker = draw(st.booleans())  # the draft backend only where the library takes it (draft worker or EAGLE)
    args = AttentionArgs(
        attention_backend=draw(names), prefill_attention_backend=draw(names), decode_attention_backend=draw(names),
        speculative_draft_attention_backend=draw(names) if draft_worker or algorithm else None,
        speculative_algorithm=algorithm,
        speculative_num_steps=draw(st.sampled_from([None, 1, 3])) if algorithm else None,
        speculative_eagle_topk=draw(st.sampled_from([None, 1, 4])) if algorithm else None,
        speculative_num_draft_tokens=draw(st.sampled_from([None, 4, 8, 40])) if algorithm else None,
        enable_pdmux=draw(st.booleans()), enable_two_batch_overlap=draw(st.booleans()),
        moe_a2a_backend=draw(st.sampled_from(["none", "deepep"])),
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8_e4m3", "float16"])),
        dtype=draw(st.sampled_from(["auto", "bfloat16", "float32"])), disable_cuda_graph=draw(st.booleans()),
        strict=draw(st.booleans()))
    model = load_model_spec(CONFIGS / f"{draw(st.sampled_from(FORCED_MODELS))}.json")
    req = SetupRequest(args=args, model=model, is_draft_worker=draft_worker, device="cpu", pool=PoolFacts())
    installed = {"torch": True, "triton": draw(st.booleans()), "flashinfer-python": draw(st.booleans())}
    return req, PROFILES[draw(st.sampled_from(sorted(PROFILES)))], installed


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faulty_requests())
def test_every_fix_of_any_refusal_resolves_the_whole_request(case):
    """However many faults a request has, each alternative its refusal's remedy proposes (completed with what the
    rest of the request needs) resolves it entirely; no list repr; the CLI rewrite leaves no bare field name."""
    req, device, installed = case
    try:
        plan_report(req, device, installed)
    except ConfigError as e:
        fixes = fixes_of(e.info.remedy)
        assert fixes, e.info.remedy
        _check_remedy(req, device, installed, e.info)
        cli = to_cli(e.info.remedy)
        assert not any(re.search(rf"(?<![\w.\-]){d}(?![\w\-])", cli) for d in cli_dests() if "_" in d), cli


def _run(capsys, tmp_path, *argv):
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    return code, json.loads(capsys.readouterr().out)


def test_page_size_remedy_is_enough_when_followed(capsys, tmp_path):
    """--page-size 4096 with the default slots: the remedy names every slot verification needs (24576 with the
    default 3 decode steps), and following it runs to ok — it asked for 8192, then 24576, before (item 5)."""
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1")
    assert code == 3 and out["error"]["code"] == "pool_budget_too_small"
    slots = re.search(r"--num-token-slots (\d+)", out["error"]["remedy"]).group(1)
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1",
                     "--num-token-slots", slots)
    assert code == 0 and out["ok"], out["error"]


@pytest.mark.parametrize("page,given", [(16, 1), (16, 1000), (4096, 1), (64, 65)])
def test_the_page_multiple_named_then_plans(page, given):
    proc = run_main("plan", "--device-profile", "cpu", "--page-size", str(page), "--num-token-slots", str(given),
                    "--json")
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert proc.returncode == 3 and err["code"] == "invalid_value", err
    fix = err["remedy"].split("--num-token-slots ", 1)[1].split()[0]
    assert int(fix) % page == 0 and int(fix) >= given
    proc = run_main("plan", "--device-profile", "cpu", "--page-size", str(page), "--num-token-slots", fix, "--json")
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("max_reqs,ctx,tail", [(1, 12, ""), (2, 40, ", or lower max_reqs or max_context_len"),
                                               (1, 40, ", or lower max_context_len"), (4, 12, ", or lower max_reqs")])
def test_a_budget_remedy_offers_only_what_can_go_lower(max_reqs, ctx, tail):
    from pipeline.core.errors import ConfigError
    from pipeline.memory.pools import size_pools

    with pytest.raises(ConfigError) as e:
        size_pools([], 1, "bfloat16", page_size=1, max_reqs=max_reqs, max_context_len=ctx, budget_bytes=1,
                   min_slots=72, min_context_len=12)
    assert e.value.info.code == "pool_budget_too_small" and e.value.info.remedy.endswith(f"bytes{tail}"), \
        e.value.info.remedy
