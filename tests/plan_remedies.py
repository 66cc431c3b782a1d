"""Shared by the tests that follow a ``plan`` remedy (workspace, graph and pool refusals): run ``plan`` on the H200
profile in-process through the CLI's main, set a flag in an argv, check a value against its flag's domain, and split
a CLI remedy into the alternatives it names."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pipeline.cli.flags import FLAG_DOMAINS

H200 = ("--device-profile", "h200", "--installed", "torch,triton,flashinfer")


def plan(argv: Any, monkeypatch: Any = None, env: Optional[dict[str, str]] = None) -> tuple[int, dict]:
    """``attn-setup plan`` with ``H200``, ``argv`` and ``--json`` (``env`` set through ``monkeypatch`` for the call):
    the exit code and the JSON object."""
    from conftest import run_main

    if env:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            proc = run_main("plan", *H200, *argv, "--json")
    else:
        proc = run_main("plan", *H200, *argv, "--json")
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def set_flag(argv: list[str], flag: str, value: Optional[str] = None) -> list[str]:
    """``argv`` without ``flag`` (and the value after it), then ``flag value`` (a switch when ``value`` is None)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out + ([flag] if value is None else [flag, value])


def in_domain(flag: str, value: Any) -> bool:
    """Whether ``value`` lies in ``flag``'s domain (:data:`pipeline.cli.flags.FLAG_DOMAINS`)."""
    d = next(d for d in FLAG_DOMAINS if d.flag == flag)
    return d.domain.lo <= int(value) <= d.domain.hi


SWITCHES = ("--disable-cuda-graph",)  # flags a remedy names without a value


def alternatives(remedy: str) -> list[tuple[dict[str, Optional[str]], dict[str, str]]]:
    """Each ``, or ``-separated way of the CLI remedy as (flags, environment variables) to set; a switch of
    :data:`SWITCHES` maps to None."""
    ways = []
    for clause in remedy.split(", or "):
        flags: dict[str, Optional[str]] = dict(re.findall(r"(--[\w-]+)(?: \(or \w+\))?(?: to at least| to)? (\d+)",
                                                          clause))
        flags.update({f: None for f in SWITCHES if re.search(rf"{f}(?![\w-])", clause)})
        env = dict(re.findall(r"\b([A-Z][A-Z_]+)(?: to at least |=)(\d+)", clause))
        assert flags or env, clause
        ways.append((flags, env))
    return ways


def follow_every_alternative(argv: list[str], remedy: str, monkeypatch: Any,
                             env: Optional[dict[str, str]] = None) -> list[dict]:
    """Apply each alternative of ``remedy`` to ``argv`` (every flag value inside its domain; its variables on top of
    ``env``, the refused plan's environment) and plan again; asserts each plans ok and returns their JSON objects."""
    outs = []
    for flags, extra in alternatives(remedy):
        fixed = argv
        for flag, value in flags.items():
            assert value is None or in_domain(flag, value), (flag, value)
            fixed = set_flag(fixed, flag, value)
        rc, out = plan(fixed, monkeypatch, {**(env or {}), **extra})
        assert rc == 0, (argv, remedy, fixed, out.get("error"))
        outs.append(out)
    return outs


def refused_then_followed(argv: list[str], codes: tuple[str, ...], monkeypatch: Any) -> tuple[Optional[dict], list[dict]]:
    """``plan`` with ``argv``: ``(None, [])`` when it plans ok; else asserts exit 3 with a code in ``codes``, follows
    every alternative of the remedy (:func:`follow_every_alternative`) and returns ``(error, their JSON objects)``."""
    rc, out = plan(argv, monkeypatch)
    if rc == 0:
        return None, []
    err = out["error"]
    assert rc == 3 and err["code"] in codes, err
    return err, follow_every_alternative(argv, err["remedy"], monkeypatch)


def grid_argv(max_reqs: int, ws: Optional[int], top: Any) -> list[str]:
    """``--max-reqs``, then ``--flashinfer-workspace-size`` unless ``ws`` is None, then ``--cuda-graph-max-bs`` unless
    ``top`` is None (``"max_reqs"``: the same as ``--max-reqs``)."""
    argv = ["--max-reqs", str(max_reqs)]
    if ws is not None:
        argv += ["--flashinfer-workspace-size", str(ws)]
    if top is not None:
        argv += ["--cuda-graph-max-bs", str(max_reqs if top == "max_reqs" else top)]
    return argv
