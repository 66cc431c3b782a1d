"""Opening user-named files safely: regular files only (no FIFO, device or directory), reads capped; no torch."""

from __future__ import annotations

import os
import stat
from typing import IO

from pipeline.core.errors import UsageError


def _refuse_irregular(mode: int, p: str, *, flag: str, what: str) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise UsageError(f"{what} {p!r} is {kind}, not a regular file", code="not_a_regular_file",
                     flags=[(flag, p)], allowed=["a regular file"],
                     remedy=f"pass the path of a regular file as {flag} (pipes, devices and directories "
                            "are refused: they can block or never end)")


def _ancestors(path: str) -> list[str]:
    """``path`` and every folder above it, nearest first."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def make_parent(path: str | os.PathLike, *, flag: str, code: str = "usage") -> None:
    """Create the missing folders above an output file (every output-path flag). Raises :class:`UsageError` (``code``,
    exit 2) naming ``flag`` when one cannot be created."""
    p = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(p))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        above = next((a for a in _ancestors(parent) if os.path.exists(a)), parent)
        why = f"{above!r} is not a folder" if not os.path.isdir(above) else e.strerror or str(e)
        raise UsageError(f"cannot create the folder {parent!r} for {flag} {p!r}: {why}", code=code,
                         flags=[(flag, p)], remedy=f"pass a path for {flag} whose folders exist or can be created "
                         "(missing ones are created)") from None


def check_output(path: str | os.PathLike, *, flag: str, what: str) -> None:
    """Check an output path before writing: an existing target must be a regular file; missing folders are created.
    Raises :class:`UsageError` naming ``flag``."""
    p = os.fspath(path)
    try:
        mode = os.stat(p).st_mode
    except OSError:
        mode = None  # missing: written new
    if mode is not None:
        _refuse_irregular(mode, p, flag=flag, what=what)
    make_parent(p, flag=flag)


def refuse_symlink(path: str | os.PathLike, *, flag: str, what: str) -> None:
    """Raise :class:`UsageError` ``output_is_symlink`` naming ``flag`` and the target when an output replaced by rename
    (``--metrics-file``, ``--perfetto``) is a symbolic link."""
    p = os.fspath(path)
    if not os.path.islink(p):
        return
    try:
        target = os.readlink(p)  # what the link says (a /proc/self/fd link names no file of its own)
    except OSError:
        target = "?"
    # the link's text is relative to the link's folder, not to the working directory: name the path to pass from here
    here = os.path.normpath(os.path.join(os.path.dirname(p), target)) if target != "?" else target
    remedy = (f"pass another path as {flag}: the link points to a directory ({here!r})" if os.path.isdir(here) else
              f"pass another path as {flag} (a pseudo-file such as {target!r} cannot be written through a rename)"
              if target.startswith("/proc/") or target == "?" else
              f"pass the link's target, {here!r}, or another path as {flag}")
    raise UsageError(f"{what} {p!r} is a symbolic link (to {target!r}); it is written through a temporary file "
                     "renamed over it, which would replace the link", code="output_is_symlink", flags=[(flag, p)],
                     allowed=["a regular file or a new path, not a symbolic link"], remedy=remedy)


def check_replaceable(path: str | os.PathLike) -> None:
    """Raise OSError when ``path`` exists and is a symbolic link or not a regular file: what
    :func:`replace_atomically` would replace by its rename (a device, a directory's entry, the link itself)."""
    p = os.fspath(path)
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(f"{p!r} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a regular file'}")


def replace_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (``PATH.tmp<pid>`` beside it, flushed, renamed; removed on
    failure). Raises OSError, also for an existing symlink or non-regular ``path`` (never touched)."""
    p = os.fspath(path)
    check_replaceable(p)
    tmp = f"{p}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0), 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, p)
    finally:
        if os.path.lexists(tmp):
            try:
                os.unlink(tmp)
            except OSError:
                pass


def open_regular(path: str | os.PathLike, mode: str, *, flag: str, what: str) -> IO[bytes]:
    """Open ``path`` for ``"rb"``, ``"ab"`` or ``"wb"`` (the latter two create it and its folders), non-blocking and
    checked by ``fstat`` to be a regular file. Raises :class:`UsageError` naming ``flag`` (exit 2):
    ``not_a_regular_file``, or ``file_unreadable`` / ``log_file_unwritable`` for an ``OSError``."""
    p = os.fspath(path)
    try:  # a FIFO with no reader fails a non-blocking open for writing (ENXIO): name what it is instead
        _refuse_irregular(os.stat(p).st_mode, p, flag=flag, what=what)
    except OSError:
        pass  # missing (created below when appending) or unreadable: the open reports it
    flags = {"rb": os.O_RDONLY, "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
             "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}[mode] | getattr(os, "O_NONBLOCK", 0)
    code = "file_unreadable" if mode == "rb" else "log_file_unwritable"
    if mode != "rb":
        make_parent(p, flag=flag, code=code)
    try:
        fd = os.open(p, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        raise UsageError(f"cannot {'read' if mode == 'rb' else 'write'} {what} {p!r}: {e.strerror or e}", code=code,
                         flags=[(flag, p)], remedy=f"pass a {'readable' if mode == 'rb' else 'writable'} regular file "
                         f"as {flag}") from None
    try:
        _refuse_irregular(os.fstat(fd).st_mode, p, flag=flag, what=what)  # what was really opened
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def ends_mid_line(path: str | os.PathLike) -> bool:
    """Whether the regular file ``path`` is non-empty and does not end with a newline: its last line was cut short
    (a full disk, a killed writer, ``head -c``). An appender writes ``\\n`` first, so its first record is a line of
    its own. False when it cannot be read (the appender's own writes report the problem)."""
    try:
        with open_regular(path, "rb", flag="path", what="the file") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except (OSError, UsageError):
        return False


def read_capped(path: str | os.PathLike, limit: int, *, flag: str, what: str) -> bytes:
    """The content of regular file ``path`` if at most ``limit`` bytes; :class:`UsageError` naming ``flag`` as
    :func:`open_regular`, or ``file_too_large``."""
    with open_regular(path, "rb", flag=flag, what=what) as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as e:
            raise UsageError(f"cannot read {what} {os.fspath(path)!r}: {e.strerror or e}", code="file_unreadable",
                             flags=[(flag, os.fspath(path))], remedy=f"pass a readable regular file as {flag}") from None
    if len(data) > limit:
        raise UsageError(f"{what} {os.fspath(path)!r} is larger than {limit} bytes", code="file_too_large",
                         flags=[(flag, os.fspath(path))], allowed=[f"at most {limit} bytes"],
                         remedy=f"pass the right file as {flag} (this limit is far above any real one)")
    return data
