"""Read a library remedy back into the changes it proposes, so tests can apply them and check they work.

The library words remedies with field names (pipeline/wording.py): clauses joined by "or", each one of
``set F to one of: a, b``, ``set F='x' and G=True``, ``drop F``, ``install P [and …]``. :func:`fixes_of`
returns one :class:`Fix` per alternative; :func:`apply` makes the changed request. Prose clauses
("run on a GPU whose arch is listed") give no fix; :func:`backends_named` lets a test check that
every backend a remedy names is covered by a fix.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.backends import registry
from pipeline.core.contracts import AttentionArgs, SetupRequest

FIELDS = set(AttentionArgs.__struct_fields__)
_DEFAULTS = dict(zip(AttentionArgs.__struct_fields__[-len(AttentionArgs.__struct_defaults__):],
                     AttentionArgs.__struct_defaults__))


@dataclass
class Fix:
    """One alternative of a remedy: packages to install and field values to set."""

    packages: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)


def fixes_of(remedy: str) -> list[Fix]:
    """The alternatives a library remedy proposes (see the module docstring)."""
    out: list[Fix] = []
    for clause in re.split(r",? or ", remedy):
        req = r"[\w\-]+(?:[<>=!~][\w.<>=!~,]*)?"  # a name, or a name with the supported versions (torch>=2.11,<2.16)
        pk = re.search(rf"\binstall ((?:{req})(?: and {req})*?)(?: and (?=set)|\s*\(|$|,)", clause)
        pkgs = [re.split(r"[<>=!~]", p)[0] for p in pk.group(1).split(" and ")] if pk else []
        one_of = re.search(r"\bset (\w+) to one of: ([\w, ]+)", clause)
        if one_of:
            out += [Fix(list(pkgs), {one_of.group(1): n.strip()}) for n in one_of.group(2).split(",") if n.strip()]
            continue
        fields = {k: ast.literal_eval(v) for k, v in re.findall(r"\b(\w+)=('[^']*'|True|False|-?\d+)", clause)
                  if k in FIELDS}
        for group in re.findall(r"\bdrop (\w+(?: and \w+)*)", clause):  # "drop a and b": a flag off, a value unset
            fields.update({k: False if isinstance(_DEFAULTS.get(k), bool) else None
                           for k in group.split(" and ") if k in FIELDS})
        if fields or pkgs:
            out.append(Fix(list(pkgs), fields))
    return out


def backends_named(text: str) -> set[str]:
    """Every known backend name (registered or sglang's) that occurs as a word in ``text``."""
    return {n for n in registry.known_names() if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)}


def apply(request: SetupRequest, installed: dict[str, bool], fix: Fix) -> tuple[SetupRequest, dict[str, bool]]:
    """The request with ``fix.fields`` set on its args, and ``installed`` with ``fix.packages`` added."""
    args = msgspec.structs.replace(request.args, **fix.fields)
    return msgspec.structs.replace(request, args=args), {**installed, **{p: True for p in fix.packages}}
