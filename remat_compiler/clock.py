"""The one clock of a solve: a :class:`Deadline` made once from ``time_limit_s`` and handed down.

Every phase of a search takes its time as a slice of what is left, so a solve ends within its limit
plus :data:`MIN_SLICE_S` per phase (and the model and plan building, which is not interrupted).
"""
from __future__ import annotations

import math
import time

__all__ = ["Deadline", "MIN_SLICE_S", "check_time_limit"]

# The least time a search phase gets even when the time limit is spent (CP-SAT needs a moment to
# return the hinted plan): a solve returns within time_limit_s plus a few of these.
MIN_SLICE_S = 0.2


class Deadline:
    """The clock of one solve: ``seconds`` from its making, shared by every phase.

    On wall-clock time by default. With ``deterministic``, on CP-SAT's deterministic time: each CP-SAT
    search is charged what it used (:meth:`charge`) and nothing else spends time, so the slices, and
    with them the plan, are the same on every run and machine (heuristics then run to their end,
    which is finite, and take longer in wall time).

    Parameters
    ----------
    seconds : float
    deterministic : bool
    """

    def __init__(self, seconds: float, *, deterministic: bool = False, _parent: "Deadline | None" = None):
        self.seconds = float(seconds)
        self.deterministic = deterministic
        self._start = time.perf_counter()
        self._spent = 0.0
        self._parent = _parent

    def elapsed(self) -> float:
        """Time spent so far."""
        return self._spent if self.deterministic else self.wall_elapsed()

    def wall_elapsed(self) -> float:
        """Wall-clock seconds since the deadline was made (what a plan reports as its solve time)."""
        return time.perf_counter() - self._start

    def left(self) -> float:
        """Time left (0 when spent)."""
        return max(0.0, self.seconds - self.elapsed())

    def expired(self) -> bool:
        return self.left() <= 0.0

    def slice(self, share: float = 1.0, cap: float = math.inf) -> float:
        """Seconds for the next phase: ``share`` of what is left, at most ``cap``, at least
        :data:`MIN_SLICE_S`."""
        return max(MIN_SLICE_S, min(cap, share * self.left()))

    def part(self, seconds: float) -> "Deadline":
        """A clock for one phase: ``seconds`` from now, ending no later than this one (but lasting
        :data:`MIN_SLICE_S` at least). What the phase is charged is charged here too."""
        return Deadline(min(seconds, max(self.left(), MIN_SLICE_S)), deterministic=self.deterministic,
                        _parent=self)

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of deterministic time as spent (wall-clock deadlines ignore it)."""
        self._spent += seconds
        if self._parent is not None:
            self._parent.charge(seconds)


def check_time_limit(time_limit_s) -> None:
    """Raise ValueError unless ``time_limit_s`` is None or a positive, finite number of seconds."""
    if time_limit_s is None:
        return
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) \
            or not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a positive number of seconds")
