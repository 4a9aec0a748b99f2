"""Plain-text tables: aligned columns and numbered notes for cells too long to fit.

Shared by the sweep and compare reports and by ``benchmarks/report.py``; pictures live in
:mod:`remat_compiler.viz`.

>>> notes = []
>>> print(format_table(["strategy", "peak"], [["cpsat", "1.0 MiB"], ["x", note_cell("n/a", notes)]]))
strategy  peak
--------  -------
cpsat     1.0 MiB
x         n/a
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["format_table", "note_cell"]


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned plain-text columns with a rule under the header.

    Example
    -------
    >>> print(format_table(["a", "bb"], [[1, 2]]))
    a  bb
    -  --
    1  2
    """
    table = [[str(c) for c in header], *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def note_cell(text: str, notes: list[str], *, limit: int = 48) -> str:
    """A table cell for ``text``: as is when short, else its head and a numbered note in ``notes``.

    Example
    -------
    >>> notes = []
    >>> note_cell("n/a: " + "x" * 60, notes), len(notes)
    ('n/a [1]', 1)
    """
    if len(text) <= limit:
        return text
    notes.append(f"[{len(notes) + 1}] {text}")
    return f"{text.split(':')[0][:limit]} [{len(notes)}]"
