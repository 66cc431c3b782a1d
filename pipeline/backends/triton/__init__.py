"""The ``triton`` attention backend: our own paged decode/extend kernels written in Triton.

- ``kernels/``: the ``@triton.jit`` bodies (decode split + merge, extend), no validation.
- ``checks.py``: input checks with typed errors; ``launch.py``: launchers (check, then launch) and configs.
- ``backend.py``: :class:`TritonAttnBackend` (sglang's AttentionBackend, CUDA-graph hooks) and ``create``.

Importing this package imports nothing heavy; ``backend``/``launch`` import torch and triton.
"""
