"""The ``triton`` attention backend: our own paged decode/extend kernels written in Triton.

- ``kernels/``: the ``@triton.jit`` bodies (decode split + merge, extend, absorbed MLA), no validation.
- ``launch.py`` / ``launch_mla.py``: launchers that check every input with typed errors, then launch; their tile
  configs.
- ``backend.py``: :class:`TritonAttnBackend` (sglang's AttentionBackend, CUDA-graph hooks), what it serves, and
  ``create``.

Importing this package imports nothing heavy; ``backend``/``launch`` import torch and triton.
"""
