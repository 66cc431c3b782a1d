"""The command line's stdout and stderr: a reader that leaves early changes nothing, any other write error fails.

:class:`ReaderMayLeave` wraps each stream in :func:`pipeline.cli.main`. Two kinds of write error, two answers:

- a closed pipe (EPIPE: ``attn-setup backends | head -1``, ``attn-setup run 2>&1 | head -1``) is a reader that left:
  the rest of that stream is dropped and the exit code stays the command's (README, "Exit codes");
- any other (ENOSPC: ``attn-setup plan --json > /dev/full``, EIO, …) lost output a script may need, so, as coreutils
  tools do, it is a failure: the rest of that stream is dropped too, the error is recorded
  (:attr:`ReaderMayLeave.error`), :func:`settle` turns an exit 0 into exit 2 (``output_write_failed``,
  :class:`pipeline.core.errors.OutputWriteFailed`) — a failed command keeps its own code — and :func:`report` names
  the stream and the error on stderr when stderr still works.

A descriptor closed before the process started (``attn-setup plan >&-``, ``2>&-``: Python then has no
``sys.stdout``) is a stream every write to fails (EBADF, :class:`ClosedStream`), answered as any other write error;
:func:`open_std_fds` first points it at /dev/null, so that the next file opened (``run``'s log) cannot take its
number and receive what a C library or a child process writes there.

``run`` calls :func:`settle` after printing its report and before ``command_finished``, so that the trace's exit
code is the process's.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, Iterable, Optional

from pipeline.core.errors import EXIT_OK, OutputWriteFailed


def open_std_fds() -> frozenset[int]:
    """Point each of the descriptors 0, 1 and 2 that is closed at /dev/null; returns the ones that were closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
    if closed:
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return frozenset(closed)
        for fd in closed:
            if fd != null:
                os.dup2(null, fd)
        if null not in closed:
            os.close(null)
    return frozenset(closed)


class ClosedStream:
    """stdout or stderr whose descriptor ``fd`` was closed when the process started: every write and flush raises
    EBADF, as a write to the closed descriptor would (what it is written on is /dev/null, :func:`open_std_fds`)."""

    encoding = "utf-8"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        """Raise OSError(EBADF): the caller opened no stream here."""
        raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} (descriptor {self.fd} was closed at start)")

    def flush(self) -> None:
        """Nothing buffered; a flush after a write that failed raises nothing new."""

    def fileno(self) -> int:
        """The descriptor (now /dev/null)."""
        return self.fd

    def isatty(self) -> bool:
        """Never a terminal."""
        return False


def std_stream(stream: Any, fd: int, closed: frozenset[int]) -> Any:
    """``stream`` (``sys.stdout`` or ``sys.stderr``), or a :class:`ClosedStream` when descriptor ``fd`` was closed at
    start (Python then gives None, or a stream on the /dev/null :func:`open_std_fds` put there)."""
    return ClosedStream(fd) if stream is None or fd in closed else stream


def quiet(stream: Any = None) -> None:
    """Point the stream's file descriptor (stdout's unless ``stream`` is given) at /dev/null, so that what is left —
    our later writes, a C library's, the interpreter's final flush — goes nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, (stream or sys.stdout).fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (in-process callers)
        pass
    finally:
        os.close(devnull)


def _target(stream: Any) -> Optional[str]:
    """Where the stream's file descriptor points (``/dev/full``, a file on a full disk), when the system says."""
    inner = stream
    while not isinstance(inner, ClosedStream) and "stream" in getattr(inner, "__dict__", {}):  # SafeText's wrapped
        inner = inner.stream
    if isinstance(inner, ClosedStream):
        return f"closed (descriptor {inner.fd})"
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        return None


class ReaderMayLeave:
    """stdout or stderr (``name``) for a reader that may leave early: the first write or flush that meets a closed pipe
    sends the rest of that stream's output to /dev/null and the command carries on, so its exit code says how the
    command ended, not whether anyone read all of its output. Each stream leaves on its own (with ``2>&1`` both meet
    the closed pipe). Any other write error (``OSError``: a full disk, ``/dev/full``, EIO) does the same and is kept
    in :attr:`error` (with :attr:`target`, where the stream pointed), for :func:`settle` and :func:`report`."""

    def __init__(self, stream: Any, name: str = "stdout") -> None:
        self.stream, self.name, self.gone = stream, name, False
        self.error: Optional[OSError] = None
        self.target: Optional[str] = None

    def write(self, text: str) -> int:
        """Write ``text`` to the stream; after the reader left or a write failed, drop it (its length is returned)."""
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError as e:
                self._leave(e)
        return len(text)

    def flush(self) -> None:
        """Flush the stream; a closed pipe or a write error met here makes the stream leave (nothing raised)."""
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as e:
                self._leave(e)

    def _leave(self, e: OSError) -> None:
        self.gone = True
        if not isinstance(e, BrokenPipeError):
            self.error, self.target = e, _target(self.stream)
        quiet(self.stream)

    def __getattr__(self, name: str) -> Any:   # isatty, fileno, encoding, … of the real stream
        return getattr(self.stream, name)


def failed(streams: Iterable[Any]) -> list[Any]:
    """The wrapped streams whose output was lost to a write error other than a closed pipe, each flushed first."""
    out = []
    for s in streams:
        try:
            s.flush()
        except (OSError, ValueError, AttributeError):  # not ours (no wrapper), closed by the caller, or none
            pass
        if getattr(s, "error", None) is not None:
            out.append(s)
    return out


def settle(code: int, streams: Optional[Iterable[Any]] = None) -> int:
    """The exit code once the output is out: ``code``, or — when it is 0 and a write to stdout or stderr (default:
    ``sys.stdout``, ``sys.stderr``) failed other than on a closed pipe — :class:`OutputWriteFailed`'s (2). A failed
    command's own code is never replaced."""
    lost = failed((sys.stdout, sys.stderr) if streams is None else streams)
    return OutputWriteFailed.exit_code if lost and code == EXIT_OK else code


def error_of(lost: list[Any]) -> OutputWriteFailed:
    """The typed error naming each stream whose output was lost, where it pointed and why."""
    names = " and ".join(s.name for s in lost)
    why = " and ".join(f"{s.name} ({s.error.strerror or s.error})" for s in lost)
    return OutputWriteFailed(
        f"could not write to {why}: the command's output there is incomplete",
        state="output", flags=[(s.name, s.target or "not known") for s in lost],
        remedy=f"send {names} somewhere that takes the whole output (a file system with free space, a terminal or a "
               f"pipe) and run the command again")


def report(code: int, out: Any, err: Any) -> int:
    """:func:`settle` for :func:`pipeline.cli.main`'s two wrapped streams: the exit code, and the write error named on
    stderr (the error block) when stderr still works."""
    lost = failed((out, err))
    if not lost:
        return code
    if err not in lost:
        from pipeline.cli.report import render_error

        try:
            render_error(error_of(lost).info)   # sys.stderr is ``err`` here: a failure there is recorded, not raised
        except (OSError, ValueError):
            pass
        err.flush()
    return OutputWriteFailed.exit_code if code == EXIT_OK else code
