"""Event records: one per transition and per decision, schema-versioned, a tagged union.

Every record carries ``schema_version``, ``ts_ns`` (wall clock, ns), ``run_id``, ``rank``, ``state``
and ``outcome`` ∈ {ok, skipped, failed}; the ``event`` tag names it (stable snake_case). A run's
records, one JSON object a line, are its trace: :func:`decode_line` reads one back into its type.

Schema policy: ``schema_version`` rises when a field is removed or changes meaning; adding a field
with a default does not. Readers accept versions ``1 ..= SCHEMA_VERSION`` (``launch_id`` was added
with a default, so traces written before it read as launch ``""``).

Wire form (:func:`encode` / :func:`decode_line`): JSON has no NaN or infinity, and msgspec would
write them as ``null`` — a value the reader then refuses for a ``float`` field, dropping the whole
record. So a non-finite float is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
(the spelling protobuf's JSON mapping uses for them) and a ``float`` field holding one of those
strings reads back as the float; ``null`` in a ``float`` field that cannot be None (what older
versions wrote for them) reads back as NaN. Inside free-form fields
(``Any``: a request, a config) the string stays a string. A string holding a lone UTF-16 surrogate
(which UTF-8 cannot encode) is written with the surrogate as the text ``\\udXXX``; a free-form value
nested deeper than readers keep is written as ``"<nested too deep>"``. Every record
therefore encodes, and every record encoded reads back (``tests/test_event_wire.py`` checks it over
every record type with hypothesis).
"""

from __future__ import annotations

from typing import Any

# The records live in three modules by who emits them, the codec in one; this module gathers them, so
# ``from pipeline.core import events as ev; ev.RunStarted``, ``ev.encode`` and ``ev.decode_line`` keep working.
from pipeline.core.contracts import (  # noqa: F401 (reachable here before the split)
    SCHEMA_VERSION, DeviceFacts, ErrorInfo, InstancePlan, LayerGroup, Mode, Rejection, WorkspacePlan,
)
from pipeline.core.event_base import Event, Ns, Outcome  # noqa: F401
from pipeline.core.event_wire import (  # noqa: F401
    _BY_TAG, ENVELOPE, EVENT_TYPES, FLOAT_FIELDS, MAX_DEPTH, NONFINITE, TOO_DEEP, AnyEvent, _clean_str, _closed_spec,
    _contains_any, _decoder, _encoder, _fast_plan, _float_spec, _needs_wire, _restore, _wire, clean_str,
    decode_line, encode, event_name, restore_floats, to_wire,
)
from pipeline.core.events_observe import (  # noqa: F401
    EnvVarLookalike, Heartbeat, JitVariantLoaded, PhaseTime, SlowPhase, StartupSummary,
)
from pipeline.core.events_runner import (  # noqa: F401
    CommandFinished, CommandStarted, CudaGraphCaptured, CudaGraphMemory, DistributedInitialized, InstanceVerified,
    MemoryPoolSized,
    ModelLoaded, ModelStepVerified, RunnerReady, RunnerStarted, RunnerTransition,
)
from pipeline.core.events_setup import (  # noqa: F401
    BackendBuilt, BackendsAnnotated, BackendsResolved, BuildPlanned, DeviceInitialized, FeatureDowngraded,
    LazyMemInitialized, MemoryBalanced, RankRow, RankStalled, ReferenceFallback, ResolutionAgreed, ResourcesReleased,
    RunFailed, RunFinished, RunInterrupted, RunStarted, SettingResolved, StateTransition, StepSkipped,
)


def catalogue() -> list[tuple[str, str, list[str]]]:
    """(event name, level, fields beyond the common ones) for every record type — the README table."""
    common = set(Event.__struct_fields__)
    rows = []
    for cls in EVENT_TYPES:
        enc = dict(zip(cls.__struct_fields__, cls.__struct_encode_fields__))
        rows.append((event_name(cls), cls.level, [enc[f] for f in cls.__struct_fields__ if f not in common]))
    return rows


def catalogue_markdown() -> str:
    """The README's log-event table (between the ``events:begin``/``events:end`` markers)."""
    lines = ["| event | level | fields (besides schema_version, ts_ns, run_id, rank, launch_id, state, outcome) |",
             "|---|---|---|"]
    for name, level, fields in catalogue():
        lines.append(f"| `{name}` | {level} | {', '.join(f'`{f}`' for f in fields)} |")
    return "\n".join(lines)


def print_catalogue(stream: Any = None) -> int:
    """Write :func:`catalogue_markdown` to ``stream`` (stdout) for ``python -m pipeline.core.events``; returns the
    exit code, 0. A reader that leaves early (``| head -3``) ends it quietly, as it does the CLI's commands: the
    rest is dropped and stdout pointed at /dev/null, so the interpreter's last flush finds no closed pipe."""
    import os
    import sys

    out = sys.stdout if stream is None else stream
    try:
        out.write(catalogue_markdown() + "\n")
        out.flush()
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError):  # not a file descriptor (a test's stream): nothing will flush to a pipe
            pass
    return 0


if __name__ == "__main__":  # python -m pipeline.core.events  → prints the README table
    raise SystemExit(print_catalogue())
