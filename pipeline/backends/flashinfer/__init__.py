"""The ``flashinfer`` and ``fa3`` backends: :mod:`~pipeline.backends.flashinfer.backend` (the backend over
FlashInfer's wrappers, torch and flashinfer imported), :mod:`~pipeline.backends.flashinfer.rules` (what their
registry entries answer, torch-free: workspace need and check, CUDA-graph state, JIT variants) and
:mod:`~pipeline.backends.flashinfer.jit` (kernel variants: the compile cache read torch-free, compile-or-load
events, warmup). Importing this package imports nothing heavy.
"""
