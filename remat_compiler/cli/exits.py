"""The CLI's exit codes, the errors its commands raise with theirs, and the mapping of any error to one
(:func:`classify`)."""
from __future__ import annotations

import click

from remat_compiler.errors import InfeasibleBudgetError, RematError

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INFEASIBLE", "NothingFits", "NoStrategyRan", "classify",
           "one_line"]

#: The documented exit codes: ok, any other error, bad arguments, infeasible budget.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


class NothingFits(click.ClickException):
    """fit: the budget is below the smallest feasible peak at the smallest size."""

    exit_code = EXIT_INFEASIBLE


class NoStrategyRan(click.ClickException):
    """compare: every named strategy was infeasible or did not apply."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def classify(exc: BaseException) -> tuple[int, str]:
    """Map an exception to the documented exit code and its one-line message."""
    if isinstance(exc, click.UsageError):
        return EXIT_USAGE, exc.format_message()
    if isinstance(exc, click.ClickException):
        return exc.exit_code, exc.format_message()
    if isinstance(exc, InfeasibleBudgetError):
        return EXIT_INFEASIBLE, str(exc)
    if isinstance(exc, click.Abort):
        return EXIT_ERROR, "aborted"
    if isinstance(exc, RematError):
        return EXIT_ERROR, str(exc)
    return EXIT_ERROR, f"{type(exc).__name__}: {exc}"


def one_line(message: str) -> str:
    """``message`` on one line (its whitespace runs made single spaces), or "failed" if empty."""
    return " ".join(str(message).split()) or "failed"
