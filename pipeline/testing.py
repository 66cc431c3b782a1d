"""Helpers for users' own pytest suites: replay assertions, the fake platform, trace builders.

::

from pipeline.testing import assert_replays, record_trace, FakePlatform, cuda_facts

def test_yesterdays_start_still_decides_the_same(): assert_replays("tests/data/golden/ok_default.jsonl")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from pipeline.core.contracts import DeviceFacts, SetupRequest
from pipeline.platforms.fake import FakePlatform
from pipeline.observe.replay import ReplayResult, replay
from pipeline.observe.trace import read_trace
from pipeline.observe.runs import Trace

__all__ = ["FakePlatform", "assert_replays", "record_trace", "cuda_facts", "cpu_facts", "truncate_trace",
           "read_trace", "replay"]


def assert_replays(path: Any) -> ReplayResult:
    """Replay ``path`` (any :func:`pipeline.replay` input); AssertionError naming the first divergence."""
    result = replay(path)
    if not result.same:
        bad = next(r for r in result.runs if r.divergence is not None)
        d = bad.divergence
        raise AssertionError(
            f"replay of {path} diverged (run {bad.run_id}, rank {bad.rank}) in state {d.state!r}, field {d.field!r}: "
            f"recorded {d.recorded!r}, now {d.now!r}. If the change is intended, re-record the trace "
            "(see tests/data/golden/README.md).")
    return result


def cpu_facts(**over: Any) -> DeviceFacts:
    """DeviceFacts of a CPU device (fields overridable)."""
    return DeviceFacts(**{"type": "cpu", "name": "test-cpu", "sm_count": 2, "source": "test", **over})


def cuda_facts(cc: tuple[int, int] = (9, 0), name: str = "NVIDIA H100", index: int = 0, **over: Any) -> DeviceFacts:
    """DeviceFacts of an NVIDIA GPU with compute capability ``cc`` (default sm90)."""
    return DeviceFacts(**{"type": "cuda", "index": index, "name": name, "vendor": "nvidia", "compute_capability": cc,
                          "sm_count": 132, "total_memory_bytes": 80 << 30, "cuda_version": "12.4",
                          "source": "test", **over})


def record_trace(request: SetupRequest, path: str | os.PathLike, *, facts: Optional[DeviceFacts] = None,
                 installed: Optional[Mapping[str, bool]] = None) -> Trace:
    """Run the real pipeline on a :class:`FakePlatform` reporting ``facts`` and write its trace to ``path`` (a refusal
    is recorded and swallowed); ``installed`` overrides presence. Returns the trace read back."""
    from pipeline.setup.build import build_attention_backends
    from pipeline.core.errors import AttnSetupError

    platform = FakePlatform(facts or cpu_facts())
    try:
        backends = build_attention_backends(request, platform=platform, log_file=str(path), installed=installed)
        backends.close()
    except AttnSetupError:
        pass
    return read_trace(path)


def truncate_trace(src: str | os.PathLike, dst: str | os.PathLike, *, keep_lines: int, partial: bool = True) -> Path:
    """Copy the first ``keep_lines`` lines of ``src`` to ``dst`` and, with ``partial``, half of the
    next line — what a trace looks like after the process was killed mid-write."""
    lines = Path(src).read_bytes().splitlines(keepends=True)
    out = b"".join(lines[:keep_lines])
    if partial and keep_lines < len(lines):
        out += lines[keep_lines][: len(lines[keep_lines]) // 2]
    Path(dst).write_bytes(out)
    return Path(dst)
