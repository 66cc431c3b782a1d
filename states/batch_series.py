"""sglang's decode-graph batch series 1, 2, 4, 8, 16, 24, 32, … (step 8 from 16) up to a top, as a sequence that is
never listed: length, indexing, search and sum in O(1), so a refusal of an absurd top costs nothing (s13: ``plan
--max-reqs 2147483647 --cuda-graph-max-bs 2147483647`` built ~268M sizes, 10+ GB, in the graphs' lower bound).

:func:`states.graphs.capture_series` returns it; :func:`states.graphs.capture_batch_sizes` lists it for a capture.
Pure arithmetic, no torch.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Union, overload

__all__ = ["BatchSeries", "series_sum"]

HEAD = (1, 2, 4, 8)  # then 16, 24, 32, … step 8 (sglang's get_batch_sizes_to_capture)


class BatchSeries(Sequence[int]):
    """The sizes 1, 2, 4, 8, 16, 24, … up to ``top`` (those at most ``top``), ascending, held as a head tuple and a
    ``range``. A slice is a list (callers slice at most :data:`pipeline.core.pool_remedy.REMEDY_MAX_BS`'s sizes)."""

    def __init__(self, top: int) -> None:
        self.top = int(top)
        self._head = tuple(b for b in HEAD if b <= self.top)
        self._tail = range(16, self.top + 1, 8)

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, list[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n, h = len(self), len(self._head)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("batch size index out of range")
        return self._head[i] if i < h else self._tail[i - h]

    def __iter__(self) -> Iterator[int]:
        yield from self._head
        yield from self._tail

    def __contains__(self, b: object) -> bool:
        return b in self._head or b in self._tail

    def __repr__(self) -> str:
        return f"BatchSeries(top={self.top}, {len(self)} sizes)"

    def total(self) -> int:
        """The sum of the sizes, in closed form."""
        t = self._tail
        return sum(self._head) + (len(t) * (t[0] + t[-1]) // 2 if len(t) else 0)


def series_sum(sizes: Sequence[int]) -> int:
    """``sum(sizes)``: in closed form for a :class:`BatchSeries`, else summed."""
    return sizes.total() if isinstance(sizes, BatchSeries) else sum(sizes)
