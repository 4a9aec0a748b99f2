"""Inductor's one-time set-up of a process, begun while the first call traces and plans.

Before its first C++ kernel, Inductor probes which vector instruction sets the CPU and compiler
support by building and running a small program for each (``torch._inductor.cpu_vec_isa``): four
builds, 14 to 17 s one after the other on this project's 2-core machine with an empty Inductor
cache (3.6 s with a warm one), once per process. Nothing of it depends on the step, so the backend
starts it when its first call begins, on two threads (the builds are subprocesses: the GIL is free
meanwhile) at the lowest priority, and :func:`ready` waits for it before the first graph is compiled:
the probe takes the cores the trace and the solve leave idle, instead of running after them.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["start", "ready"]

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _lowest_priority() -> None:
    """This thread and the compilers it starts at the lowest priority (on Linux niceness is a
    thread's, inherited by the processes it starts)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _probe() -> None:
    _lowest_priority()
    try:
        from torch._inductor import cpu_vec_isa

        # the instruction sets the CPU reports, each built apart (Inductor's own list and test, each
        # answer cached on its instance) two at a time; then Inductor's pick reads those answers
        if hasattr(cpu_vec_isa, "x86_isa_checker") and hasattr(cpu_vec_isa, "supported_vec_isa_list"):
            flags = cpu_vec_isa.x86_isa_checker()
            candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                          if all(flag in flags for flag in str(isa).split())]
            with ThreadPoolExecutor(max_workers=2, initializer=_lowest_priority) as pool:
                list(pool.map(bool, candidates))
        cpu_vec_isa.pick_vec_isa()
    except Exception:  # noqa: BLE001 - the compile probes again and reports what fails there
        pass


def start() -> None:
    """Begin the probe on a daemon thread, once per process (later calls do nothing)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_probe, name="remat-compiler-inductor-probe", daemon=True)
            _thread.start()


def ready() -> None:
    """Wait for the probe :func:`start` began, if any (the compile would otherwise probe again)."""
    thread = _thread
    if thread is not None:
        thread.join()
