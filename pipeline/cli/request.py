"""The ``SetupRequest`` that run, plan and warmup build from their shared flags (model files, pool sizes, args)."""

from __future__ import annotations

import argparse
from typing import Any, Optional

import msgspec

from pipeline.cli.flags import attention_args_from
from pipeline.core import settings
from pipeline.core.contracts import Flag, ModelSpec, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError, ModelConfigError, UsageError
from pipeline.core.eventlog import secrets_from_env
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec
from pipeline.core.validation import DeviceSpelling, device_spelling


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
                        world_size=ns.world_size,
                        pool=pool_facts(ns, args, on_gpu), secrets=secrets_from_env())


def device_of(ns: argparse.Namespace) -> DeviceSpelling:
    """``--device`` as meant and as written (``CUDA:0`` is ``cuda:0``, spelled ``CUDA:0``); ``cpu`` for a command
    without the flag (``plan`` sets its profile's device). A value that is no device was refused as the flags were
    read (:mod:`pipeline.cli.domains`); one set otherwise is passed on for the request's own check."""
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
