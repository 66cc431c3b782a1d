"""One module per pipeline state: a pure decision function and, where the state has an effect,
a small function applying the decision through the Platform or the backend registry.

Decisions take frozen Structs and return frozen Structs, so they are testable and replayable
without hardware. No module here imports torch, triton or flashinfer at import time.
"""
