"""Why each MoE segment got its combine, in words ``plan.explain()`` prints."""
from __future__ import annotations

from remat_compiler.budget import human_bytes

__all__ = ["reasons"]


def reasons(modes: dict[str, str], peak_bytes: int, flipped_peak_bytes: dict[str, int],
            recompute_s: float | None = None, flipped_recompute_s: dict[str, float] | None = None
            ) -> dict[str, str]:
    """Why each segment got its combine, for ``plan.explain()``.

    Parameters
    ----------
    modes : dict of str to str
        Each segment's chosen combine (:attr:`Choice.modes`).
    peak_bytes : int
        The simulated step peak of the saved set on the graph traced with ``modes`` (not the
        model's peak variable, which is only a bound unless the solve proved it).
    flipped_peak_bytes : dict of str to int
        Per segment, the simulated step peak of the same saved set with that segment's combine
        switched to the other one (what it needs then is recomputed; a comparison, not a solve). A
        segment it lacks was not compared (said so).
    recompute_s, flipped_recompute_s : optional
        The estimated recompute time of the saved set on the chosen graph and, per segment, on the
        switched one: said too where given (a combine that the peak does not separate is chosen
        for what it saves recomputing).
    """
    found = {}
    for seg, mode in modes.items():
        other = "autograd" if mode == "fused" else "fused"
        if seg not in flipped_peak_bytes:
            found[seg] = (f"chosen in the one CP-SAT solve with the saved set (step peak {human_bytes(peak_bytes)}); "
                          f"not compared with the {other} combine here: each comparison traces the step again, "
                          f"and the time set aside for them was spent")
            continue
        found[seg] = (f"chosen in the one CP-SAT solve with the saved set: step peak "
                      f"{human_bytes(peak_bytes)}, against {human_bytes(flipped_peak_bytes[seg])} "
                      f"with the {other} combine here and the same saved set")
        if recompute_s is not None and flipped_recompute_s and seg in flipped_recompute_s:
            found[seg] += (f" (recompute est. {recompute_s * 1e3:.3f} ms against "
                           f"{flipped_recompute_s[seg] * 1e3:.3f} ms)")
    return found
