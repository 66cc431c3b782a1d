"""The ``triton`` attention backend: ``kernels/`` (``@triton.jit`` bodies), ``launch.py`` / ``launch_mla.py``
(validating launchers, tile configs), ``backend.py`` (:class:`TritonAttnBackend`, ``create``)."""
