"""Human output that follows the terminal's width: one console, tables that never cut a cell, lines wrapped at words.

Every human table and line of ``run``, ``plan``, ``warmup``, ``inspect``, ``replay``, ``backends`` and the
error block goes through here. The width is rich's console width: ``COLUMNS`` when set (a ``COLUMNS`` that is not
a positive integer counts as unset), else the
terminal's, else (no terminal at all: a pipe in CI) rich's default of 80 columns.

Nothing a user needs is cut: :func:`print_table` gives every column at least its longest word (rich's own
column collapse would otherwise end a long word with an ellipsis, ``chunked_local_…``), and when even those
minimum widths do not fit the console, it prints the rows as records (``name`` then ``  column: value``
lines) instead of a table. :func:`wrap` and :func:`print_line` break lines at spaces only (never inside a
word, never at a hyphen); a single word longer than the line (a long path) is left whole on its own line
for the terminal to wrap. Text is printed with markup off unless a style is given.
"""

from __future__ import annotations

import textwrap
from typing import Any, Optional, Sequence


def console(stderr: bool = False) -> Any:
    """A rich Console at the terminal's width (``COLUMNS`` honoured; 80 with no terminal), no highlighting, no emoji
    codes (a ``:name:`` read from a log or a config stays as typed)."""
    from rich.console import Console

    from pipeline.observe.progress import fixed_width

    return Console(stderr=stderr, highlight=False, soft_wrap=False, emoji=False,  # ":x:" in a log stays text
                   width=fixed_width())


def width(c: Optional[Any] = None) -> int:
    """The console's width in columns (at least 20, so that indented lines keep some text)."""
    return max(20, (c or console()).width)


def wrap(text: str, cols: int, indent: str = "  ") -> list[str]:
    """``text`` broken at spaces into lines of at most ``cols`` columns, later lines indented by ``indent``.

    Never splits a word or breaks at a hyphen; a word longer than the line stays whole (the line is then
    longer than ``cols``). Leading spaces of ``text`` are kept. A line end in ``text`` (a message that holds a
    table) stays one: each line after it starts indented, then wraps on its own.
    """
    lead = text[:len(text) - len(text.lstrip(" "))]
    if "\n" in text:
        first, *rest = text.split("\n")
        return wrap(first, cols, indent) + [x for r in rest for x in wrap(lead + indent + r, cols, indent)]
    if len(text) <= cols:
        return [text]
    return textwrap.wrap(text, cols, initial_indent="", subsequent_indent=lead + indent, break_long_words=False,
                         break_on_hyphens=False, drop_whitespace=True, replace_whitespace=False) or [text]


def wrap_lines(lines: Sequence[str], cols: int, indent: str = "  ") -> list[str]:
    """:func:`wrap` over several lines (embedded newlines kept as line ends)."""
    out: list[str] = []
    for line in lines:
        for part in str(line).split("\n"):
            out += wrap(part, cols, indent)
    return out


def print_stderr_lines(lines: Sequence[str]) -> None:
    """``notice:`` / ``warning:`` lines on stderr as plain text (never markup), broken at spaces to stderr's width as
    every other human line, flushed (they precede the report on stdout: one terminal, two streams)."""
    import sys

    for part in wrap_lines(lines, width(console(stderr=True))):
        print(part, file=sys.stderr, flush=True)


def print_line(c: Any, text: str, style: Optional[str] = None, indent: str = "  ") -> None:
    """One line of plain text (never markup), wrapped at words to the console's width."""
    for part in wrap_lines([text], width(c), indent):
        c.print(part, style=style, markup=False, soft_wrap=True, highlight=False)


def _min_width(cells: Sequence[str]) -> int:
    """The longest word (run of non-space characters, leading indentation included) of a column's cells."""
    best = 1
    for cell in cells:
        text = str(cell)
        lead = len(text) - len(text.lstrip(" "))
        words = text.split() or [""]
        best = max(best, lead + len(words[0]), *(len(w) for w in words))
    return best


def table_fits(columns: Sequence[str], rows: Sequence[Sequence[str]], cols: int) -> bool:
    """Whether a boxed table of these cells fits ``cols`` columns without cutting or splitting a word
    (each column at least its longest word, plus rich's one-space padding each side and the borders)."""
    mins = [_min_width([h, *(r[i] for r in rows)]) for i, h in enumerate(columns)]
    return sum(mins) + 3 * len(columns) + 1 <= cols


def column_widths(columns: Sequence[str], rows: Sequence[Sequence[str]], cols: int) -> list[int]:
    """Each column's text width in a table of ``cols`` columns: its longest line when everything fits, else its
    longest word plus a share of the room left, in proportion to how much wider its longest line is (rich's own
    collapse can leave a column narrower than its longest word, which it then ends with an ellipsis)."""
    mins = [_min_width([h, *(r[i] for r in rows)]) for i, h in enumerate(columns)]
    maxs = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(columns)]
    room = cols - 3 * len(columns) - 1
    if sum(maxs) <= room:
        return maxs
    spare, slack = room - sum(mins), [b - a for a, b in zip(mins, maxs)]
    total = sum(slack) or 1
    out = [a + spare * s // total for a, s in zip(mins, slack)]
    for i in sorted(range(len(out)), key=lambda i: slack[i] - (out[i] - mins[i]), reverse=True):
        if sum(out) >= room:
            break
        if out[i] < maxs[i]:
            out[i] += 1
    return out


def print_table(c: Any, title: Optional[str], columns: Sequence[str], rows: Sequence[Sequence[Any]],
                justify: Optional[Sequence[str]] = None) -> None:
    """A table on ``c`` that never cuts a cell: a rich table whose columns are at least their longest word
    wide when that fits the console, else one record per row (first cell, then ``  column: value`` lines).

    Cells are plain text (a log's strings can hold markup characters). ``justify``: per column
    (``left``/``right``), default left.
    """
    from rich.table import Table
    from rich.text import Text

    cells = [[str(x) for x in r] for r in rows]
    cols = width(c)
    if title:  # its own wrapped line: rich would wrap a title to the table's (narrower) width
        print_line(c, title)
    if table_fits(columns, cells, cols):
        t = Table()
        for i, (h, w) in enumerate(zip(columns, column_widths(columns, cells, cols))):
            t.add_column(h, width=w, overflow="fold", justify=(justify[i] if justify else "left"))  # type: ignore[arg-type]
        for r in cells:
            t.add_row(*(Text(x) for x in r))
        c.print(t)
        return
    for r in cells:
        print_line(c, r[0].strip() or "-", indent="    ")
        for h, v in zip(columns[1:], r[1:]):
            print_line(c, f"  {h}: {v}", indent="    ")
