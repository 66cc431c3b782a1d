"""A periodic beat while a long step runs (JIT compiles, graph capture): one shared mechanism."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def beating(every_s: float, beat: Callable[[float], None], name: str = "attn-setup-heartbeat") -> Iterator[None]:
    """Call ``beat(elapsed_s)`` every ``every_s`` seconds from a daemon thread while the body runs.

    The thread stops and is joined when the body ends (normally or by an exception).
    """
    stop = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        while not stop.wait(every_s):
            beat(time.monotonic() - t0)

    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
