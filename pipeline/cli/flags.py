"""The command line read: the ``attn-setup`` parser, every flag's domain, the paths it names, and the
``SetupRequest`` that run, plan and warmup build from their shared flags.

Details: docs/internals.md, ``pipeline.cli.flags``.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import msgspec

from pipeline.backends import packages, registry
from pipeline.core import settings
from pipeline.core.contracts import AttentionArgs, Flag, ModelSpec, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError, InvalidValue, ModelConfigError, UsageError
from pipeline.core.eventlog import secrets_from_env
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec
from pipeline.core.numbers import ascii_float, ascii_int
from pipeline.core.validation import (device_spelling, DeviceSpelling, Domain, KV_CACHE_DTYPES, MAX_BYTES,
    MAX_PAGE_SIZE, MAX_POOL_DIM, MAX_SPEC, MODEL_DTYPES, MOE_A2A_BACKENDS, SPECULATIVE_ALGORITHMS)
from pipeline.platforms.profiles import names as profile_names


SETUP = ("run", "plan", "warmup")  # the commands with the shared setup flags (pipeline.cli.flags.add_setup_flags)
LOG_READERS = ("inspect", "replay", "graph")


@dataclass(frozen=True)
class FlagDomain:
    """One flag's row: the flag as written, its ``dest`` in the namespace, the commands that have it, its
    :class:`Domain`, and what leaving it out does (``default``; empty = the flag is needed as given)."""

    flag: str
    dest: str
    commands: tuple[str, ...]
    domain: Domain
    default: str = ""
    distinct: bool = False  # a list flag whose values must differ
    hint: str = ""  # what to pass, where no one example is right everywhere (memory shares, backends)
    fix: Optional[Callable[[Any], str]] = None  # the remedy for a given value, where one follows from it


def _int(lo: int, hi: int, example: int, unit: str = "") -> Domain:
    return Domain("int", example, lo=lo, hi=hi, unit=unit)


def _text(example: str) -> Domain:
    return Domain("text", example)


# sglang's names attn-setup does not implement pass here: resolve refuses each by name (backend_unavailable, exit 3)
_BACKENDS = Domain("choice", registry.reference_name(), choices=tuple(registry.names()),
                   hidden=tuple(n for n in registry.known_names() if n not in registry.names()))
_PACKAGES = tuple(dict.fromkeys(n for d in packages.names()
                                for n in (d, packages.import_name(d), d.replace("-", "_"))))
_TOO_BIG = "a budget this device cannot hold is then refused naming the largest that fits"
_SERVES = "pass a backend that serves this device and model ('attn-setup backends' lists each one's devices)"


def _known_packages(value: Any) -> str:
    """``--installed``'s remedy: every package a plan reads (so no backend is refused for a missing one; a list
    cut to the names that are packages — ``''`` when none is — may leave a GPU profile no backend), or the
    default."""
    every = ",".join(packages.import_name(d) for d in packages.names())
    unknown = [p.strip() for p in str(value).split(",")
               if p.strip() and p.split("==")[0].strip().lower() not in _PACKAGES]
    what = ", ".join(repr(u) for u in unknown) or repr(str(value))
    return (f"{what} {'is not a package' if len(unknown) <= 1 else 'are not packages'} a plan reads; pass "
            f"--installed {every} to plan as if every one were installed, or drop --installed to read this "
            "machine's package metadata")


_BYTES = f"bytes, at most 2**{MAX_BYTES.bit_length() - 1}"

FLAG_DOMAINS: tuple[FlagDomain, ...] = (
    FlagDomain("--model", "model", SETUP, _text("examples/configs/llama-3.1-8b.json"), "the bundled Llama-3.1-8B"),
    FlagDomain("--draft-model", "draft_model", SETUP, _text("examples/configs/llama-3.1-8b.json"),
               "the draft worker serves --model"),
    FlagDomain("--device", "device", ("run", "warmup"), Domain("device", "cpu"), "auto"),
    FlagDomain("--max-reqs", "max_reqs", SETUP, _int(1, MAX_POOL_DIM, 8), "8"),
    FlagDomain("--max-context-len", "max_context_len", SETUP, _int(1, MAX_POOL_DIM, 1024), "1024"),
    FlagDomain("--num-token-slots", "num_token_slots", SETUP, _int(1, MAX_POOL_DIM, 1024),
               "1024 on CPU, 65536 on GPU, in whole pages"),
    FlagDomain("--rank", "rank", SETUP, _int(0, MAX_POOL_DIM - 1, 0), "0"),  # below the largest --world-size
    FlagDomain("--world-size", "world_size", SETUP, _int(1, MAX_POOL_DIM, 1), "--tp-size x --pp-size"),
    *(FlagDomain(f"--{d.replace('_', '-')}", d, SETUP, _BACKENDS, "auto-select" if d == "attention_backend" else
                 "--attention-backend's", hint=_SERVES) for d in ("attention_backend", "prefill_attention_backend",
                                                    "decode_attention_backend", "speculative_draft_attention_backend")),
    FlagDomain("--speculative-algorithm", "speculative_algorithm", SETUP,
               Domain("choice", "EAGLE", choices=SPECULATIVE_ALGORITHMS, any_case=True), "none"),
    FlagDomain("--speculative-num-steps", "speculative_num_steps", SETUP, _int(1, MAX_SPEC, 3),
               "sglang's default for the target model (Llama: 5, else 3)"),
    FlagDomain("--speculative-eagle-topk", "speculative_eagle_topk", SETUP, _int(1, MAX_SPEC, 1),
               "sglang's default for the target model (Llama: 4, else 1)"),
    FlagDomain("--speculative-num-draft-tokens", "speculative_num_draft_tokens", SETUP, _int(1, MAX_SPEC, 4),
               "--speculative-num-steps + 1 with top-k 1; sglang's default for the target model (Llama: 8, else 4)"),
    FlagDomain("--attn-dp-size", "attn_dp_size", SETUP, _int(1, MAX_POOL_DIM, 1), "1"),
    FlagDomain("--tp-size", "tp_size", SETUP, _int(1, MAX_POOL_DIM, 2), "--world-size / --pp-size"),
    FlagDomain("--pp-size", "pp_size", SETUP, _int(1, MAX_POOL_DIM, 2), "1"),
    FlagDomain("--moe-a2a-backend", "moe_a2a_backend", SETUP, Domain("choice", "none", choices=MOE_A2A_BACKENDS),
               "none"),
    FlagDomain("--sm-group-num", "sm_group_num", SETUP, _int(1, MAX_POOL_DIM, 3), "3"),
    FlagDomain("--kv-cache-dtype", "kv_cache_dtype", SETUP, Domain("choice", "auto", choices=KV_CACHE_DTYPES), "auto"),
    FlagDomain("--page-size", "page_size", SETUP, _int(1, MAX_PAGE_SIZE, 1), "1"),
    FlagDomain("--cuda-graph-bs", "cuda_graph_bs", SETUP, _int(1, MAX_POOL_DIM, 1),
               "1, 2, 4, 8, 16, 24, … up to --cuda-graph-max-bs", distinct=True),
    FlagDomain("--cuda-graph-max-bs", "cuda_graph_max_bs", SETUP, _int(1, MAX_POOL_DIM, 8),
               "max(--cuda-graph-bs), else min(--max-reqs, sglang's default for the device's memory: 256 on an H200)"),
    FlagDomain("--zbal-local-mem-size", "zbal_local_mem_size", SETUP, _int(0, MAX_BYTES, 0, _BYTES),
               "SGLANG_ZBAL_LOCAL_MEM_SIZE, else 0"),
    FlagDomain("--flashinfer-workspace-size", "flashinfer_workspace_size", SETUP,
               _int(1, MAX_BYTES, 384 << 20, _BYTES), "SGLANG_FLASHINFER_WORKSPACE_SIZE, else 384 MiB"),
    FlagDomain("--dtype", "dtype", SETUP, Domain("choice", "auto", choices=MODEL_DTYPES), "auto"),
    FlagDomain("--num-layers", "num_layers", ("run", "plan"), _int(1, MAX_POOL_DIM, 2),
               "2, or as many as it takes to include every attention layer kind"),
    FlagDomain("--device-profile", "device_profile", ("plan",),
               Domain("choice", "cpu", choices=tuple(profile_names()), any_case=True), "auto"),
    FlagDomain("--installed", "installed", ("plan",), Domain("packages", "torch", choices=_PACKAGES),
               "read from package metadata", fix=_known_packages),
    FlagDomain("--log-file", "log_file", ("run",), _text("./attn-setup-logs/{run_id}.rank{rank}.jsonl"),
               "./attn-setup-logs/{run_id}.rank{rank}.jsonl"),
    FlagDomain("--decode-steps", "decode_steps", ("run",), _int(0, MAX_POOL_DIM, 3), "3"),
    FlagDomain("--dist-timeout", "dist_timeout", ("run",), Domain("float", 60, lo=0, hi=86400, lo_open=True,
                                                                  unit="seconds"), "$ATTN_SETUP_DIST_TIMEOUT, else 60"),
    FlagDomain("--max-memory-imbalance", "max_memory_imbalance", ("run",), Domain("float", 0.1, lo=0, hi=1),
               "$ATTN_SETUP_MAX_MEMORY_IMBALANCE, else 0.1"),
    FlagDomain("--mem-fraction", "mem_fraction", ("run", "plan"), Domain("float", 0.5, lo=0, hi=1, lo_open=True),
               "unset: the pool has --num-token-slots slots",
               hint=f"pass a finite number in (0, 1]: {_TOO_BIG}"),
    FlagDomain("--mem-bytes", "mem_bytes", ("run", "plan"), _int(1, MAX_BYTES, 1 << 30, _BYTES),
               "unset: the pool has --num-token-slots slots",
               hint=f"pass an integer in [1, {MAX_BYTES}]: {_TOO_BIG}"),
    FlagDomain("--metrics-file", "metrics_file", ("run",), _text("attn-setup-metrics.txt"), "none"),
    FlagDomain("--slow-phase-s", "slow_phase_s", ("run",), Domain("float", 30, lo=0, lo_open=True, unit="seconds"),
               "$ATTN_SETUP_SLOW_PHASE_S, else off"),
    FlagDomain("--jobs", "jobs", ("warmup",), _int(1, 1024, 4), "4"),
    FlagDomain("LOG", "logs", LOG_READERS, _text("attn-setup-logs/RUN.rank0.jsonl")),
    FlagDomain("--perfetto", "perfetto", ("inspect",), _text("timeline.json"), "none"),
    FlagDomain("--output", "output", ("graph",), _text("machine.mmd"), "none (then --json is needed)"),
    FlagDomain("--rank", "rank", ("graph",), _int(0, MAX_POOL_DIM, 0), "the first failed run, else the first"),
    FlagDomain("--machine", "machine", ("graph",), Domain("choice", "setup", choices=("setup", "runner")), "setup"),
)


def domains_of(command: str) -> list[FlagDomain]:
    """The rows of ``command`` (``run``, ``plan`` …), in table order."""
    return [fd for fd in FLAG_DOMAINS if command in fd.commands]


def shown(value: Any) -> Any:
    """The value as the error records it: NaN and infinities as text (JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def remedy(fd: FlagDomain, value: Any = None) -> str:
    """A change that passes :func:`check_flags`: drop the flag (its default) or pass the domain's example (or what
    ``fd.hint`` says; ``fd.fix`` words the whole remedy from the value given)."""
    if fd.fix is not None:
        return fd.fix(value)
    example = fd.domain.example
    take = f"{fd.flag} {example}" if fd.flag != "LOG" else f"a trace path such as {example}"
    if not fd.default:
        return f"pass {take} ({fd.domain.allowed()})"
    return f"drop {fd.flag} (default: {fd.default}), or " + (fd.hint or f"pass {fd.domain.allowed()}, e.g. {take}")


def refusal(fd: FlagDomain, value: Any, why: str = "", fix: str = "", allowed: str = "") -> InvalidValue:
    """The InvalidValue of ``fd`` given ``value``: the flag, the value, the domain and the remedy; an unknown choice
    also gets "did you mean" naming the nearest one (:meth:`Domain.nearest`)."""
    allowed = allowed or fd.domain.allowed()
    near = fd.domain.nearest(value)
    why = (why or f"{fd.flag} takes {allowed}") + (f"; did you mean {near!r}?" if near else "")
    text = repr(value) if isinstance(value, str) else str(shown(value))
    return InvalidValue(f"{fd.flag} {text} is not allowed: {why}",
                        flags=[(fd.flag, shown(value))], allowed=[allowed], remedy=fix or remedy(fd, value))


def _rank_in_world(ns: argparse.Namespace, fd: FlagDomain) -> Optional[InvalidValue]:
    """``--rank`` below ``--world-size`` (run under torchrun takes both from RANK / WORLD_SIZE instead)."""
    if fd.dest != "rank" or ns.command not in SETUP or (ns.command == "run" and "WORLD_SIZE" in os.environ):
        return None
    rank, world = ns.rank, ns.world_size
    if rank < world:
        return None
    ranks = "--rank 0" if world == 1 else f"--rank between 0 and {world - 1}"
    return refusal(fd, rank, f"--rank counts from 0 below --world-size {world}", allowed=f"0..{world - 1}",
                   fix=f"pass {ranks}, or --world-size {rank + 1} or more")


def _graph_rank_needs_log(ns: argparse.Namespace, fd: FlagDomain) -> Optional[InvalidValue]:
    """``graph --rank N`` picks the run of the LOGs to highlight: without a LOG it would pick nothing."""
    if fd.dest != "rank" or ns.command != "graph" or ns.logs:
        return None
    return refusal(fd, ns.rank, "--rank picks which rank's run of the LOGs to highlight, and no LOG was given",
                   allowed="--rank N with one or more LOGs",
                   fix="drop --rank, or give the rank's trace: attn-setup graph LOG … --rank N -o FILE")


def _env_value(raw: str) -> Any:
    """An environment variable's text as the flag's value: an integer when it is written as one, else the text."""
    text = raw.strip()
    return int(text) if text.lstrip("+-").isascii() and text.lstrip("+-").isdigit() and len(text) <= 31 else raw


def check_env_sizes(ns: argparse.Namespace, env: Any = os.environ) -> None:
    """The SGLANG_* size variables (:data:`pipeline.core.settings.ENV_VARS`) a setup command reads, through the domain
    of the flag they stand for (README: "a value from the environment passes the same check as the flag"): a value
    outside it is the flag's refusal, exit 2 ``out_of_domain``, naming the variable. Empty or unset: not checked."""
    from pipeline.core.settings import ENV_VARS

    if ns.command not in SETUP:
        return
    for dest, name in ENV_VARS.items():
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        fd = next(d for d in FLAG_DOMAINS if d.dest == dest)
        value = _env_value(raw)
        if not fd.domain.admits(value):
            allowed, default = fd.domain.allowed(), fd.default.removeprefix(f"{name}, else ")
            raise InvalidValue(f"{name}={value!r} is not allowed: a value from the environment passes the check of "
                               f"{fd.flag}, which takes {allowed}", flags=[(name, value)], allowed=[allowed],
                               remedy=f"unset {name} (then {fd.flag}'s default applies: {default}), or set it to "
                                      f"{allowed}, e.g. {name}={fd.domain.example}")


def _one_pool_size(ns: argparse.Namespace, fd: FlagDomain) -> Optional[InvalidValue]:
    """``--num-token-slots`` with ``--mem-bytes`` or ``--mem-fraction``: one sizes the pool; the other would be
    dropped silently."""
    other = next((f for f in ("mem_bytes", "mem_fraction") if getattr(ns, f, None) is not None), None)
    if fd.dest != "num_token_slots" or other is None:
        return None
    flag = "--" + other.replace("_", "-")
    return refusal(fd, ns.num_token_slots, f"--num-token-slots and {flag} both size the KV pool",
                   allowed=f"--num-token-slots or {flag}, not both",
                   fix=f"drop --num-token-slots (the pool is then sized from {flag}) or drop {flag}")


CROSS_CHECKS: tuple[Callable[[argparse.Namespace, FlagDomain], Optional[InvalidValue]], ...] = (
    _rank_in_world, _graph_rank_needs_log, _one_pool_size)


def check_flags(ns: argparse.Namespace) -> None:
    """Raise the first :class:`InvalidValue` among ``ns``'s flags (a flag not given is not checked): each flag's own
    domain first, then the checks across flags (:data:`CROSS_CHECKS`), then the size variables that stand for
    flags (:func:`check_env_sizes`)."""
    given = [fd for fd in domains_of(ns.command) if getattr(ns, fd.dest, None) is not None]
    for fd in given:
        value = getattr(ns, fd.dest)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not fd.domain.admits(v):
                raise refusal(fd, v)
        if fd.distinct and len(set(values)) != len(values):
            raise refusal(fd, value, f"{fd.flag} lists a value twice", allowed="distinct values",
                          fix=f"list each value once: {fd.flag} {' '.join(map(str, dict.fromkeys(values)))}")
    if ns.command == "plan" and "WORLD_SIZE" in os.environ:  # under torchrun plan takes RANK/WORLD_SIZE as run does
        from pipeline.setup.distributed import check_launch_env

        rank, world, _ = check_launch_env()
        if world > 1:  # the flags when given (--rank 0 is the default, so RANK wins over it)
            ns.world_size, ns.rank = world if ns.world_size is None else ns.world_size, ns.rank or rank
    if ns.command in SETUP and getattr(ns, "world_size", 1) is None:  # unset: the ranks tp x pp asks for
        ns.world_size = (getattr(ns, "tp_size", None) or 1) * getattr(ns, "pp_size", 1)
    for fd in given:
        for check in CROSS_CHECKS:
            err = check(ns, fd)
            if err is not None:
                raise err
    check_env_sizes(ns)


def parser_refusal(command: Optional[str], flag: str, value: Any, message: str) -> Optional[InvalidValue]:
    """argparse's conversion or choice error (``invalid int value: 'abc'``) for a flag of the table, as the
    table's InvalidValue; None for a flag the table does not hold."""
    fd = next((f for f in domains_of(command or "") if f.flag == flag), None)
    if fd is None:
        return None
    return refusal(fd, value, f"{fd.flag} takes {fd.domain.allowed()} ({message})")


_MARK = "unrecognized arguments:"


def _value_after(argv: Sequence[str], opt: str, nth: int) -> str:
    """The word after the ``nth`` (0-based) ``opt`` in ``argv`` when it is not a flag, else ``""``."""
    spots = [i for i, a in enumerate(argv) if a == opt]
    if nth >= len(spots) or spots[nth] + 1 >= len(argv):
        return ""
    nxt = argv[spots[nth] + 1]
    return "" if nxt.startswith("-") else nxt


def unknown_flags(message: str, argv: Sequence[str], known: set[str], by_command: Mapping[str, set[str]],
                  command: Any, prog: str) -> tuple[str, list[tuple[str, Any]], list[str]]:
    """``(message, flags, hints)`` for argparse's ``unrecognized arguments`` ``message``; ``flags`` empty (and the
    message as given) when it is another error. ``known``: the long options of the subcommand typed (``command``,
    None at the top level); ``by_command``: every subcommand's long options."""
    if _MARK not in message:
        return message, [], []
    toks = message.split(_MARK, 1)[1].split()
    words, flags, hints, seen = [], [], [], {}  # type: ignore[var-annotated]
    for i, tok in enumerate(toks):
        words.append(tok)
        if not tok.startswith("--"):
            continue
        opt, eq, val = tok.partition("=")
        nth = seen[opt] = seen.get(opt, -1) + 1
        if not eq:
            val = _value_after(argv, opt, nth)
            if val and (i + 1 >= len(toks) or toks[i + 1] != val):  # argparse placed it elsewhere (a positional)
                words.append(val)
        prefix = [o for o in known if o.startswith(opt) and o != opt]
        near = prefix or difflib.get_close_matches(opt, [o for o in known if o != opt], n=2, cutoff=0.75)
        flags.append((opt, val))
        owners = [c for c, opts in by_command.items() if opt in opts and c != command]
        if owners:
            hints.append(f"{opt} is a flag of {' and '.join(f'attn-setup {c}' for c in owners)}"
                         + (f", not of {prog}" if command else ""))
        if near:
            hints.append(f"{opt}: did you mean {' or '.join(near[:2])}?"
                         + (" (abbreviations are not accepted)" if prefix else ""))
    return f"{message.split(_MARK, 1)[0]}{_MARK} {' '.join(words)}", flags, hints


# (flag, namespace attribute, output?) per command; a list attribute (the LOGs) gives one path per element.
_PATH_FLAGS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "run": (("--log-file", "log_file", True), ("--metrics-file", "metrics_file", True),
            ("--model", "model", False), ("--draft-model", "draft_model", False)),
    "plan": (("--model", "model", False), ("--draft-model", "draft_model", False)),
    "warmup": (("--model", "model", False), ("--draft-model", "draft_model", False)),
    "inspect": (("--perfetto", "perfetto", True), ("LOG", "logs", False)),
    "replay": (("LOG", "logs", False),),
    "graph": (("--output", "output", True), ("LOG", "logs", False)),
}


def shown_path(path: str) -> str:
    """``path`` as an ErrorInfo can carry it: undecodable bytes (``surrogateescape``'s lone surrogates) written as
    ``\\xNN``, any other lone surrogate as ``\\udNNN`` and a NUL as ``\\x00``."""
    out = []
    for ch in path:
        o = ord(ch)
        out.append(f"\\x{o - 0xDC00:02x}" if 0xDC80 <= o <= 0xDCFF else f"\\u{o:04x}" if 0xD800 <= o <= 0xDFFF
                   else "\\x00" if o == 0 else ch)
    return "".join(out)


def named_paths(ns: argparse.Namespace) -> Iterator[tuple[str, str, bool]]:
    """``(flag, path, is_output)`` for every path flag of ``ns.command`` that was given (strings only)."""
    for flag, dest, output in _PATH_FLAGS.get(getattr(ns, "command", ""), ()):
        value = getattr(ns, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v:
                yield flag, v, output


def _check_utf8(flag: str, path: str) -> None:
    """A path the OS can take: valid UTF-8 (``path_not_utf8``) and no NUL (``path_has_nul``; only an in-process
    ``main(argv)`` can pass one), each a UsageError naming the flag."""
    if "\x00" in path:
        raise UsageError(f"{flag} '{shown_path(path)}' holds a NUL character, which no file name can",
                         code="path_has_nul", flags=[(flag, shown_path(path))], allowed=["a path without NUL"],
                         remedy=f"pass {flag} a path without the NUL (\\x00) character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = shown_path(path)
        raise UsageError(f"{flag} '{shown}' is not valid UTF-8 (its name holds undecodable bytes)",
                         code="path_not_utf8", flags=[(flag, shown)], allowed=["a path that is valid UTF-8"],
                         remedy=f"rename the file or pass another path for {flag} whose name is valid UTF-8") from None


def _concrete(flag: str, path: str, ns: argparse.Namespace) -> Optional[str]:
    """The path a flag will really touch: ``--log-file`` with ``{rank}`` filled in, and ``{run_id}`` with the shared
    run id when one is set (``ATTN_SETUP_RUN_ID`` / ``TORCHELASTIC_RUN_ID``:, a ``{run_id}`` path then named the
    model config or the metrics file unchecked); None with ``{run_id}`` and no shared id (a fresh name, which nothing
    given can be, checked again once known: :func:`check_log_path`)."""
    from pipeline.core.eventlog import shared_run_id

    if flag != "--log-file":
        return path
    if "{run_id}" in path:
        run_id = shared_run_id()
        if run_id is None:
            return None
        path = path.replace("{run_id}", run_id)
    rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
    return path.replace("{rank}", str(rank if rank is not None else getattr(ns, "rank", 0)))


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name one file: :func:`os.path.samefile` when both exist, else equal resolved paths."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _check_conflicts(ns: argparse.Namespace, log_file: Optional[str] = None) -> None:
    paths = [(f, p, out) for f, v, out in named_paths(ns)
             if (p := log_file if log_file is not None and f == "--log-file" else _concrete(f, v, ns)) is not None]
    for i, (fa, pa, out_a) in enumerate(paths):
        for fb, pb, out_b in paths[i + 1:]:
            if not (out_a or out_b) or not same_file(pa, pb):
                continue
            out, other = (fa, fb) if out_a else (fb, fa)
            what = "the two outputs would overwrite each other" if out_a and out_b else \
                f"{out} would overwrite the input {other} reads"
            raise UsageError(f"{fa} and {fb} name the same file {pa!r}: {what}",
                             code="path_conflict", flags=[(fa, pa), (fb, pb)],
                             allowed=["an output path that no other flag names"],
                             remedy=f"pass a different path to {fb if out_b else fa}")


def check_metrics_file(path: str) -> None:
    """``--metrics-file`` can be written where it is written (a temporary file beside it, then renamed): that file
    is created and removed now. Raises UsageError ``metrics_file_unwritable`` naming the flag, or
    ``output_is_symlink`` for a symbolic link (the rename would replace it:
    :func:`pipeline.core.files.refuse_symlink`)."""
    from pipeline.core.files import check_output, refuse_symlink

    refuse_symlink(path, flag="--metrics-file", what="the metrics file")
    check_output(path, flag="--metrics-file", what="the metrics file")
    probe = f"{path}.tmp{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)
        return
    except FileExistsError:
        return  # a leftover of this pid: the folder takes files
    except OSError as e:
        why = e.strerror or str(e)
    raise UsageError(f"cannot write the metrics file {path!r}: the file it is written through, {probe!r}, cannot "
                     f"be created ({why})", code="metrics_file_unwritable", flags=[("--metrics-file", path)],
                     allowed=["a writable regular file (created if absent) in a writable folder"],
                     remedy="pass a writable path for --metrics-file, or drop it")


def check_log_path(ns: argparse.Namespace, log_file: str) -> None:
    """``path_conflict`` again with ``run``'s own ``--log-file`` path (``log_file``: placeholders filled with the
    run id and rank the run got), before the log opens: a run id known only then (a fresh one, or the rank group's)
    can make it name an input or the metrics file. Raises what :func:`check_paths` raises for a conflict."""
    _check_conflicts(ns, log_file)


def check_paths(ns: argparse.Namespace) -> None:
    """Every path rule of this module, in order: UTF-8, conflicts, ``--metrics-file`` writable."""
    for flag, path, _ in named_paths(ns):
        _check_utf8(flag, path)
    _check_conflicts(ns)
    metrics = getattr(ns, "metrics_file", None)
    if getattr(ns, "command", None) == "run" and isinstance(metrics, str) and metrics:
        check_metrics_file(metrics)


def check_log_paths(paths: Iterable[str | os.PathLike]) -> None:
    """Raise :class:`UsageError` (exit 2, naming ``LOG``) for the first path that cannot be read.

    ``trace_unreadable`` for a missing path or one ``stat``/``access`` refuses (message: the OS
    reason, e.g. "No such file or directory"); ``not_a_regular_file`` for a FIFO, device or
    directory. Readable regular files pass; their content is the readers' business (bad lines are
    counted and skipped).
    """
    from pipeline.core.files import _refuse_irregular

    for path in paths:
        p = os.fspath(path)
        try:
            mode = os.stat(p).st_mode
        except OSError as e:
            raise UsageError(f"cannot read the trace {p!r}: {e.strerror or e}", code="trace_unreadable",
                             flags=[("LOG", p)], allowed=["an existing, readable regular file"],
                             remedy="check the path (every LOG named must exist; 'attn-setup run' prints the log "
                                    "path it wrote)") from None
        _refuse_irregular(mode, p, flag="LOG", what="the trace")
        if not os.access(p, os.R_OK):
            raise UsageError(f"cannot read the trace {p!r}: permission denied", code="trace_unreadable",
                             flags=[("LOG", p)], allowed=["a readable regular file"],
                             remedy=f"make {p!r} readable (chmod) or pass a copy you can read")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help unless the help already states it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default in (None, argparse.SUPPRESS)
                or isinstance(default, bool)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (exit 2, one ErrorInfo) instead of printing and exiting.

    Abbreviated long options are off (``allow_abbrev=False``): ``--device`` must never be taken
    for ``--device-profile``, nor ``--js`` for ``--json``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    last_argv: list[str] = []  # the command line the top-level parse_args got (subparsers report its errors)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        import sys

        _Parser.last_argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        """Raise the usage error: named for the subcommand the user typed (``attn-setup plan: …``), each unknown
        flag with the value that followed it, a "did you mean" over this subcommand's flags, the other
        subcommands that have the flag, and ``attn-setup <subcommand> --help``."""
        argv = list(getattr(self, "argv", []))
        command = next((a for a in argv if a in command_names()), None) if self.prog == "attn-setup" else None
        prog = f"{self.prog} {command}" if command else self.prog
        message, flags, hints = unknown_flags(message, argv, set(self._all_options(argv)),
                                              self._options_by_command(), command, prog)
        allowed: list[str] = []
        if not flags:
            flags, allowed, hint = self._argument_error(message, argv or list(getattr(_Parser, "last_argv", [])))
            hints += [hint] if hint else []
        remedy = "; ".join(hints + [f"see '{prog} --help'"])
        refused = parser_refusal(command or self.prog.split()[-1], flags[0][0], flags[0][1], message) \
            if re.match(r"argument \S+: invalid (\w+ value|choice)", message) else None
        if refused is not None:  # a value of the wrong type or an unknown choice: the flag's domain (exit 2)
            raise refused
        raise UsageError(f"{prog}: {message}", code="usage", flags=flags, allowed=allowed, remedy=remedy)

    @staticmethod
    def _argument_error(message: str, argv: list[str]) -> tuple[list[tuple[str, Any]], list[str], str]:
        """The flag, its value, what it allows and a hint, from argparse's own ``argument X: …`` and
        ``the following arguments are required: …`` messages (argparse words them; the ErrorInfo must
        name the flag in ``flags`` too, not only in the text)."""
        import re

        m = re.match(r"argument (\S+): (.*)", message, re.S)
        if m is None:
            req = re.match(r"the following arguments are required: (.*)", message)
            names = [n.strip() for n in req.group(1).split(",")] if req else []
            return ([(n.split("/")[-1], "") for n in names],
                    [f"{n.split('/')[-1]} given" for n in names], "")
        flag, why = m.group(1).split("/")[-1], m.group(2)
        spelled = [o for o in m.group(1).split("/")]
        value: Any = ""
        for i, tok in enumerate(argv):
            name, eq, rest = tok.partition("=")
            if name in spelled:
                value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        got = re.search(r"invalid (\w+) value: '(.*)'$", why, re.S)
        allowed, hint = [], ""
        if got is not None:
            value = got.group(2)
            allowed = [{"int": "an integer (decimal digits, e.g. 8)", "float": "a number (e.g. 0.5)"}.get(
                got.group(1), f"a {got.group(1)} value")]
            hint = f"pass {flag} {allowed[0].split(' (')[0].replace('an integer', 'a whole number')}"
        elif why.startswith("invalid choice"):
            from pipeline.core.validation import nearest_name

            allowed = re.findall(r"'([^']*)'", why.split("choose from", 1)[-1])
            given = re.match(r"invalid choice: '(.*)' \(choose from", why, re.S)
            value = given.group(1) if given else value  # a positional (the subcommand) is not found in argv by name
            near = nearest_name(value, allowed) if given else None
            hint = (f"did you mean {near!r}? " if near else "") + f"pass {flag} with one of: {', '.join(allowed)}"
        elif why.startswith("expected"):
            allowed = ["a value after the flag"]
            hint = (f"a value that starts with '-' must be attached: {flag}=VALUE" if str(value).startswith("-") else f"give {flag} its value")
        elif why.startswith("ignored explicit argument"):  # --json=1: a switch takes no value
            allowed, hint = [f"{flag} alone (a switch takes no value)"], f"pass {flag} without ={value}"
        elif "not allowed with argument" in why:
            other = why.split("not allowed with argument", 1)[1].strip().split("/")[-1]
            allowed = [f"{flag} or {other}, not both"]
            hint = f"drop {flag} or {other}"
        return [(flag, value)], allowed, hint

    def _options_by_command(self) -> dict[str, set[str]]:
        """``{subcommand: its long options}`` (empty for a subcommand's own parser)."""
        out: dict[str, set[str]] = {}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out[name] = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
        return out

    def _all_options(self, argv: Sequence[str] = ()) -> set[str]:
        """Long options of this parser and of the subcommand named in ``argv`` (of all, if none is)."""
        out: set[str] = set()
        for action in self._actions:
            out.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                chosen = [action.choices[a] for a in argv if a in action.choices][:1] or action.choices.values()
                for sub in chosen:
                    out |= sub._all_options() if isinstance(sub, _Parser) else set()
        return out


def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from the ``Fields`` section of a contract's docstring (``name: text`` lines, as
    :class:`~pipeline.core.contracts.AttentionArgs` writes them); a line indented deeper than the field's continues
    its text (a doc cut at its first line ended ``--help`` mid-sentence)."""
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Fields") + 2
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    last, indent = None, 0
    for line in lines[start:]:
        name, sep, text = line.strip().partition(": ")
        depth = len(line) - len(line.lstrip())
        if sep and name.isidentifier() and (last is None or depth <= indent):
            out[name], last, indent = text.strip(), name, depth
        elif last is not None and line.strip() and depth > indent:
            out[last] += " " + line.strip()
        else:
            last = None
    return out


def attention_choices(name: str) -> Optional[list[str]]:
    """The values a field accepts, where it is a closed set (backend names, dtypes, algorithms)."""
    from pipeline.core import validation

    if name.endswith("attention_backend"):
        from pipeline.backends import registry

        return registry.names()
    return {"kv_cache_dtype": list(validation.KV_CACHE_DTYPES), "dtype": list(validation.MODEL_DTYPES),
            "speculative_algorithm": list(validation.SPECULATIVE_ALGORITHMS),
            "moe_a2a_backend": list(validation.MOE_A2A_BACKENDS)}.get(name)


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def attention_flag_help(name: str, docs: dict[str, str]) -> str:
    """``--help`` text of one AttentionArgs flag: its field doc, default and choices."""
    default = next(f.default for f in msgspec.structs.fields(AttentionArgs) if f.name == name)
    text = f"{docs.get(name, name.replace('_', ' '))} (default: {_default_text(default)}"
    choices = attention_choices(name)
    if choices:
        text += f"; choices: {', '.join(choices)}"
    return (text + ")").replace("%", "%%")


def _flag_type(tp: Any) -> tuple[str, Any]:
    """('bool'|'list'|'scalar', element type) for an AttentionArgs annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = args[0]
    if base is bool:
        return "bool", bool
    if typing.get_origin(base) is list:
        return "list", typing.get_args(base)[0]
    return "scalar", base


def _ascii(t: Any) -> Any:
    """The parser of a flag of type ``t``: ASCII-only for int and float (:mod:`pipeline.core.numbers`)."""
    return {int: ascii_int, float: ascii_float}.get(t, t)


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    """One kebab-case flag per AttentionArgs field, generated from the Struct so none is forgotten."""
    g = p.add_argument_group("attention arguments (sglang's names)")
    hints = typing.get_type_hints(AttentionArgs)
    docs = field_docs(AttentionArgs)
    for name in AttentionArgs.__struct_fields__:
        kind, elem = _flag_type(hints[name])
        flag = "--" + name.replace("_", "-")
        text = attention_flag_help(name, docs)
        if kind == "bool":
            g.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=text)
        elif kind == "list":
            g.add_argument(flag, dest=name, nargs="+", type=_ascii(elem), default=argparse.SUPPRESS, metavar="N",
                           help=text)
        else:
            g.add_argument(flag, dest=name, type=_ascii(elem), default=argparse.SUPPRESS,
                           metavar=name.split("_")[-1].upper(), help=text)


def attention_args_from(ns: argparse.Namespace) -> AttentionArgs:
    """Build AttentionArgs from only the flags the user gave (Struct defaults for the rest)."""
    given = {f: getattr(ns, f) for f in AttentionArgs.__struct_fields__ if hasattr(ns, f)}
    return msgspec.convert(given, AttentionArgs)


def add_setup_flags(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    """Flags shared by run/plan: model, draft worker, pool sizes, log file, --json."""
    p.add_argument("--model", metavar="CONFIG_JSON", default=None,
                   help="Hugging Face config.json (default: the bundled Llama-3.1-8B)")
    p.add_argument("--draft-worker", action="store_true", help="initialize a speculative-decoding draft worker")
    p.add_argument("--draft-model", metavar="CONFIG_JSON", default=None,
                   help="the draft model's config.json (default: the draft worker serves --model)")
    if device:
        p.add_argument("--device", default="auto",
                       help="auto (a GPU when torch sees one, else cpu) | cpu | cuda[:N] | musa|npu|xpu[:N] (default: auto)")
    p.add_argument("--max-reqs", type=ascii_int, default=None, help="rows of req_to_token (default 8)")
    p.add_argument("--max-context-len", type=ascii_int, default=None, help="columns of req_to_token (default 1024)")
    p.add_argument("--num-token-slots", type=ascii_int, default=None,
                   help="KV slots per layer (default 1024 on CPU, 65536 on GPU)")
    p.add_argument("--rank", type=ascii_int, default=0, help="this process's rank (default 0; RANK under torchrun)")
    p.add_argument("--world-size", type=ascii_int, default=None,
                   help="number of ranks (default: --tp-size x --pp-size, else 1; WORLD_SIZE under torchrun)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (errors too)")
    add_attention_flags(p)


# Subcommand modules: each defines ``add_parser(subparsers)`` and ``cmd(ns) -> int`` (exit code). A new
# subcommand is one module and one line here. They are named, not imported here, as the backend registry names
# its factories: each command imports this module for the shared flags, so the parser loads them by name.
COMMANDS: list[str] = [
    "pipeline.cli.run",
    "pipeline.cli.plan",
    "pipeline.cli.warmup",
    "pipeline.cli.inspect", "pipeline.cli.replay", "pipeline.cli.graph",
    "pipeline.cli.backends",
]


def command_names() -> list[str]:
    """The subcommand names (``run``, ``plan`` …), from :data:`COMMANDS` without importing them."""
    return [m.rsplit(".", 1)[1] for m in COMMANDS]


def _modules() -> list[Any]:
    import importlib

    return [importlib.import_module(m) for m in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    from pipeline import __version__

    p = _Parser(prog="attn-setup", description="Initialize an inference engine's attention backends as an observable "
                "state machine: run, plan, warmup, inspect, replay, graph, backends.")
    p.add_argument("--version", action="version", version=f"attn-setup {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _modules():
        cmd = mod.add_parser(sub)
        # every subcommand takes -v (after its name too), so that pipeline.cli.check_verbose refuses it in one
        # place, with its reason, for each command that logs no event — never argparse's "unrecognized arguments"
        cmd.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
        cmd.set_defaults(_cmd=mod.cmd)
    return p


_VERBOSE_HELP = ("run: print each event as a short line on stderr (the log file keeps the JSON); the other commands "
                 "log no event and refuse it (exit 2), before or after the subcommand")


def default_model_path() -> str:
    """The bundled Llama-3.1-8B config: package data, a byte-identical copy of examples/configs/llama-3.1-8b.json."""
    return str(DEFAULT_MODEL_CONFIG)


def _load_spec(path: str, flag: str) -> ModelSpec:
    """load_model_spec, with its errors (a file unreadable, not a regular file or too large; a config refused)
    naming ``flag`` and the file first, in place of the loader's own ``path`` entry."""
    try:
        return load_model_spec(path)
    except (UsageError, ModelConfigError) as e:
        rest = [f for f in e.info.flags if not (f.name == "path" and f.value == str(path))]  # the same file, as a flag
        e.info = msgspec.structs.replace(e.info, flags=[Flag(name=flag, value=path), *rest],
                                         remedy=e.info.remedy.replace(" as path", f" as {flag}"))
        raise


DRAFT_ONLY = ("draft_model", "speculative_draft_attention_backend")  # flags a target worker would ignore


def check_draft_only(ns: argparse.Namespace) -> None:
    """Refuse the draft worker's flags (``--draft-model``, ``--speculative-draft-attention-backend``) without
    ``--draft-worker``: a target worker ignores both (sglang reads the draft backend only in its draft worker), so
    accepting them would drop an explicit choice silently. Raises UsageError (exit 2) naming each flag given."""
    given = [(f"--{d.replace('_', '-')}", getattr(ns, d, None)) for d in DRAFT_ONLY if getattr(ns, d, None)]
    if given and not ns.draft_worker:
        names = " and ".join(f for f, _ in given)
        one = len(given) == 1
        raise UsageError(f"{names} {'is' if one else 'are'} only meaningful with --draft-worker (a target worker "
                         f"ignores {'it' if one else 'them'}, as sglang's does)", code="usage", flags=given,
                         remedy=f"add --draft-worker, or drop {names}")


def load_models(ns: argparse.Namespace) -> tuple[ModelSpec, Optional[ModelSpec]]:
    check_draft_only(ns)
    model = _load_spec(ns.model, "--model") if ns.model else _load_spec(default_model_path(), "--model")
    draft = _load_spec(ns.draft_model, "--draft-model") if ns.draft_model else None
    return model, draft


def pool_facts(ns: argparse.Namespace, args: Any, on_gpu: bool) -> PoolFacts:
    """Pool sizes from the flags (explicit values are checked, never replaced); defaults are CPU-friendly.

    Raises ConfigError for a ``--num-token-slots`` that is not whole pages (only the default is
    rounded up to whole pages) and, via PoolFacts, for values below 1.
    """
    ps = args.page_size
    if ns.num_token_slots is not None and ns.num_token_slots > 0 and ns.num_token_slots % ps:
        from pipeline.memory.pools import DEFAULT_DECODE_STEPS, check_needs, slot_floor

        # the multiple named must also hold run's verification batches, or following it is refused next
        steps = max(getattr(ns, "decode_steps", DEFAULT_DECODE_STEPS) or 0, 0)
        need = slot_floor(check_needs(8 if ns.max_reqs is None else ns.max_reqs, ps, steps).slots, ps)
        fix = -(-max(ns.num_token_slots, need) // ps) * ps
        raise ConfigError(f"--num-token-slots {ns.num_token_slots} is not a whole number of pages of {ps} tokens",
                          code="invalid_value", flags=[("num_token_slots", ns.num_token_slots), ("page_size", ps)],
                          allowed=[f"a multiple of {ps}"],
                          remedy=f"use --num-token-slots {fix} (or a larger multiple of {ps})")
    slots = ns.num_token_slots if ns.num_token_slots is not None else -(-(65536 if on_gpu else 1024) // ps) * ps
    return PoolFacts(max_reqs=8 if ns.max_reqs is None else ns.max_reqs,
                     max_context_len=1024 if ns.max_context_len is None else ns.max_context_len,
                     num_token_slots=slots, page_size=ps)


def request_from(ns: argparse.Namespace, *, on_gpu: bool) -> SetupRequest:
    """The SetupRequest of run, plan and warmup from their shared flags (SGLANG_* size variables checked too)."""
    args = attention_args_from(ns)
    settings.check_env()  # SGLANG_* size variables pass the same check as their flags
    model, draft = load_models(ns)
    device = device_of(ns)
    return SetupRequest(args=args, model=model, draft_model=draft, is_draft_worker=ns.draft_worker,
                        device=device.canonical, device_spelled_as=device.spelled_as, rank=ns.rank,
                        world_size=ns.world_size or (args.tp_size or 1) * args.pp_size,
                        pool=pool_facts(ns, args, on_gpu), secrets=secrets_from_env())


def device_of(ns: argparse.Namespace) -> DeviceSpelling:
    """``--device`` as meant and as written (``CUDA:0`` is ``cuda:0``, spelled ``CUDA:0``); ``cpu`` for a command
    without the flag (``plan`` sets its profile's device). A value that is no device was refused as the flags were
    read (:mod:`pipeline.cli.flags`); one set otherwise is passed on for the request's own check."""
    given = getattr(ns, "device", "cpu")
    return device_spelling(given) or DeviceSpelling(given)


def device_as_written(e: BaseException, written: Any) -> BaseException:
    """``e`` with its ``device`` flag's value as the user wrote ``--device`` (``gpu:1``, not the platform's
    ``cuda``) when both name the same device type; ``e`` itself, changed in place (an error, not a contract).
    Raises nothing."""
    info = getattr(e, "info", None)
    spelled = device_spelling(written) if isinstance(written, str) else None
    if info is None or spelled is None:
        return e
    kind = spelled.canonical.partition(":")[0]
    flags = [msgspec.structs.replace(f, value=written) if f.name in ("device", "--device") and isinstance(f.value, str)
             and f.value.partition(":")[0].lower() in (kind, written.partition(":")[0].lower()) else f
             for f in info.flags]
    e.info = msgspec.structs.replace(info, flags=flags)  # type: ignore[attr-defined]
    return e


def is_gpu_device(device: str) -> bool:
    """Whether ``--device`` names a GPU, in any accepted spelling (``auto``: torch sees one)."""
    device = (device_spelling(device) or DeviceSpelling(device)).canonical
    if device.startswith("cuda"):
        return True
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return False

