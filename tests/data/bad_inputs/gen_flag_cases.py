"""Re-creates the generated ``flagvalue_*`` flag cases of cases.json: every integer / number
flag of ``plan`` and ``run`` (run's own ones; the shared ones through plan) with values argparse cannot convert,
with a value that starts with '-' (must be attached: ``--flag=VALUE``) and with no value. Each must be exit 2
naming the flag in the ErrorInfo's ``flags``: ``out_of_domain`` for a value the flag's domain refuses
(:mod:`pipeline.cli.flags`), ``usage`` for a value missing or detached. Run from the repository root: ``python3
tests/data/bad_inputs/gen_flag_cases.py`` (rewrites cases.json in place, keeping every other case)."""

import argparse
import json
from pathlib import Path

from pipeline.cli.flags import build_parser

VALUES = [("word", "abc"), ("decimal", "1.5"), ("superscript", "\u00b2"), ("hex", "0x10"), ("empty", ""),
          ("exp", "1e400"), ("nan", "nan")]


def generated() -> list[dict]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    shared = {o for a in sub["plan"]._actions for o in a.option_strings}
    out = []
    for cmd in ("plan", "run"):
        for a in sub[cmd]._actions:
            longs = [o for o in a.option_strings if o.startswith("--")]
            if not longs or a.type not in (int, float) or (cmd == "run" and longs[0] in shared):
                continue
            flag, stem = longs[0], f"flagvalue_{cmd}_{longs[0][2:].replace('-', '_')}"
            for vn, v in VALUES:
                if a.type is float and vn in ("decimal", "exp", "nan"):  # numbers to a float flag
                    continue
                out.append({"name": f"{stem}_{vn}", "command": cmd, "argv": [flag, v], "exit": 2,
                            "code": "out_of_domain", "flag": flag})
            out.append({"name": f"{stem}_dash_value", "command": cmd, "argv": [flag, "-x"], "exit": 2,
                        "code": "usage", "flag": flag, "remedy_has": flag + "=VALUE"})
            out.append({"name": f"{stem}_missing_value", "command": cmd, "argv": [flag], "exit": 2, "code": "usage",
                        "flag": flag})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("cases.json")
    corpus = json.loads(path.read_text())
    gen = generated()
    names = {c["name"] for c in gen}
    kept = [c for c in corpus["cases"] if c["name"] not in names]
    corpus["cases"] = kept + gen
    path.write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"{len(gen)} generated cases, {len(corpus['cases'])} in all")
