"""The library Runner asked for a device torch cannot use gives the typed device_unavailable, as the CLI does
(raw AssertionError "Torch not compiled with CUDA enabled" in load-model)."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS
from pipeline.core import events as ev
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.runtime.runner import Runner, RunnerConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_runner_on_missing_cuda_is_device_unavailable(device):
    spec = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    req = SetupRequest(args=AttentionArgs(), model=spec, device=device,
                       pool=PoolFacts(max_reqs=2, max_context_len=32, num_token_slots=64))
    r = Runner(RunnerConfig(request=req, num_layers=1))
    with pytest.raises(ConfigError) as e:
        r.initialize()
    assert e.value.info.code == "device_unavailable"
    assert e.value.info.flags[0].name == "device" and "cpu" in e.value.info.remedy
    failed = [x for x in r.log.records if isinstance(x, ev.RunFailed)]
    assert failed and failed[-1].error.code == "device_unavailable" and failed[-1].error.state == "load-model"
