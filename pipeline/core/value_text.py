"""One value (a flag's, a field's, a recorded decision's) as people read it: never a Python repr.

:func:`value_text` is what every human view prints for a value it did not build itself — the error block's flag
entries (``run``, ``plan``, ``inspect``), ``inspect``'s rank differences and ``inspect --diff``'s changed decisions:

- ``None`` → ``not set``; ``""`` → ``''`` (an empty string, as typed), or ``(no value)`` for a flag typed without
  one (``no_value``); a boolean → ``on`` / ``off``;
- a string → quoted (``'normal'``), a number as typed;
- a list → its items joined (``cuda_graph_bs, pool.max_reqs``; ``none`` when empty);
- a mapping keyed by rank numbers (``{'0': '8', '1': '16'}``, as ``rank_divergence`` records every rank's value)
  → ``rank 0: 8; rank 1: 16``; any other mapping → ``key value, key value`` (``host vm, device cpu``).

Inside a list or a mapping strings are not quoted (the separators already delimit them), and a list or mapping
is put in parentheses (``(state resolve, what cuda_graph), (state …)``). Torch-free, no imports.
"""

from __future__ import annotations

from typing import Any


def _inner(value: Any) -> str:
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (dict, list, tuple)) and value:  # one item of several: its parts kept together
        return f"({value_text(value)})"
    return value_text(value)


def value_text(value: Any, no_value: bool = False) -> str:
    """``value`` for people (module docstring); ``no_value``: an empty string is a flag typed without its value."""
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return ("(no value)" if no_value else "''") if value == "" else repr(value)
    if isinstance(value, dict):
        if not value:
            return "none"
        if all(str(k).isdigit() for k in value):
            return "; ".join(f"rank {k}: {_inner(v)}" for k, v in value.items())
        return ", ".join(f"{k} {_inner(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_inner(v) for v in value) if value else "none"
    return str(value)
