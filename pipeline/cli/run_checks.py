"""``attn-setup run``'s own checks of its flags, before anything is built: ``--log-file`` (its placeholders filled,
the log opened), ``--max-context-len`` against the verification batches, ``--require-warm-cache``, the pool the
checks need (:func:`check_pool_for_checks`) and the :class:`~pipeline.runtime.runner.RunnerConfig` built from the flags.
Each flag's own domain is checked before, as the flags are read (:mod:`pipeline.cli.domains`).
Split out of :mod:`pipeline.cli.run` (the command flow), which re-exports every name here.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from pipeline.core.contracts import SetupRequest
from pipeline.core.errors import ConfigError, UsageError

DEFAULT_LAYERS = 2  # a verification run: at least 2 layers, more when a layer kind first appears later (quick on CPU)

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def log_path(template: str, run_id: str, rank: int) -> str:
    """Fill ``{run_id}`` and ``{rank}`` into ``--log-file`` (no other placeholder, no format spec).

    Raises UsageError naming ``--log-file`` for other placeholders, unbalanced braces, or a path
    that is a directory or cannot be created.
    """
    for name in _PLACEHOLDER.findall(template):
        if name not in ("run_id", "rank"):
            raise UsageError(f"--log-file has an unknown placeholder {{{name}}}", code="usage",
                             flags=[("--log-file", template)], allowed=["{run_id}", "{rank}"],
                             remedy="use only {run_id} and {rank} in --log-file")
    path = template.replace("{run_id}", run_id).replace("{rank}", str(rank))
    if "{" in path or "}" in path:
        raise UsageError("--log-file has an unbalanced brace", code="usage", flags=[("--log-file", template)],
                         allowed=["{run_id}", "{rank}"], remedy="balance the braces or remove them")
    if os.path.isdir(path):
        raise UsageError(f"--log-file {path!r} is a directory", code="usage", flags=[("--log-file", template)],
                         remedy="give a file path, e.g. DIR/{run_id}.rank{rank}.jsonl")
    return path


def checked_log_path(ns: argparse.Namespace, run_id: str, rank: int) -> str:
    """:func:`log_path` of ``--log-file`` for ``run_id`` and ``rank``, checked against the other path flags
    (:func:`pipeline.cli.paths.check_log_path`: ``path_conflict``, exit 2) before the log opens."""
    from pipeline.cli.paths import check_log_path

    path = log_path(ns.log_file, run_id, rank)
    check_log_path(ns, path)
    return path


def open_log(path: str, template: str, run_id: str, rank: int, secrets: tuple[str, ...]) -> Any:
    """The run's EventLog; an unwritable path or one that is not a regular file (a FIFO, ``/dev/full``)
    is a UsageError naming ``--log-file`` (exit 2, nothing started)."""
    from pipeline.core.eventlog import EventLog

    try:
        return EventLog(run_id, rank, path, secrets=secrets, flag="--log-file", raise_write_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write the log file {path!r}: {e.strerror or e}", code="log_file_unwritable",
                         flags=[("--log-file", template)], remedy="pick a writable path for --log-file") from None


def check_context(request: SetupRequest, decode_steps: int, command: str = "run") -> None:
    """Refuse a ``--max-context-len`` shorter than the longest request ``run``'s checks reach: the built instances
    are verified on a 5-request batch and the model steps on a 4-request one
    (:func:`pipeline.memory.pools.check_needs`; torch-free, so ``plan`` refuses it too, at run's
    default ``--decode-steps``); ConfigError ``invalid_value`` naming the minimum."""
    from pipeline.core.validation import MAX_POOL_DIM
    from pipeline.memory.pools import check_needs

    from pipeline.core.speculative import settled

    p = request.pool
    ctx = check_needs(p.max_reqs, 1, decode_steps, settled(request), request.is_draft_worker).context
    if p.max_context_len < ctx:
        which = "verification request reaches with --decode-steps" if command == "run" else \
            "verification request of `attn-setup run` reaches with its default --decode-steps"
        raise ConfigError(f"--max-context-len {p.max_context_len} is shorter than the {ctx} tokens the longest "
                          f"{which} {decode_steps}", code="invalid_value",
                          flags=[("max_context_len", p.max_context_len), ("decode_steps", decode_steps)],
                          allowed=[f">= {ctx}"],
                          remedy=f"pass --max-context-len {ctx} or more" if ctx <= MAX_POOL_DIM else
                          f"lower --decode-steps (--max-context-len is at most {MAX_POOL_DIM})")


def check_plan_minimums(request: SetupRequest) -> None:
    """``plan``'s copy of the refusals ``run`` makes from its flags alone before anything is built, at ``run``'s
    default ``--decode-steps`` (plan has no such flag): a ``--max-context-len`` shorter than the longest verification
    request (:func:`check_context`), and a ``--num-token-slots`` below the slots the verification batches hold
    (``pool_budget_too_small``, as ``run``'s pool sizing words it: whole pages, at least two). Torch-free."""
    from pipeline.memory.pools import DEFAULT_DECODE_STEPS, check_needs, slot_floor

    from pipeline.core.speculative import settled

    check_context(request, DEFAULT_DECODE_STEPS, command="plan")
    p, page = request.pool, request.args.page_size
    floor = slot_floor(check_needs(p.max_reqs, page, DEFAULT_DECODE_STEPS, settled(request),
                                   request.is_draft_worker).slots, page)
    if p.num_token_slots is not None and -(-p.num_token_slots // page) * page < floor:
        raise ConfigError(f"num_token_slots={p.num_token_slots} cannot hold {floor} token slots (the verification "
                          f"batches of `attn-setup run` with its default --decode-steps {DEFAULT_DECODE_STEPS})",
                          code="pool_budget_too_small", flags=[("num_token_slots", p.num_token_slots),
                                                               ("page_size", page)],
                          allowed=[f">= {floor}"], remedy=f"set num_token_slots={floor} or more")


def check_warm_cache(ns: argparse.Namespace, runner: Any, pre: Any) -> None:
    """``--require-warm-cache``: refuse (ConfigError ``cold_jit_cache``, exit 3) a run whose FlashInfer variants
    would compile at startup, from the decisions the preflight made (the device facts and the resolved pair the
    run then takes), before anything is allocated."""
    if not getattr(ns, "require_warm_cache", False):
        return
    from pipeline.cli.jit import check_warm, cold_report
    from pipeline.runtime.table import attention_request

    setup = pre["attention"]
    check_warm(ns, cold_report(attention_request(runner), setup["device-init"].facts, setup["resolve"].pair))


def check_pool_for_checks(ns: argparse.Namespace, request: SetupRequest, platform: Any, index: int = 0) -> None:
    """The pool ``run`` would size for these flags on ``platform``'s device ``index``, checked as its preflight checks
    it (:func:`pipeline.runtime.table.size_for`: fits the device, holds the verification batches); nothing is
    allocated. Raises the sizing's ConfigError."""
    from pipeline.core.spec import attention_layer_ids, truncate_spec
    from pipeline.runtime.table import size_for

    cfg = runner_config(ns, request)
    served = request.served_model
    spec = truncate_spec(served, cfg.num_layers) if attention_layer_ids(served) else served
    size_for(platform, index, cfg, spec)


def runner_config(ns: argparse.Namespace, request: SetupRequest) -> Any:
    """The RunnerConfig from the flags (default on every device: the first 2 attention layers, or as many as it
    takes to include one layer of every attention kind, e.g. 4 for Llama-4, 6 for Gemma-3); a pool sized from
    ``--num-token-slots`` or ``--mem-bytes`` must hold the verification batches (whole pages each:
    :func:`pipeline.memory.pools.check_needs`)."""
    from pipeline.core.model_spec import layers_covering_every_kind
    from pipeline.core.speculative import settled
    from pipeline.memory.pools import check_needs
    from pipeline.runtime.runner import RunnerConfig

    default = layers_covering_every_kind(request.served_model, DEFAULT_LAYERS)
    layers = ns.num_layers if ns.num_layers is not None else max(default, 1)
    p, ps, steps = request.pool, request.args.page_size, max(ns.decode_steps, 0)
    needs = check_needs(p.max_reqs, ps, steps, settled(request), request.is_draft_worker)
    return RunnerConfig(request=request, num_layers=layers, num_token_slots=ns.num_token_slots,
                        mem_bytes=ns.mem_bytes, mem_fraction=ns.mem_fraction, min_token_slots=needs.slots,
                        min_token_slots_for=f"the verification batches with --decode-steps {steps}",
                        min_context_len=needs.context)
