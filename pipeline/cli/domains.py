"""Every command-line flag's domain, in one table, checked once as the flags are read.

:func:`check_flags` runs in :func:`pipeline.cli.main` right after parsing, before a command starts: before
torch is imported, a model file read, a log file opened or anything allocated. A value outside its flag's
domain — a number out of range, NaN or infinity, an unknown choice, an empty string — is an
:class:`~pipeline.core.errors.InvalidValue` (exit 2) naming the flag, the value given, the domain and a remedy
that passes this check (the flag's default, or :attr:`Domain.example`). argparse's own conversion errors (``abc``
for an integer) become the same error through :func:`parser_refusal`. Checks that need a model, a device or the
environment (``--num-layers`` above the model's layers, a pool that does not fit) stay where that is known (exit 3).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pipeline.backends import packages, registry
from pipeline.core.errors import InvalidValue
from pipeline.core.validation import Domain
from pipeline.core.validation import KV_CACHE_DTYPES, MAX_BYTES, MAX_PAGE_SIZE, MAX_POOL_DIM, MODEL_DTYPES, \
    SPECULATIVE_ALGORITHMS
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
    unknown = [p.strip() for p in str(value).split(",") if p.strip() and p.strip().lower() not in _PACKAGES]
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
    FlagDomain("--world-size", "world_size", SETUP, _int(1, MAX_POOL_DIM, 1), "1"),
    *(FlagDomain(f"--{d.replace('_', '-')}", d, SETUP, _BACKENDS, "auto-select" if d == "attention_backend" else
                 "--attention-backend's", hint=_SERVES) for d in ("attention_backend", "prefill_attention_backend",
                                                    "decode_attention_backend", "speculative_draft_attention_backend")),
    FlagDomain("--speculative-algorithm", "speculative_algorithm", SETUP,
               Domain("choice", "EAGLE", choices=SPECULATIVE_ALGORITHMS, any_case=True), "none"),
    FlagDomain("--speculative-eagle-topk", "speculative_eagle_topk", SETUP, _int(1, 1024, 1), "unset"),
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
    FlagDomain("--mem-fraction", "mem_fraction", ("run",), Domain("float", 0.5, lo=0, hi=1, lo_open=True),
               "unset: the pool has --num-token-slots slots",
               hint=f"pass a finite number in (0, 1]: {_TOO_BIG}"),
    FlagDomain("--mem-bytes", "mem_bytes", ("run",), _int(1, MAX_BYTES, 1 << 30, _BYTES),
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


CROSS_CHECKS: tuple[Callable[[argparse.Namespace, FlagDomain], Optional[InvalidValue]], ...] = (
    _rank_in_world, _graph_rank_needs_log)


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
