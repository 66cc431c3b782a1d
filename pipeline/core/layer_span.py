"""What a stack cut to its first N attention layers holds, in words: ``2 attention layers built (layers 0-7: 6
linear-attention skipped) of 48`` (:func:`span_text`, :func:`span_fields`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from pipeline.core.spec import ATTENTION_LAYER_TYPES, LayerGroup


class LayerSpan(NamedTuple):
    """The first ``span`` hidden layers (ids ``0..span-1``) of a model of ``num_hidden_layers``:
    ``attention`` of them built, the others listed by type in ``skipped``."""

    attention: int
    span: int
    num_hidden_layers: int
    skipped: list[LayerGroup]

    @property
    def skipped_count(self) -> int:
        """How many hidden layers of the span are not attention (not built)."""
        return sum(len(g.layer_ids) for g in self.skipped)


def layer_span(layer_types: list[str], span: int, num_hidden_layers: int) -> LayerSpan:
    """The :class:`LayerSpan` of the first ``span`` of ``layer_types`` (the model's per-layer types) in a model
    of ``num_hidden_layers``."""
    kinds = list(layer_types[:span])
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(kinds):
        if t not in ATTENTION_LAYER_TYPES:
            groups.setdefault(t, []).append(i)
    attention = sum(1 for t in kinds if t in ATTENTION_LAYER_TYPES)
    return LayerSpan(attention, span, num_hidden_layers, [LayerGroup(kind=k, layer_ids=v) for k, v in groups.items()])


def span_of(built: Any, full: Any) -> LayerSpan:
    """The span of ``built`` (a :class:`ModelSpec` cut by ``truncate_spec``) within ``full`` (the whole model)."""
    return layer_span(list(built.layer_types), built.num_hidden_layers, full.num_hidden_layers)


def _layers(n: int) -> str:
    return f"{n} attention layer{'' if n == 1 else 's'}"


def span_detail(s: LayerSpan) -> str:
    """``layers 0-7: 6 linear-attention skipped`` (``layer 0`` / ``layers 0-1`` when nothing was skipped)."""
    where = "layer 0" if s.span == 1 else f"layers 0-{s.span - 1}"
    if not s.skipped:
        return where
    return f"{where}: " + ", ".join(f"{len(g.layer_ids)} {g.kind.replace('_', '-')} skipped" for g in s.skipped)


def span_text(s: LayerSpan) -> str:
    """``2 attention layers built (layers 0-7: 6 linear-attention skipped) of 48`` (``of 48`` counts every hidden
    layer of the model, attention or not)."""
    return f"{_layers(s.attention)} built ({span_detail(s)}) of {s.num_hidden_layers}"


def span_fields(s: LayerSpan) -> dict[str, Any]:
    """The JSON fields beside a ``num_layers`` (the hidden layers spanned): ``attention_layers`` (built) and
    ``skipped_layers`` (``[{kind, layer_ids}]``, the span's layers that are not attention)."""
    return {"attention_layers": s.attention,
            "skipped_layers": [{"kind": g.kind, "layer_ids": list(g.layer_ids)} for g in s.skipped]}
