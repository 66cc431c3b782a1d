"""Notices ``attn-setup run`` prints on stderr before it starts: a run that will be slow or memory-hungry,
and ``--world-size`` > 1 outside torchrun (one rank runs alone).

Nothing is changed: the flags the user gave are run as given; the notice says what to expect and how
to make it smaller. Estimates come from the config alone (no allocation, no torch import):

* weights: per built attention layer ``(H·Dqk + 2·Hkv·Dqk)·hidden + hidden·H·Dv`` elements (MHA/GQA)
  or the MLA projections (:class:`pipeline.runtime.model.AttentionStack`), at the model dtype's bytes, plus
  the float64 copy the verification reference keeps (8 bytes per element) — for Llama-3.1-8B with
  ``--num-layers 32`` that is 2.7 GB + 10.7 GB, matching the 13.6 GB peak a trial measured;
* steps: ``--decode-steps`` beyond :data:`MANY_STEPS` (each step is checked against a reference over
  the whole history; 100 steps took 55 s on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipeline.memory.pools import weight_bytes  # the estimate (moved to the core: the runner refuses with it)

__all__ = ["run_notices", "weight_bytes", "MEMORY_NOTICE_BYTES", "MANY_STEPS"]

MEMORY_NOTICE_BYTES = 4 << 30   # weights + their float64 reference copy above this: say so
MANY_STEPS = 30                 # more decode steps than this: say so


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def run_notices(ns: argparse.Namespace, request: Any, num_layers: int, in_torchrun: bool) -> list[str]:
    """The notices for this run (empty when none applies); see the module docstring."""
    from states.capability_check import model_dtype

    out = []
    if ns.world_size > 1 and not in_torchrun:
        out.append(f"--world-size {ns.world_size} outside torchrun: this process runs rank {ns.rank} alone (no "
                   "rank group, the rank agreement is skipped); launch every rank with 'torchrun --nproc-per-node "
                   f"{ns.world_size} -m pipeline.cli run …' (it sets RANK/WORLD_SIZE) for a real group")
    model = request.served_model
    dtype = model_dtype(request.args, model)
    own, ref = weight_bytes(model, num_layers, dtype)
    if own + ref > MEMORY_NOTICE_BYTES:
        out.append(f"{num_layers} attention layers need about {_gib(own + ref)} of host memory for the weights "
                   f"({_gib(own)}) and the float64 verification reference ({_gib(ref)}), and minutes on a CPU; "
                   + _fewer(model, num_layers, dtype))
    if ns.decode_steps > MANY_STEPS:
        out.append(f"--decode-steps {ns.decode_steps}: every step is checked against a reference over the whole "
                   f"history, so this takes longer (100 steps: about a minute on a 2-core CPU with 2 layers)")
    return out


def _fewer(model: Any, num_layers: int, dtype: str) -> str:
    """A smaller run that verifies the same layer kinds, with its estimate: ``run``'s default (the leading attention
    layers with one of each kind, at least 2) when ``num_layers`` is above it, else the fewest with one of each
    kind (:func:`pipeline.core.spec.layers_covering_every_kind`); never the count in use. Already at the fewest:
    says so."""
    from pipeline.cli.run_checks import DEFAULT_LAYERS
    from pipeline.core.spec import layers_covering_every_kind

    fewer = [n for n in (layers_covering_every_kind(model, DEFAULT_LAYERS), layers_covering_every_kind(model, 1))
             if n < num_layers]
    if not fewer:
        return (f"{num_layers} {'is' if num_layers == 1 else 'are'} already the fewest attention layers that "
                "include every layer kind of this model")
    own, ref = weight_bytes(model, fewer[0], dtype)
    return f"--num-layers {fewer[0]} verifies the same layer kinds with about {_gib(own + ref)}"


def in_torchrun(environ: Any = os.environ) -> bool:
    """True when torchrun's variables say this process is one of several ranks."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False
