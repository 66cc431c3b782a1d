"""An error's entries (its ``flags`` list) as the lines people read, one wording for ``run``'s error block on
stderr (:func:`pipeline.cli.report.render_error`) and ``inspect``'s explanation of a recorded failure
(:func:`pipeline.cli.inspect_text.explain`).

Each entry is labelled (:func:`flag_label`: ``flag``, ``arg``, ``env`` or ``field``) and its
value worded by :func:`pipeline.core.value_text.value_text` (``not set``, lists joined, every rank's value as
``rank 0: 8; rank 1: 16``). A ``derived`` entry (``rank_divergence``: ``{"cuda_graph_bs": "--max-reqs"}``, the
fields that differ only because another one does) is not printed itself: each field it names is labelled
``derived`` and names what it is derived from, so the flag to change is the one the user set.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.core.value_text import value_text

DERIVED = "derived"


def flag_label(name: str) -> str:
    """How the error block labels one ErrorInfo flag: a command-line flag, a positional argument (``LOG``), an
    environment variable, else a field (a config key, a trace's run id: something no flag sets)."""
    from pipeline.cli.domains import FLAG_DOMAINS

    if name.startswith("-"):
        return "flag"
    if any(fd.flag == name for fd in FLAG_DOMAINS):  # the table's rows not spelled --x are the positional arguments
        return "arg"
    if name.isupper():
        return "env"
    return "field"


_TYPED_WITHOUT_VALUE = re.compile(r"expected (one|at least one) argument|arguments are required|unrecognized arguments")


def typed_without_value(info: Any) -> bool:
    """Whether ``info`` is argparse's refusal of a flag or argument typed without its value (``--log-file`` last,
    a missing ``LOG``, an unknown flag with nothing after it): its ``""`` values mean "none typed"."""
    return info.code == "usage" and _TYPED_WITHOUT_VALUE.search(info.message) is not None


def derived_of(info: Any) -> dict[str, str]:
    """``{field: what it follows from}`` of the error's ``derived`` entry (empty without one)."""
    for f in info.flags:
        if f.name == DERIVED and isinstance(f.value, dict):
            return {str(k): str(v) for k, v in f.value.items()}
    return {}


def entry_rows(info: Any) -> list[tuple[str, str]]:
    """Every entry of the error as ``(label, "name = value")``, in the error's order; a derived field is labelled
    ``derived`` and names what it is derived from: ``cuda_graph_bs = rank 0: 1,2,4,8; … (from --max-reqs)``."""
    derived, bare = derived_of(info), typed_without_value(info)
    rows = []
    for f in info.flags:
        if f.name == DERIVED and derived:
            continue
        text = f"{f.name} = {value_text(f.value, bare)}"
        if f.name in derived:
            rows.append(("derived", f"{text} (from {derived[f.name]})"))
        else:
            rows.append((flag_label(f.name), text))
    return rows


def change_lines(change: list[str]) -> list[str]:
    """The ``flag to change:`` line(s): one line naming every flag, or one line per flag when a value holds every
    rank's (its ``;`` would run into the next flag's)."""
    if not change:
        return []
    if any("; rank " in c for c in change):
        return [f"flag to change: {c}" for c in change]
    return ["flag to change: " + ", ".join(change)]
