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
