"""replay's human output and lost lines: trace text escaped; a lost record is unreadable, not a divergence."""

import json
from pathlib import Path

from pipeline.cli import main

GOLDEN = Path(__file__).parent / "data" / "golden"
EVIL = "ab\x1b]0;pwn\x07\x1b[2J"


def test_replay_escapes_trace_text(tmp_path, capsys):
    recs = [json.loads(x) for x in (GOLDEN / "ok_default.jsonl").read_text().splitlines()]
    for r in recs:
        if "run_id" in r:
            r["run_id"] = EVIL
    path = tmp_path / "evil.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc = main(["replay", str(path)])
    out = capsys.readouterr()
    assert rc == 0, out
    assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err
    assert "ab\\x1b]0;pwn\\x07\\x1b[2J" in out.out


def test_an_unreadable_skip_line_is_trace_unreadable_not_diverged(tmp_path, capsys):
    lines = (GOLDEN / "ok_default.jsonl").read_bytes().splitlines()
    i = next(i for i, x in enumerate(lines) if b'"feature_downgraded"' in x and b'"resolve"' in x)
    path = tmp_path / "g.jsonl"
    path.write_bytes(b"\n".join(lines[:i] + [b'{"event": "garb'] + lines[i + 1:]) + b"\n")
    rc = main(["replay", str(path)])
    text = " ".join(capsys.readouterr().err.split())
    assert rc == 2, text
    assert "trace_unreadable" in text and "state 'resolve' has no step_skipped" in text
    assert f"g.jsonl:{i + 1} (not_json)" in text and "DIVERGED" not in text
