"""Re-create the derived logs of this folder from their sources (run from the repository root):

    PYTHONPATH=. python3 tests/data/bad_inputs/traces/derive.py

Sources: tests/data/golden/ok_tbo.jsonl and ok_default.jsonl (real CPU starts, written before
``launch_id`` existed) and cli_run_ok.jsonl here (a real ``attn-setup run --device cpu`` trace in
the current format). ``two_launches_shared_run_id.jsonl`` is not derived: it was recorded with
``ATTN_SETUP_RUN_ID=shared-1``, first ``--decode-steps -1`` (refused before the pipeline), then a
good start, both appending to the same ``--log-file``. ``cli_run_refused_device.jsonl`` is not derived either: a
real ``attn-setup run --device cuda --log-file …`` on a CPU-only machine, refused at its flags (state ``args``,
``device_unavailable``, exit 3) before ``run_started``: a readable trace with no decision to replay.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parents[1] / "golden"


def records(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def write(name, recs, extra_lines=()):
    lines = [json.dumps(r, separators=(",", ":")) if isinstance(r, dict) else r for r in recs]
    (HERE / name).write_text("\n".join([*lines, *extra_lines]) + "\n")


def with_field(recs, event, key, value, only_first=True):
    out, done = [], False
    for r in recs:
        if r["event"] == event and not (only_first and done):
            r = {**r, key: value}
            done = True
        out.append(r)
    return out


tbo = records(GOLDEN / "ok_tbo.jsonl")
default = records(GOLDEN / "ok_default.jsonl")
cli = records(HERE / "cli_run_ok.jsonl")

write("event_list.jsonl", [], ['{"event":["x"]}'])
write("deep_nesting.jsonl", tbo, ["[" * 200_000 + "]" * 200_000])
write("duration_1e308.jsonl", with_field(tbo, "state_transition", "duration_ms", 1e308))
beat = {**next(r for r in tbo if r["event"] == "backend_built"), "event": "heartbeat", "what": "jit compile",
        "elapsed_s": 1e308, "started_ns": 0, "message": "still in build-mode: jit compile"}
beat.pop("role"), beat.pop("backend"), beat.pop("duration_ms")
write("heartbeat_elapsed_1e308.jsonl", [*tbo[:9], beat, *tbo[9:]])
write("rules_empty.jsonl", with_field(tbo, "backends_resolved", "rules", {}))
markup = [{**r, "run_id": "[bold red]x[/]"} for r in tbo]
markup = with_field(markup, "backend_built", "state", "[/]")
write("markup_run_id_and_state.jsonl", markup)
write("schema_version_zero.jsonl", [{**r, "schema_version": 0} for r in tbo])
write("old_writer_nan_as_null.jsonl", with_field(with_field(default, "instance_verified", "max_rel_err", None),
                                                 "instance_verified", "passed", False))
# what the writer now writes for a verification that came out NaN: the text form, run_failed, exit 1
failed = with_field(with_field(cli, "instance_verified", "max_rel_err", "NaN"), "instance_verified", "passed", False)
fin = next(i for i, r in enumerate(failed) if r["event"] == "command_finished")
err = {"code": "verification_failed", "state": "done", "flags": [], "json_path": None,
       "message": "failed verification: ['primary']", "allowed": [],
       "remedy": "the backend computes wrong attention for this model; report it with the log"}
run_failed = {**{k: failed[fin][k] for k in ("schema_version", "run_id", "rank", "launch_id", "state")},
              "event": "run_failed", "ts_ns": failed[fin]["ts_ns"] - 1, "outcome": "failed", "error": err,
              "released": []}
failed[fin] = {**failed[fin], "exit_code": 1}
write("verification_nan_text.jsonl", [*failed[:fin], run_failed, *failed[fin:]])
started = next(r for r in tbo if r["event"] == "run_started")
bad_req = {**started, "request": {**started["request"], "args": {**started["request"]["args"], "page_size": 0}}}
write("recorded_request_invalid.jsonl", [bad_req if r is started else r for r in tbo])
write("recorded_setting_unparsable.jsonl", with_field(with_field(with_field(
    tbo, "setting_resolved", "source", "env"), "setting_resolved", "value", "lots"), "setting_resolved", "env_var",
    "SGLANG_ZBAL_LOCAL_MEM_SIZE"))
