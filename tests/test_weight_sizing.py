"""weights_exceed_memory: the stack's weight bytes against an independent count of the
tensors AttentionStack builds, and the refusal's remedy followed (the --num-layers it names then fits)."""

from __future__ import annotations

import glob

import pytest

from conftest import CONFIGS
from pipeline import load_model_spec
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import remedy_available, remedy_margin
from pipeline.core.spec import attention_layer_ids
from pipeline.memory.pools import check_weights_fit, weight_bytes

# DeepSeek-V3 left out for speed (its MLA shapes are DeepSeek-V2-Lite's formula at other sizes)
MODELS = sorted(p for p in glob.glob(str(CONFIGS / "*.json")) if "deepseek-v3" not in p)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_weight_bytes_match_the_built_stack(path):
    """Independent reference: the element count of the tensors AttentionStack really allocates, for one layer."""
    import torch

    from pipeline.runtime.model import AttentionStack

    spec = load_model_spec(path)
    for n in (1,):
        stack = AttentionStack(spec, dtype=torch.bfloat16, device="cpu", num_layers=n)
        elems = sum(t.numel() for w in stack.weights for k, t in w.items() if k != "sinks" and t is not None)
        own, ref = weight_bytes(spec, n, "bfloat16")
        assert (own, ref) == (2 * elems, 8 * elems), (n, own, elems)


@pytest.mark.parametrize("free_gib", [0.5, 3, 20, 150])
@pytest.mark.parametrize("on_host", [True, False])
def test_refusal_remedy_fits(free_gib, on_host):
    """Every refusal names num_layers and a count that passes the same check, also with free memory less the remedy
    margin (or says none fits); the one above it is refused with that margin."""
    spec = load_model_spec(CONFIGS / "deepseek-v3.json")
    free = int(free_gib * (1 << 30))
    kw = dict(device_free=free, host_free=free, on_host=on_host, device="cuda:0" if not on_host else "cpu")
    total = len(attention_layer_ids(spec))
    try:
        check_weights_fit(spec, total, "bfloat16", **kw)
        pytest.fail("61 DeepSeek-V3 layers cannot fit in 150 GiB with their float64 reference")
    except ConfigError as e:
        info = e.info
    assert info.code == "weights_exceed_memory" and ("num_layers", total) in [(f.name, f.value) for f in info.flags]
    if "or fewer" in info.remedy:
        n = int(info.remedy.split("--num-layers ")[1].split()[0])
        for drop in (0, remedy_margin(free)):  # the remedy, followed, passes, also after free memory dropped a little
            check_weights_fit(spec, n, "bfloat16", **dict(kw, device_free=free - drop, host_free=free - drop))
        with pytest.raises(ConfigError):  # and it is the largest that fits the free memory less the margin
            spare = remedy_available(free)
            check_weights_fit(spec, n + 1, "bfloat16", **dict(kw, device_free=spare, host_free=spare))
    else:  # not one layer fits the free memory less the margin
        with pytest.raises(ConfigError):
            spare = remedy_available(free)
            check_weights_fit(spec, 1, "bfloat16", **dict(kw, device_free=spare, host_free=spare))


def test_unknown_memory_is_not_checked():
    spec = load_model_spec(CONFIGS / "deepseek-v3.json")
    check_weights_fit(spec, 61, "bfloat16", device_free=0, host_free=0, on_host=True, device="cpu")
