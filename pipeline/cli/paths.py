"""The file paths a command line names, checked together before the command starts anything.

Three rules, each a :class:`~pipeline.core.errors.UsageError` (exit 2) naming the flag(s), before anything is
written (:func:`check_paths`, called by :func:`pipeline.cli.main` after each flag's own domain):

- every path is valid UTF-8 (``path_not_utf8``): a name with undecodable bytes (Python holds them as lone
  surrogates) cannot be written into the JSON log, the report or an ErrorInfo;
- no output overwrites an input or another output (``path_conflict``): ``--log-file``, ``--metrics-file``,
  ``--perfetto`` and ``graph -o`` against each other and against ``--model``, ``--draft-model`` and the LOGs read
  (same resolved path, or :func:`os.path.samefile` when both exist: a hard link is the same file);
- ``--metrics-file`` can be written (``metrics_file_unwritable``): the temporary file it is written through is
  created and removed next to it, so a read-only target (``/proc/version``) or a name too long is refused up front.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator, Optional

from pipeline.core.errors import UsageError

# (flag, namespace attribute, output?) per command; a list attribute (the LOGs) gives one path per element.
_PATH_FLAGS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "run": (("--log-file", "log_file", True), ("--metrics-file", "metrics_file", True),
            ("--model", "model", False), ("--draft-model", "draft_model", False)),
    "plan": (("--model", "model", False), ("--draft-model", "draft_model", False)),
    "warmup": (("--model", "model", False), ("--draft-model", "draft_model", False)),
    "inspect": (("--perfetto", "perfetto", True), ("LOG", "logs", False)),
    "replay": (("LOG", "logs", False),),
    "graph": (("--output", "output", True), ("LOG", "logs", False)),
}


def shown_path(path: str) -> str:
    """``path`` as an ErrorInfo can carry it: undecodable bytes (lone surrogates) written as ``\\xNN``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def named_paths(ns: argparse.Namespace) -> Iterator[tuple[str, str, bool]]:
    """``(flag, path, is_output)`` for every path flag of ``ns.command`` that was given (strings only)."""
    for flag, dest, output in _PATH_FLAGS.get(getattr(ns, "command", ""), ()):
        value = getattr(ns, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v:
                yield flag, v, output


def _check_utf8(flag: str, path: str) -> None:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = shown_path(path)
        raise UsageError(f"{flag} '{shown}' is not valid UTF-8 (its name holds undecodable bytes)",
                         code="path_not_utf8", flags=[(flag, shown)], allowed=["a path that is valid UTF-8"],
                         remedy=f"rename the file or pass another path for {flag} whose name is valid UTF-8") from None


def _concrete(flag: str, path: str, ns: argparse.Namespace) -> Optional[str]:
    """The path a flag will really touch: ``--log-file`` with ``{rank}`` filled in, and ``{run_id}`` with the shared
    run id when one is set (``ATTN_SETUP_RUN_ID`` / ``TORCHELASTIC_RUN_ID``: s13, a ``{run_id}`` path then named the
    model config or the metrics file unchecked); None with ``{run_id}`` and no shared id (a fresh name, which nothing
    given can be, checked again once known: :func:`check_log_path`)."""
    from pipeline.core.eventlog import shared_run_id

    if flag != "--log-file":
        return path
    if "{run_id}" in path:
        run_id = shared_run_id()
        if run_id is None:
            return None
        path = path.replace("{run_id}", run_id)
    rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
    return path.replace("{rank}", str(rank if rank is not None else getattr(ns, "rank", 0)))


def same_file(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name one file: :func:`os.path.samefile` when both exist, else equal resolved paths."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _check_conflicts(ns: argparse.Namespace, log_file: Optional[str] = None) -> None:
    paths = [(f, p, out) for f, v, out in named_paths(ns)
             if (p := log_file if log_file is not None and f == "--log-file" else _concrete(f, v, ns)) is not None]
    for i, (fa, pa, out_a) in enumerate(paths):
        for fb, pb, out_b in paths[i + 1:]:
            if not (out_a or out_b) or not same_file(pa, pb):
                continue
            out, other = (fa, fb) if out_a else (fb, fa)
            what = "the two outputs would overwrite each other" if out_a and out_b else \
                f"{out} would overwrite the input {other} reads"
            raise UsageError(f"{fa} and {fb} name the same file {pa!r}: {what}",
                             code="path_conflict", flags=[(fa, pa), (fb, pb)],
                             allowed=["an output path that no other flag names"],
                             remedy=f"pass a different path to {fb if out_b else fa}")


def check_metrics_file(path: str) -> None:
    """``--metrics-file`` can be written where it is written (a temporary file beside it, then renamed): that file
    is created and removed now. Raises UsageError ``metrics_file_unwritable`` naming the flag, or
    ``output_is_symlink`` for a symbolic link (the rename would replace it:
    :func:`pipeline.core.files.refuse_symlink`)."""
    from pipeline.core.files import check_output, refuse_symlink

    refuse_symlink(path, flag="--metrics-file", what="the metrics file")
    check_output(path, flag="--metrics-file", what="the metrics file")
    probe = f"{path}.tmp{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)
        return
    except FileExistsError:
        return  # a leftover of this pid: the folder takes files
    except OSError as e:
        why = e.strerror or str(e)
    raise UsageError(f"cannot write the metrics file {path!r}: the file it is written through, {probe!r}, cannot "
                     f"be created ({why})", code="metrics_file_unwritable", flags=[("--metrics-file", path)],
                     allowed=["a writable regular file (created if absent) in a writable folder"],
                     remedy="pass a writable path for --metrics-file, or drop it")


def check_log_path(ns: argparse.Namespace, log_file: str) -> None:
    """``path_conflict`` again with ``run``'s own ``--log-file`` path (``log_file``: placeholders filled with the
    run id and rank the run got), before the log opens: a run id known only then (a fresh one, or the rank group's)
    can make it name an input or the metrics file. Raises what :func:`check_paths` raises for a conflict."""
    _check_conflicts(ns, log_file)


def check_paths(ns: argparse.Namespace) -> None:
    """Every path rule of this module, in order: UTF-8, conflicts, ``--metrics-file`` writable."""
    for flag, path, _ in named_paths(ns):
        _check_utf8(flag, path)
    _check_conflicts(ns)
    metrics = getattr(ns, "metrics_file", None)
    if getattr(ns, "command", None) == "run" and isinstance(metrics, str) and metrics:
        check_metrics_file(metrics)
