"""One value (a flag's, a field's, a recorded decision's) as people read it: never a Python repr (docs/internals.md)."""

from __future__ import annotations

from typing import Any


def _inner(value: Any) -> str:
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (dict, list, tuple)) and value:  # one item of several: its parts kept together
        return f"({value_text(value)})"
    return value_text(value)


def value_text(value: Any, no_value: bool = False) -> str:
    """``value`` for people (docs/internals.md); ``no_value``: an empty string is a flag typed without its value."""
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
