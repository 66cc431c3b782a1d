"""The command line's number parsers now live in :mod:`pipeline.core.numbers` (the environment variables' readers
in the setup and observe layers use them too); importable from here as before."""

from pipeline.core.numbers import ascii_float, ascii_int  # noqa: F401

__all__ = ["ascii_float", "ascii_int"]
