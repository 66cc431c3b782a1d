"""Import hygiene: the library, contracts, states and the resolve path import no torch/triton/flashinfer."""

from __future__ import annotations

import subprocess
import sys


def test_light_imports_do_not_pull_torch():
    """import pipeline + contracts + states + resolution leaves torch, triton and flashinfer unimported."""
    code = (
        "import sys, pipeline, pipeline.core.contracts, pipeline.core.errors, pipeline.core.events, pipeline.core.steps, "
        "pipeline.core.model_spec, pipeline.backends.registry, pipeline.setup.build, pipeline.setup.table, "
        "pipeline.runtime.table, pipeline.observe.replay, states.resolve, states.build_mode;"
        "from pipeline.core.model_spec import load_model_spec;"
        "from pipeline.core.contracts import DeviceFacts, AttentionArgs;"
        "m = load_model_spec('examples/configs/llama-3.1-8b.json');"
        "r = states.resolve.decide(AttentionArgs(), m, DeviceFacts(type='cpu'), is_draft_worker=False,"
        " installed={'torch': True});"
        "assert r.pair.prefill == 'torch_native';"
        "bad = [m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_library_does_not_configure_logging():
    """Importing and running decisions leaves structlog and logging unconfigured."""
    code = (
        "import logging, structlog, pipeline, pipeline.setup.build, pipeline.core.eventlog;"
        "import sys; sys.exit(0 if not structlog.is_configured() and not logging.getLogger().handlers else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
