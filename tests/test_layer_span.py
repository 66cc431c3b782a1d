"""How many layers a run built, said truly for a hybrid model.

Qwen3-Next with ``--num-layers 2`` builds layers 3 and 7: the stack spans layers 0-7 and 6 linear-attention layers
in it are skipped. "8 of 48 layers built" and plan's "over 8 layers" read as 8 attention layers.
"""

from __future__ import annotations

import json

from conftest import ROOT

from pipeline.cli import main
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.layer_span import layer_span, span_text

QWEN3_NEXT = str(ROOT / "examples" / "configs" / "qwen3-next-80b-a3b-instruct.json")


def test_span_text_counts_attention_layers_and_names_the_skipped():
    """Qwen3-Next's first 8 layers hold 2 attention layers and 6 linear-attention ones; a plain model's none."""
    hybrid = (["linear_attention"] * 3 + ["full"]) * 12
    s = layer_span(hybrid, 8, 48)
    assert (s.attention, s.span, s.skipped_count) == (2, 8, 6)
    assert span_text(s) == "2 attention layers built (layers 0-7: 6 linear-attention skipped) of 48"
    assert span_text(layer_span(["full"] * 32, 2, 32)) == "2 attention layers built (layers 0-1) of 32"
    assert span_text(layer_span(["full"] * 36, 1, 36)) == "1 attention layer built (layer 0) of 36"
    mixed = ["mamba", "full", "linear_attention", "sliding"]
    assert span_text(layer_span(mixed, 4, 4)) == \
        "2 attention layers built (layers 0-3: 1 mamba skipped, 1 linear-attention skipped) of 4"


def test_run_reports_attention_layers_built_for_a_hybrid(tmp_path, capsys):
    """run's model line and its model_loaded record: 2 attention layers built over layers 0-7, 6 skipped."""
    log = tmp_path / "a.jsonl"
    code = main(["run", "--device", "cpu", "--model", QWEN3_NEXT, "--num-layers", "2", "--decode-steps", "1",
                 "--log-file", str(log)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "2 attention layers built (layers 0-7: 6 linear-attention skipped) of 48" in out
    assert "8 of 48 layers built" not in out
    loaded = next(r for r in map(wire.decode_line, log.read_bytes().splitlines()) if isinstance(r, ev.ModelLoaded))
    assert (loaded.num_layers, loaded.attention_layers) == (8, 2)  # num_layers keeps its meaning: the span
    assert loaded.skipped_layers == [{"kind": "linear_attention", "layer_ids": [0, 1, 2, 4, 5, 6]}]


def test_plan_says_attention_layers_over_the_span(capsys):
    """plan's CUDA-graph line and JSON: over 2 attention layers (layers 0-7: 6 skipped), num_layers kept."""
    base = ["plan", "--model", QWEN3_NEXT, "--device-profile", "h200", "--installed", "torch,triton,flashinfer"]
    assert main(base) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "over 2 attention layers (layers 0-7: 6 linear-attention skipped):" in text
    assert main([*base, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["cuda_graph_estimate"]
    assert (est["num_layers"], est["attention_layers"], est["num_hidden_layers"]) == (8, 2, 48)
    assert est["skipped_layers"] == [{"kind": "linear_attention", "layer_ids": [0, 1, 2, 4, 5, 6]}]


def test_old_model_loaded_records_still_decode():
    """A model_loaded line written before attention_layers / skipped_layers decodes, both None."""
    rec = ev.ModelLoaded(ts_ns=1, run_id="r", rank=0, state="load-model", num_layers=2, num_hidden_layers=32,
                         param_bytes=1, dtype="bfloat16", seed=0)
    line = json.loads(wire.encode(rec))
    for k in ("attention_layers", "skipped_layers"):
        line.pop(k, None)
    back = wire.decode_line(json.dumps(line).encode())
    assert back.attention_layers is None and back.skipped_layers is None
