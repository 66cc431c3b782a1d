"""The library is quiet by default: a build prints nothing to an engine's stdout or stderr until the engine configures
logging (``logging``: the ``attn_setup`` logger) or structlog; then every event reaches it."""

from __future__ import annotations

import logging

from pipeline import AttentionArgs, SetupRequest, build_attention_backends, load_model_spec
from pipeline.core.contracts import PoolFacts
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG


def _build() -> None:
    req = SetupRequest(args=AttentionArgs(), model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cpu",
                       pool=PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=128))
    build_attention_backends(req).close()


def test_a_build_prints_nothing_by_default(capsys):
    import structlog

    assert not structlog.is_configured()  # an engine that configured no structlog (pytest holds the root logger)
    _build()
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_configured_logging_gets_every_event(caplog):
    with caplog.at_level(logging.INFO, logger="attn_setup"):
        _build()
    names = [r.getMessage().split(" ", 1)[0] for r in caplog.records if r.name == "attn_setup"]
    assert names[0] == "run_started" and "backends_resolved" in names and names[-1] == "run_finished"


def test_configured_structlog_gets_every_event():
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        _build()
    names = [e["event"] for e in logs]
    assert names[0] == "run_started" and "backends_resolved" in names and names[-1] == "run_finished"
