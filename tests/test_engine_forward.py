"""The engine section's forward call: ``examples/engine_forward.py`` runs on CPU (torch_native, and a hybrid pair with
Triton interpreted) and matches the float64 reference; ``attention_layers`` gives every model's layers as its
backends were built for them."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conftest import CONFIGS, ROOT
from pipeline import load_model_spec
from pipeline.backends.base import AttentionLayer, PlannedLayers, attention_layers
from pipeline.core.errors import LayerMismatch


def _example():
    spec = importlib.util.spec_from_file_location("engine_forward", ROOT / "examples" / "engine_forward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("hybrid", [False, True], ids=["torch_native", "hybrid-triton-prefill"])
def test_the_example_matches_the_float64_reference(hybrid, capsys):
    if hybrid and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (set by conftest on a machine without CUDA)")
    errs = _example().main(hybrid=hybrid)
    assert set(errs) == {"extend", "decode"} and all(0 <= e < 1e-2 for e in errs.values()), errs  # bf16 inputs
    out = capsys.readouterr().out
    assert ("prefill=triton decode=torch_native" if hybrid else "prefill=torch_native decode=torch_native") in out


def test_the_reference_is_not_fooled():
    """The example's float64 reference tells a wrong scale apart (its error is then far above the tolerance)."""
    ex = _example()
    spec = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    layer = attention_layers(spec)[0]
    q, k, v = torch.randn(3, 32, 128), torch.randn(3, 8, 128), torch.randn(3, 8, 128)
    good = ex.reference(q, k, v, layer, 0)
    import dataclasses

    bad = ex.reference(q, k, v, dataclasses.replace(layer, scaling=layer.scaling * 2), 0)
    assert float((good - bad).abs().max() / good.abs().max()) > 1e-2


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_attention_layers_pass_the_backends_layer_check(config):
    """Every bundled model's attention layers, from its ModelSpec, are what its backends check against (sinks
    given where the kind has them); a layer id of another kind, or sinks against the kind, is refused."""
    spec = load_model_spec(CONFIGS / config)
    kinds = spec.layer_kinds()
    sinks = {lid: torch.zeros(k.num_heads) for k in kinds if k.has_sinks for lid in k.layer_ids}
    layers = attention_layers(spec, sinks)
    assert [layer.layer_id for layer in layers] == sorted(lid for k in kinds for lid in k.layer_ids)
    planned = PlannedLayers(kinds, backend="x", role="primary")
    for layer in layers:
        planned.check(layer)
    other = next((k for k in kinds if k.layer_ids[0] != kinds[0].layer_ids[0]), None)
    if other is not None and other.layer_ids[0] not in kinds[0].layer_ids:
        with pytest.raises(LayerMismatch):
            AttentionLayer.from_kind(kinds[0], other.layer_ids[0])
    with pytest.raises(LayerMismatch):
        AttentionLayer.from_kind(kinds[0], kinds[0].layer_ids[0],
                                 None if kinds[0].has_sinks else torch.zeros(kinds[0].num_heads))
