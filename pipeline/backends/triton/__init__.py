"""The ``triton`` attention backend: our own paged decode/extend kernels written in Triton.

- ``kernels/``: the ``@triton.jit`` bodies (decode split + merge, extend), no validation.
- ``launch.py``: launchers that validate shapes, dtypes and devices with typed errors, then launch.
- ``backend.py``: :class:`TritonAttnBackend` (sglang's AttentionBackend, CUDA-graph hooks) and ``create``.

Importing this package imports nothing heavy; ``backend``/``launch`` import torch and triton.
"""
