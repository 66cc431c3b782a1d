"""After ``AttentionBackends.close()`` the result's backend accessors raise ``BackendClosed`` naming close(), and a
reference kept from before raises it when called (``out.attn_backend`` was None, so a
call through it raised AttributeError)."""

from __future__ import annotations

import pytest

from pipeline.core.contracts import SetupRequest
from pipeline.core.errors import BackendClosed
from pipeline.setup.build import build_attention_backends

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}


def _build(llama, small_pool):
    return build_attention_backends(SetupRequest(model=llama, pool=small_pool, device="cpu"), installed=INSTALLED)


@pytest.mark.parametrize("name", ["attn_backend", "decode_attn_backend", "decode_attn_backend_group"])
def test_accessor_after_close_raises_backend_closed_naming_close(llama, small_pool, name):
    """Each of the three accessors: BackendClosed (code backend_closed, exit 1) whose message names close() and
    the attribute, with a remedy; the names and the decisions stay readable."""
    out = _build(llama, small_pool)
    getattr(out, name)  # readable while open
    out.close()
    with pytest.raises(BackendClosed, match=rf"AttentionBackends\.{name} was read after close\(\)") as e:
        getattr(out, name)
    info = e.value.info
    assert info.code == "backend_closed" and e.value.exit_code == 1 and "build_attention_backends" in info.remedy
    assert {f.name: f.value for f in info.flags}["attribute"] == name
    assert out.closed and out.prefill_attention_backend_str == "torch_native" and out.plan is not None
    assert "closed" in repr(out)
    with pytest.raises(AttributeError):  # other missing attributes stay AttributeError
        out.no_such_attribute


def test_reference_kept_from_before_close_raises_when_called(llama, small_pool):
    """A backend read before close() refuses its forward/metadata calls with BackendClosed."""
    with _build(llama, small_pool) as out:
        backend = out.attn_backend
    with pytest.raises(BackendClosed, match=r"called after close\(\)"):
        backend.init_forward_metadata(None)


def test_with_block_closes_and_close_is_idempotent(llama, small_pool):
    """`with` closes; a second close() releases nothing and the accessors still raise BackendClosed."""
    with _build(llama, small_pool) as out:
        assert out.attn_backend is out.instances["primary"]
    assert out.close() == []
    with pytest.raises(BackendClosed):
        out.attn_backend.forward  # noqa: B018 - the read itself raises
