"""Measure one training step of any strategy the same way: peak live storage, FLOPs, time, gradients.

Every strategy is a :class:`Runner`: a callable module whose output is the loss, the leaves whose
gradients it produces, and what it took to prepare. A step starts with every gradient None (as in
ordinary training, so backward creates them and they count in the peak).

Seeing inside ``torch.compile``
-------------------------------
A ``TorchDispatchMode`` that is active when a ``torch.compile``'d frame is entered makes Dynamo skip
the frame and run it *eagerly* (its default ``ignore_compile_internals() == False`` asks for eager
semantics), so :class:`remat_compiler.LiveStorageTracker` or a plain ``FlopCounterMode`` would
measure the uncompiled model. :class:`StepTracker` and :class:`StepFlopCounter` are the same
counters with ``ignore_compile_internals() == True``: Dynamo then runs the compiled artifact with the
mode on, and with the ``aot_eager*`` backends that artifact is an fx graph of aten ops, every one of
which reaches the mode. (Checked: under the mode the compiled GPT-2 step dispatches the decomposed
graph's ops, not eager's, and its peak and FLOPs change with ``activation_memory_budget``.) Outside
``torch.compile`` they behave exactly like the originals.

>>> with StepTracker() as mem:                                  # doctest: +SKIP
...     run_step(runner, args, kwargs)
>>> mem.peak_bytes                                              # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from remat_compiler.compare import max_abs_error
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from remat_compiler.memory import LiveStorageTracker, glibc_function
from remat_compiler.plan import Plan
from remat_compiler.workload import compute_loss

from benchmarks.workloads import input_leaves

__all__ = ["StepTracker", "StepFlopCounter", "Runner", "Measurement", "run_step", "measure",
           "time_round_robin", "round_ratio", "max_abs_error", "keep_freed_memory"]


class StepTracker(LiveStorageTracker):
    """:class:`remat_compiler.LiveStorageTracker` that also sees inside ``torch.compile``'d code."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _CompiledFlopMode(_FlopCounterMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class StepFlopCounter(FlopCounterMode):
    """``torch.utils.flop_counter.FlopCounterMode`` (same registry, same counts) that sees inside
    ``torch.compile``'d code. It does not track modules: no global module hooks are installed, which
    would otherwise change what Dynamo guards on. Use ``get_total_flops()``."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _CompiledFlopMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        out = self.mode.__exit__(*args)
        self.mode = None
        return out


@dataclass
class Runner:
    """One strategy, ready to train.

    Attributes
    ----------
    strategy : str
        Family: ``eager``, ``checkpoint``, ``torch.compile``, ``remat_compiler`` or an MoE strategy.
    setting : str
        What distinguishes it inside the family (``budget 0.5``, ``@ eager peak``...).
    module : callable
        ``module(*args, **kwargs)`` returns the loss (or an output with ``.loss``).
    params : list of tensors
        Parameters whose gradients the step produces, in the eager model's order.
    budget_bytes : int, optional
    plan : Plan, optional
        The remat_compiler plan (for predicted peak, status and gap).
    prepare_s : float, optional
        Plan time (remat_compiler) or compile + first step (torch.compile).
    """

    strategy: str
    setting: str
    module: Callable
    params: list
    budget_bytes: int | None = None
    plan: Plan | None = None
    prepare_s: float | None = None
    extras: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.strategy if self.setting in ("", "-") else f"{self.strategy} {self.setting}"


@dataclass
class Measurement:
    """What one runner's step did: peak bytes, FLOPs, gradients (cloned), first-call seconds, and how
    many times it compiled again after the warm-up (``torch.compile`` runners; should be 0)."""

    peak_bytes: int
    flops: int
    grads: list
    first_call_s: float
    recompiles: int = 0


def _reset(runner: Runner, leaves: Sequence[torch.Tensor]) -> None:
    for t in (*runner.params, *leaves):
        t.grad = None


def run_step(runner: Runner, args: tuple, kwargs: dict) -> None:
    """One training step (forward, loss, backward) starting with no gradients."""
    _reset(runner, input_leaves(args, kwargs))
    compute_loss(None, runner.module(*args, **kwargs)).backward()


def measure(runner: Runner, args: tuple, kwargs: dict) -> Measurement:
    """Warm up (trace / compile), then one step under :class:`StepTracker`, one under the FLOP counter.

    Returns
    -------
    Measurement
        Gradients of the measured step: the runner's parameters, then the inputs that require grad.
    """
    t0 = time.perf_counter()
    run_step(runner, args, kwargs)
    first_call_s = time.perf_counter() - t0
    compiles = runner.extras.get("compiles", [0])
    compiled_after_warmup = compiles[0]
    leaves = input_leaves(args, kwargs)
    _reset(runner, leaves)
    with StepTracker() as mem:
        compute_loss(None, runner.module(*args, **kwargs)).backward()
    grads = [None if t.grad is None else t.grad.detach().clone() for t in (*runner.params, *leaves)]
    _reset(runner, leaves)
    with StepFlopCounter(display=False) as counter:
        compute_loss(None, runner.module(*args, **kwargs)).backward()
    return Measurement(mem.peak_bytes, counter.get_total_flops(), grads, first_call_s,
                       compiles[0] - compiled_after_warmup)


def time_round_robin(runners: Sequence[Runner], args: tuple, kwargs: dict, rounds: int) -> list[list[float]]:
    """Step seconds of every runner in every round: ``times[runner][round]``.

    Each round times one step of every runner, in the given order on even rounds and reversed on
    odd ones (so no runner always follows the same one: a step that leaves the caches or the
    allocator in some state does not always hand it to the same next runner), and a slow phase of a
    shared machine hits every strategy of that round alike; ratios are best taken round by round
    (:func:`round_ratio`).
    """
    times: list[list[float]] = [[] for _ in runners]
    for k in range(rounds):
        order = range(len(runners)) if k % 2 == 0 else reversed(range(len(runners)))
        for i in order:
            t0 = time.perf_counter()
            run_step(runners[i], args, kwargs)
            times[i].append(time.perf_counter() - t0)
    return times


#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the ceiling of glibc's own mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``)
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse again, as it does in a process started
    without :data:`~remat_compiler.memory.RSS_ENV`, before timing steps in a process that started
    with it (for :class:`~remat_compiler.memory.ResidentPeak`).

    Under ``MALLOC_MMAP_THRESHOLD_=65536`` every buffer of 64 KiB or more is mapped when allocated
    and unmapped when freed, so every step pays the kernel a page fault for each 4 KiB page of every
    buffer it allocates (the benchmark GPT-2: about 49,000 a step, which made a 416 ms step take 535
    ms in one scratch run). A training loop in a process without that setting pays none after its
    first steps: glibc raises its mmap threshold to the largest buffer freed, up to 32 MiB, and
    keeps freed memory in its heap. This sets that state at once: buffers under 32 MiB come from
    the heap, and the heap is not trimmed below 64 MiB of free space. Peaks measured after this call
    are not exact.

    Returns
    -------
    bool
        False where there is no glibc ``mallopt`` (nothing was changed).
    """
    mallopt = glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
                and mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX))


def round_ratio(times: Sequence[float], reference: Sequence[float]) -> float:
    """Median over rounds of ``times[k] / reference[k]``: a step-time ratio robust to load that drifts.

    Example
    -------
    >>> round_ratio([2.0, 20.0, 2.2], [1.0, 10.0, 1.0])
    2.0
    """
    return statistics.median(t / r for t, r in zip(times, reference, strict=True))
