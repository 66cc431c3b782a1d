"""The setup machine's states, one module per state: ``device_init``, ``resolve`` (with its helpers
``capability_check``, ``fallback`` and ``remedies``), ``build_mode`` (with the decode CUDA-graph decision),
``npu_lazy_mem`` and ``annotate``. Each exposes a pure decision function and, where the state has an effect, a small
function applying it; the setup table (:mod:`pipeline.setup.table`) calls them.

Decisions take frozen Structs and return frozen Structs, so they are testable and replayable
without hardware. No module here imports torch, triton or flashinfer at import time.
"""
