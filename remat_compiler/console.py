"""Where the CLI's messages go: notes, progress lines and step timings on stderr."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import click

__all__ = ["PROG", "Console", "format_progress", "timed"]

PROG = "remat-compiler"


@dataclass
class Console:
    """Where messages go: notes and progress on stderr, silenced by ``--quiet``; details by ``--verbose``."""

    quiet: bool = False
    verbose: bool = False

    def note(self, message: str) -> None:
        """A short note on stderr (what was written where), unless quiet."""
        if not self.quiet:
            click.echo(message, err=True)

    def detail(self, message: str) -> None:
        """A diagnostic line on stderr, only with --verbose."""
        if self.verbose:
            click.echo(f"[{PROG}] {message}", err=True)

    def shows_progress(self) -> bool:
        """Progress is drawn only on a terminal, and not with --quiet."""
        return not self.quiet and sys.stderr.isatty()

    def progress_callback(self, label: str) -> Callable[[dict], None] | None:
        """A solver ``progress`` callback that redraws one stderr line, or None when not shown."""
        if not self.shows_progress():
            return None
        return lambda info: click.echo("\r\033[K" + format_progress(label, info), err=True, nl=False)

    def clear_progress(self) -> None:
        if self.shows_progress():
            click.echo("\r\033[K", err=True, nl=False)

    @contextlib.contextmanager
    def progress(self, label: str) -> Iterator[Callable[[dict], None] | None]:
        """The progress callback for one solve, with the line cleared afterwards."""
        try:
            yield self.progress_callback(label)
        finally:
            self.clear_progress()


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
