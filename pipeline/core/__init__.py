"""The library core: contracts, errors, model specs, settings, event records and their log, fault points.

Torch-free; imports nothing above it (no backend, state, runtime or command).
"""
