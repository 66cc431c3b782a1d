"""What every command-line error must say, in the command line's words.

:func:`check_cli_error` is applied to every error of the bad-input corpus (``tests/test_bad_inputs.py``), both
to the ``--json`` object and to the human block :func:`pipeline.cli.output.render_error` prints for it:

- no Python value leaks: no ``None`` word, no ``=None`` (a missing value reads ``not set``);
- no field path (``pool.max_reqs``, ``args.page_size``) or bare field name (``attention_backend``) where the
  subcommand has a flag that sets it — in the flag entries, the message, the allowed values or the remedy;
- every flag entry is a flag of the subcommand, an environment variable, or a name no flag sets (a config key,
  ``device.arch``) — never a field a flag sets under its field name;
- a remedy that points at help points at the subcommand's (``attn-setup plan --help``), and argparse's own
  errors always do.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.cli.output import command_dests, flag_of

NONE = re.compile(r"\bNone\b")


def field_leaks(text: str, command: str) -> list[str]:
    """Field paths / snake_case field names in ``text`` that the subcommand has a flag for."""
    dests = command_dests(command)
    out = [m.group(0) for m in re.finditer(r"(?<![\w.$\-])(?:pool|args)\.([a-z_]+)\b", text) if m.group(1) in dests]
    out += [m.group(0) for m in re.finditer(r"(?<![\w.$\-/'\"])([a-z]+(?:_[a-z0-9]+)+)\b(?![\w.(\-/'\"])", text)
            if m.group(1) in dests]
    return out


def check_cli_error(err: dict[str, Any], command: str, human: str = "") -> None:
    """Assert the properties above for one ErrorInfo (as ``--json`` printed it) and its human rendering."""
    texts = [err["message"], err["remedy"], *err["allowed"], *(str(f["value"]) for f in err["flags"]
                                                                if f["value"] is not None), human]
    for t in texts:
        assert not NONE.search(t) and "=None" not in t, (t, err)
        assert not field_leaks(t, command), (field_leaks(t, command), t)
    dests = command_dests(command)
    for f in err["flags"]:
        name = f["name"]
        field = name.split(".", 1)[1] if name.startswith(("pool.", "args.")) else name
        assert name.startswith("-") or name.isupper() or field not in dests, (name, f"use {flag_of(field)}", err)
    if "--help" in err["remedy"]:
        assert f"attn-setup {command} --help" in err["remedy"], err["remedy"]
    if err["code"] == "usage" and err["message"].startswith("attn-setup"):  # argparse's own error
        assert err["message"].startswith(f"attn-setup {command}:"), err["message"]
        assert f"'attn-setup {command} --help'" in err["remedy"], err["remedy"]


def rendered(err: dict[str, Any], capsys: Any) -> str:
    """The human error block :func:`pipeline.cli.output.render_error` prints for ``err`` (captured stderr)."""
    import msgspec

    from pipeline.cli.output import render_error
    from pipeline.core.errors import ErrorInfo

    capsys.readouterr()
    render_error(msgspec.convert(err, ErrorInfo))
    return capsys.readouterr().err
