"""Where the CLI's messages go: notes, progress lines and step timings on stderr."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import click

__all__ = ["PROG", "Console", "format_progress", "timed"]

PROG = "remat-compiler"


#: With ``--progress``, the least time between two progress lines of one solve (the last is printed
#: when the solve ends)
LINE_INTERVAL_S = 1.0


@dataclass
class Console:
    """Where messages go: notes and progress on stderr, silenced by ``--quiet``; details by ``--verbose``.

    Progress is one line redrawn in place on a terminal; with ``progress_lines`` (``--progress``) it is
    printed as lines, also when stderr is a file or a pipe (a log).
    """

    quiet: bool = False
    verbose: bool = False
    progress_lines: bool = False
    _lines: "_Lines | None" = field(default=None, repr=False)  # the solve whose lines are printing

    def note(self, message: str) -> None:
        """A short note on stderr (what was written where), unless quiet."""
        if not self.quiet:
            click.echo(message, err=True)

    def detail(self, message: str) -> None:
        """A diagnostic line on stderr, only with --verbose."""
        if self.verbose:
            click.echo(f"[{PROG}] {message}", err=True)

    def shows_progress(self) -> bool:
        """Progress is shown on a terminal or with --progress, and never with --quiet."""
        return not self.quiet and (self.progress_lines or sys.stderr.isatty())

    def progress_callback(self, label: str) -> Callable[[dict], None] | None:
        """A solver ``progress`` callback that redraws one stderr line (or, with --progress, prints a
        line now and one per report, at most one per :data:`LINE_INTERVAL_S`), or None when progress
        is not shown."""
        if not self.shows_progress():
            return None
        if self.progress_lines:
            self.clear_progress()  # the solve before this one has ended
            click.echo(f"{label}: planning", err=True)
            self._lines = _Lines(label)
            return self._lines
        return lambda info: click.echo("\r\033[K" + format_progress(label, info), err=True, nl=False)

    def clear_progress(self) -> None:
        """End the progress of a solve: clear the redrawn line, or print the last line held back."""
        if self._lines is not None:
            self._lines.flush()
            self._lines = None
        elif self.shows_progress() and not self.progress_lines:
            click.echo("\r\033[K", err=True, nl=False)

    @contextlib.contextmanager
    def progress(self, label: str) -> Iterator[Callable[[dict], None] | None]:
        """The progress callback for one solve, with the line cleared (or the last line printed)
        afterwards."""
        try:
            yield self.progress_callback(label)
        finally:
            self.clear_progress()


class _Lines:
    """Progress as stderr lines: the first report, then at most one per :data:`LINE_INTERVAL_S`;
    :meth:`flush` prints the last report if it was held back."""

    def __init__(self, label: str):
        self.label = label
        self._printed_at: float | None = None
        self._held: dict | None = None

    def __call__(self, info: dict) -> None:
        if self._printed_at is not None and info["elapsed_s"] - self._printed_at < LINE_INTERVAL_S:
            self._held = info
            return
        self._print(info)

    def flush(self) -> None:
        if self._held is not None:
            self._print(self._held)

    def _print(self, info: dict) -> None:
        click.echo(format_progress(self.label, info), err=True)
        self._printed_at, self._held = info["elapsed_s"], None


def format_progress(label: str, info: dict) -> str:
    """One progress line from a CP-SAT report ``{elapsed_s, objective, bound, gap}``.

    Example
    -------
    >>> format_progress("cpsat", {"elapsed_s": 1.5, "objective": 1200, "bound": 1000, "gap": 0.2})
    'cpsat: 1.5 s, best cost 1,200, bound 1,000, gap 20.0%'
    """
    return (f"{label}: {info['elapsed_s']:.1f} s, best cost {info['objective']:,.0f}, "
            f"bound {info['bound']:,.0f}, gap {info['gap']:.1%}")


@contextlib.contextmanager
def timed(console: Console, what: str) -> Iterator[None]:
    """Log how long a pipeline step took (with --verbose)."""
    t0 = time.perf_counter()
    yield
    console.detail(f"{what}: {time.perf_counter() - t0:.2f} s")
