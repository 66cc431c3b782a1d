"""Triton kernel bodies of the ``triton`` backend (no validation here: see ``launch.py`` and ``launch_mla.py``).

- :mod:`.decode`: flash-decoding over the paged KV cache (split-K partials + log-sum-exp merge).
- :mod:`.extend`: extend/prefill over a cached prefix (through ``req_to_token``) plus causal new tokens.
- :mod:`.mla`: absorbed-MLA decode and extend over the paged latent cache.
"""
