"""Typed errors and :class:`ErrorInfo`, the one record each carries (re-exported by the contracts) (docs/internals.md).
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)

class Flag(msgspec.Struct, **_STRUCT):
    """One flag or field and the value it had, as shown in errors."""

    name: str
    value: Any = None


class ErrorInfo(msgspec.Struct, **_STRUCT):
    """The one error shape every command prints and every failure event carries. ``code``: stable snake_case; ``state``:
    the state raised in, or ``"args"``; ``flags``: flags/fields with values; ``json_path``: e.g.
    ``$.num_attention_heads`` or None; ``message``: one sentence; ``allowed``: values or backends that would work;
    ``remedy``: one line."""

    code: str
    state: str
    flags: list[Flag] = []
    json_path: str | None = None
    message: str
    allowed: list[str] = []
    remedy: str = ""


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2, the shell's convention


class AttnSetupError(Exception):
    """Base class: an error with a structured :class:`ErrorInfo` (``.info``)."""

    code = "error"
    exit_code = EXIT_FAILED

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        state: str = "args",
        flags: Iterable[tuple[str, Any]] | dict[str, Any] = (),
        json_path: str | None = None,
        allowed: Iterable[str] = (),
        remedy: str = "",
    ) -> None:
        super().__init__(message)
        items = flags.items() if isinstance(flags, dict) else flags
        self.info = ErrorInfo(
            code=code or self.code,
            state=state,
            flags=[Flag(name=printable(str(n)), value=_jsonable(v)) for n, v in items],
            json_path=None if json_path is None else printable(json_path),
            message=printable(message),
            allowed=[printable(str(a)) for a in allowed],
            remedy=printable(remedy),
        )

    def with_state(self, state: str) -> "AttnSetupError":
        """Return self with ``info.state`` set (the machine fills it in when it catches)."""
        import msgspec

        self.info = msgspec.structs.replace(self.info, state=state)
        return self

    def __str__(self) -> str:  # one readable line for tracebacks and the console
        i = self.info
        parts = [f"[{i.code}] {i.message}"]
        if i.flags:
            parts.append("flags: " + ", ".join(f"{f.name}={f.value!r}" for f in i.flags))
        if i.json_path:
            parts.append(f"at {i.json_path}")
        if i.allowed:
            parts.append("allowed: " + ", ".join(i.allowed))
        if i.remedy:
            parts.append("remedy: " + i.remedy)
        return " | ".join(parts)


class ConfigError(AttnSetupError):
    code = "config_invalid"
    exit_code = EXIT_REFUSED


class BackendUnknown(ConfigError):
    code = "backend_unknown"


class BackendUnavailable(ConfigError):
    code = "backend_unavailable"


class CapabilityMismatch(ConfigError):
    code = "capability_mismatch"


class ConflictingOptions(ConfigError):
    code = "conflicting_options"


class ModelConfigError(ConfigError):
    code = "model_config_invalid"


class RankDivergence(ConfigError):
    """The ranks of one launch disagree (pair, attention args or device); raised on every rank before allocation.
    ``info.flags``: one ``rank[i]`` entry per rank and ``diverging``; ``derived`` maps a field differing only because
    another does to that one (``{"cuda_graph_bs": "pool.max_reqs"}``)."""

    code = "rank_divergence"


class RankExchangeError(AttnSetupError):
    """A rank did not join the resolution exchange within ``timeout_s`` (crashed, hung, or not launched)."""

    code = "rank_exchange_failed"
    exit_code = EXIT_FAILED


class RankStalled(RankExchangeError):
    """A rank did not arrive at a wait within the timeout (:mod:`pipeline.setup.rank_watch`), raised on every waiting
    rank. ``info.flags``: ``stalled_rank``, ``last_state``, ``seconds_since_heartbeat``, ``doing``, ``stalled``,
    ``waiting_at``, ``timeout_s``."""

    code = "rank_stalled"


class MemoryImbalance(AttnSetupError):
    """Free device memory at device-init differs between ranks beyond the allowed fraction (sglang's TP check); raised
    on every rank with every rank's bytes."""

    code = "memory_imbalance"
    exit_code = EXIT_FAILED


class OrderingError(AttnSetupError):
    code = "out_of_order"
    exit_code = EXIT_FAILED


class BuildError(AttnSetupError):
    code = "build_failed"
    exit_code = EXIT_FAILED


class LayerMismatch(BuildError):
    """A backend was called with a layer other than the planned one (:meth:`pipeline.backends.base.PlannedLayers.check`,
    before any write): ``info.flags`` ``layer_id`` and ``layer.<field>``, ``info.allowed`` the built value."""

    code = "layer_mismatch"


class UsageError(AttnSetupError):
    code = "usage"
    exit_code = EXIT_USAGE


class InvalidValue(UsageError):
    """A flag's value outside its domain (:data:`pipeline.cli.flags.FLAG_DOMAINS`), exit 2, raised as flags are read;
    ``info.remedy`` a value that passes."""

    code = "out_of_domain"


class OutputWriteFailed(UsageError):
    """stdout or stderr could not be written (not a closed pipe): exit 2 unless the command failed anyway;
    ``info.flags``: each lost stream and its target."""

    code = "output_write_failed"


class BackendClosed(AttnSetupError):
    """A backend (or wrapper) was called after ``close()``; raised instead of reading freed buffers."""

    code = "backend_closed"
    exit_code = EXIT_FAILED


def printable(s: str) -> str:
    """``s`` as valid UTF-8 text: lone surrogates (from ``\\ud800`` escapes in JSON or undecodable
    bytes in argv / file names) become ``\\udXXX`` escapes, so an error about them can be printed
    and logged instead of failing to encode."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


# msgspec encodes ints in [-2**63, 2**64); a bigger one is shown as text so an ErrorInfo always encodes.
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)


def _jsonable(v: Any) -> Any:
    if isinstance(v, str):
        return printable(v)
    if isinstance(v, int) and not isinstance(v, bool) and not _INT_RANGE[0] <= v <= _INT_RANGE[1]:
        return f"<an integer of about {int(v.bit_length() * 0.30103) + 1} digits>"
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return printable(repr(v))


INTERRUPTED_REMEDY = "the process was stopped from outside (Ctrl-C, scheduler, timeout); rerun the start"


LOGGED_REMEDY = "This is a bug or an environment failure; the log holds the full event."
UNLOGGED_REMEDY = "This is a bug or an environment failure (no log holds it); report it with the command line"
OUT_OF_MEMORY_REMEDY = ("the process ran out of host memory: lower the size flags or free memory on this machine; "
                        "if the sizes are modest, report it as a bug with the command line")


def error_info_from(exc: BaseException, state: str, *, logged: bool = True) -> ErrorInfo:
    """The ErrorInfo of any exception: typed errors keep theirs, KeyboardInterrupt (SIGINT) is
    ``interrupted``, others get ``internal_error`` — whose remedy points at the log only when ``logged`` (the caller
    writes the event to one), and names running out of memory for a MemoryError."""
    if isinstance(exc, AttnSetupError):
        if exc.info.state == "args" and state != "args":
            exc.with_state(state)
        return exc.info
    if isinstance(exc, KeyboardInterrupt):
        return ErrorInfo(code="interrupted", state=state, message=f"interrupted (SIGINT) in state {state}",
                         remedy=INTERRUPTED_REMEDY)
    return ErrorInfo(code="internal_error", state=state, message=printable(f"{type(exc).__name__}: {exc}"),
                     remedy=OUT_OF_MEMORY_REMEDY if isinstance(exc, MemoryError) else
                     LOGGED_REMEDY if logged else UNLOGGED_REMEDY)
