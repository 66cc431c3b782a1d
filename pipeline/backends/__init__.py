"""Attention backends: the interface, the registry and one module per backend."""
