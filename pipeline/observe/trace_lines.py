"""The trace reader's byte level: lines of a file, read without holding more than one block or one capped line.

:func:`capped_lines` is the index pass's reader: every line with its byte offset, a line longer than
:data:`~pipeline.observe.trace_decode.MAX_LINE_BYTES` read past and returned as ``b""`` (never held whole).
:func:`piece_lines` is the second pass's: the lines of one byte range that the first pass indexed, read in
blocks of :data:`BLOCK` bytes. Neither knows what a record is (:mod:`pipeline.observe.trace`).
"""

from __future__ import annotations

import os
from typing import IO, Iterator, Optional

from pipeline.observe.trace_decode import MAX_LINE_BYTES

BLOCK = 1 << 20


def capped_lines(fh: IO[bytes], start: int, end: Optional[int]) -> Iterator[tuple[int, bytes]]:
    """(offset, line) from ``start`` up to ``end``; lines over :data:`MAX_LINE_BYTES` come back as
    ``b""`` after the rest of them was read past (never held whole)."""
    fh.seek(start)
    offset = start
    while end is None or offset < end:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        at = offset
        offset += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            while not raw.endswith(b"\n"):
                raw = fh.readline(1 << 20)
                if not raw:
                    break
                offset += len(raw)
            yield at, b""
            continue
        yield at, raw


def piece_lines(fh: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    """The lines of one piece, read in blocks (a piece holds only lines pass 1 kept: each at most
    :data:`MAX_LINE_BYTES`, newline-terminated except possibly the file's last)."""
    fh.seek(start)
    left = end - start
    while left > 0:
        block = fh.read(min(left, BLOCK))
        if not block:
            return  # the file shrank since pass 1
        left -= len(block)
        if left > 0:
            cut = block.rfind(b"\n") + 1
            if 0 < cut < len(block):  # keep the partial last line for the next block
                fh.seek(cut - len(block), os.SEEK_CUR)
                left += len(block) - cut
                block = block[:cut]
        lines = block.split(b"\n")  # \n only, as pass 1 counted them
        if lines and not lines[-1]:
            lines.pop()
        yield from lines
