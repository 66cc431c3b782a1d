"""Every published config.json of tests/data/model_configs has a pinned outcome through ``plan``'s reader: accepted
with its layer-kind summary (kind, heads, kv heads, qk / v dims, window, sinks, K = V, layer count) and its
not-attention groups, or refused with the exact error code and field. The pins were checked against transformers'
own configuration classes and modeling code (docs/models.md); no refusal of a published file tells the user to fix it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.errors import AttnSetupError
from pipeline.core.model_spec import load_model_spec

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "model_configs"
PINS = json.loads((ROOT / "tests" / "data" / "model_corpus_outcomes.json").read_text())
FILES = sorted(p for p in CORPUS.glob("*.json") if p.name != "SOURCES.json")


def outcome(path: Path) -> dict:
    try:
        s = load_model_spec(path)
    except AttnSetupError as e:
        return {"code": e.info.code, "field": e.info.flags[0].name if e.info.flags else None,
                "blames_file": "fix" in (e.info.remedy or "").lower()}
    return {"kinds": [[k.kind, k.num_heads, k.num_kv_heads, k.head_dim_qk, k.head_dim_v, round(k.scaling, 6),
                       k.sliding_window, k.has_sinks, k.k_eq_v, len(k.layer_ids)] for k in s.layer_kinds()],
            "other": [[g.kind, len(g.layer_ids)] for g in s.not_attention()]}


def test_every_corpus_file_is_pinned():
    assert len(FILES) >= 40 and sorted(PINS) == sorted(p.name for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_corpus_outcome(path):
    got = outcome(path)
    assert got == PINS[path.name]
    assert not got.get("blames_file")
