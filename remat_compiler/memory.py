"""Measure what a training step really allocates.

:class:`LiveStorageTracker` is a ``TorchDispatchMode``: every aten op's outputs that do not share
storage with its inputs are new allocations; a weak reference on each storage tells when it is freed.
The peak is the largest sum of live new storage bytes, i.e. the step's peak above what was resident
before it (parameters, inputs and optimizer state are not counted, parameter gradients created in
backward are). Allocator caching and kernel workspaces are not storages and are not counted. With
``allocator=passes.allocator.CUDA_CACHING`` each storage counts the 512-byte blocks CUDA's caching
allocator charges it: on the CPU, a stand-in for ``torch.cuda.max_memory_allocated()`` that measures
in the units a CUDA plan predicts.

:class:`ResidentPeak` sees what the dispatcher does not (Inductor's generated code allocates its
buffers itself): the growth of the process's resident set over a block, from the kernel's high-water
mark (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``). It is exact only where freed memory
goes back to the kernel: run it in a fresh process started with ``MALLOC_MMAP_THRESHOLD_=65536``
(:data:`RSS_ENV`), so every buffer of 64 KiB or more is its own mapping, unmapped when freed; smaller
allocations and first-touched code pages are noise, which a warm-up step before the measured one
removes. Linux only.

:class:`AllocatorPeak` sees every buffer PyTorch's CPU allocator hands out, whoever asks: the
dispatcher's ops, Inductor's generated code, and the temporaries kernels allocate inside themselves.
It reads the allocations and frees the profiler records (``profile_memory=True``) and adds them up in
time order. It is the budget's own quantity (tensor memory; see ``DESIGN.md``, "The memory budget"),
where the resident set also counts the process's other memory (Python objects, malloc's bookkeeping).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveStorageTracker", "measure_step_peak", "ResidentPeak", "AllocatorPeak", "RSS_ENV",
           "release_free_heap", "glibc_function"]

#: The environment a process measuring with :class:`ResidentPeak` must start with (glibc reads it at
#: startup): allocations of 64 KiB or more are mmapped and returned to the kernel when freed.
RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _traced(t: torch.Tensor) -> bool:
    """A tracing tensor (fake, functional or another wrapper subclass): no real storage. A first
    call that traces and plans runs the model on these; they are not the step's memory."""
    if type(t) in _PLAIN:  # the tensors of a step that runs: no subclass to look into
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, (FakeTensor, FunctionalTensor)) or is_traceable_wrapper_subclass(t)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tensors(tree):
    """The tensors in an operator's arguments or results (tensors, and tuples, lists and dicts of
    them and of other values), depth first: what ``pytree.tree_leaves`` finds there, without its cost
    on every operator a tracked step runs."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)
    elif not isinstance(tree, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                               torch.layout)):
        yield from (x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor))


class LiveStorageTracker(TorchDispatchMode):
    """Track live bytes of storages allocated inside the ``with`` block.

    Attributes
    ----------
    current_bytes, peak_bytes : int
        Live new-storage bytes now, and the most at any time, each storage charged as
        ``allocator`` charges it (default: its bytes).
    timeline : list[int]
        ``current_bytes`` after every op (for pictures).

    Example
    -------
    >>> with LiveStorageTracker() as mem:
    ...     loss = model(x).sum(); loss.backward()
    >>> mem.peak_bytes  # doctest: +SKIP
    """

    def __init__(self, record_timeline: bool = False, allocator=None):
        super().__init__()
        self._charged = allocator.charged_bytes if allocator is not None else int
        self.current_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[int] = [] if record_timeline else None
        self._live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current_bytes -= nbytes

    def adopt(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now until it is freed: for memory allocated outside the
        dispatcher (Inductor's generated code calls ``empty_strided`` directly)."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        self._live[key] = self._charged(st.nbytes())
        self.current_bytes += self._live[key]
        weakref.finalize(st, self._free, key)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None  # the inputs' storages, gathered when an output's storage is new to the tracker
        for t in _tensors(out):
            if t.is_meta or _traced(t):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self._live:
                continue
            if inputs is None:
                inputs = {x.untyped_storage()._cdata for x in _tensors((args, kwargs)) if not x.is_meta}
            if key in inputs:
                continue
            nbytes = self._charged(st.nbytes())
            self._live[key] = nbytes
            self.current_bytes += nbytes
            weakref.finalize(st, self._free, key)
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
        if self.timeline is not None:
            self.timeline.append(self.current_bytes)
        return out


def measure_step_peak(step_fn, record_timeline: bool = False) -> LiveStorageTracker:
    """Run ``step_fn()`` (forward + backward) under a tracker and return the tracker."""
    tracker = LiveStorageTracker(record_timeline=record_timeline)
    with tracker:
        step_fn()
    return tracker


def _status_bytes(*fields: str) -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                values[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return values


def glibc_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's function ``name`` with its signature set, or None where there is none (not
    glibc; :func:`release_free_heap`, ``benchmarks.measure.keep_freed_memory``)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def release_free_heap() -> bool:
    """Return the free memory of malloc's heap to the system (glibc's ``malloc_trim(0)``).

    Under :data:`RSS_ENV` only buffers of 64 KiB or more are unmapped when freed; smaller ones stay
    in the heap, resident. A step that reuses them does not grow the resident set, so an earlier
    step's leftovers would hide part of the next step's peak: on the benchmark GPT-2, two eager
    steps before remat_compiler's Inductor step (as ``benchmarks.inductor_peers`` runs them) took
    4.2 MB off its measured growth (50.0 against 54.2 MB, the walk of its code 55.7 MB).

    Returns
    -------
    bool
        False where there is no glibc ``malloc_trim`` (nothing was released).
    """
    trim = glibc_function("malloc_trim", [ctypes.c_size_t])
    if trim is None:
        return False
    trim(0)
    return True


class ResidentPeak:
    """Peak growth of the resident set over the ``with`` block, in bytes.

    On entry it gives malloc's free heap back (:func:`release_free_heap`), so buffers the block
    makes in memory an earlier step freed count too. It also counts memory outside tensor storage:
    on the benchmark GPT-2 planned and run op by op, 62.20 MiB against 60.05 MiB of live tensors;
    under Inductor's code, within 0.2% of them (``benchmarks/RESULTS.md``, session 18).

    Attributes
    ----------
    peak_bytes : int
        The high-water mark of the resident set during the block, less the resident set at its
        start.

    Raises
    ------
    RuntimeError
        On entry, if this process cannot reset its high-water mark (not Linux), or was not started
        with :data:`RSS_ENV` (freed buffers would stay resident and the figure would be wrong).

    Example
    -------
    >>> with ResidentPeak() as rss:          # in a process started with RSS_ENV  # doctest: +SKIP
    ...     step()
    >>> rss.peak_bytes                                                            # doctest: +SKIP
    """

    def __init__(self):
        self.peak_bytes = 0
        self._start = 0

    def __enter__(self) -> "ResidentPeak":
        missing = {k: v for k, v in RSS_ENV.items() if os.environ.get(k) != v}
        if missing:
            raise RuntimeError(f"ResidentPeak needs a process started with {missing} (glibc reads it at "
                               f"startup); run the measurement in a fresh process with that environment")
        if not os.path.exists("/proc/self/clear_refs"):
            raise RuntimeError("ResidentPeak reads Linux's /proc/self: not available on this system")
        gc.collect()
        release_free_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        self._start = _status_bytes("VmRSS")["VmRSS"]
        return self

    def __exit__(self, *exc) -> bool:
        self.peak_bytes = _status_bytes("VmHWM")["VmHWM"] - self._start
        return False


class AllocatorPeak:
    """Peak growth of the bytes PyTorch's CPU allocator has handed out over the ``with`` block.

    Every CPU tensor's storage comes from ``c10``'s allocator, which reports each allocation and
    free to the profiler when it records memory: the dispatcher's ops, Inductor's generated code
    (``empty_strided_cpu``, which :class:`LiveStorageTracker` sees only through
    :func:`remat_compiler.inductor.watch`), and the temporaries a kernel allocates inside itself,
    which no dispatch mode sees. The running sum of those events, in time order, peaks at
    ``peak_bytes``. Frees of storage allocated before the block are not counted, whether the profiler
    knows their size (storage an earlier profiled block allocated) or not (torch warns once that it
    leaves those out), so, as for :class:`LiveStorageTracker`, the figure is what the block
    allocates on top of what was there.
    Memory that is not a tensor's storage (Python objects, malloc's own bookkeeping and
    fragmentation, thread stacks) is not counted: :class:`ResidentPeak` sees that too. Needs no
    special process environment, only that no other profiler is running.

    Attributes
    ----------
    peak_bytes : int
        The most the allocator's live bytes rose above their level at the block's start.
    peak_op : str or None
        The innermost recorded op running when that peak was reached (an aten op, or the compiled
        graph's call for Inductor's own code); None if nothing was allocated.
    allocations : int
        How many allocations the block made.

    Raises
    ------
    RuntimeError
        On exit, if the profiler's records cannot be read on this build of torch.

    Example
    -------
    >>> import torch
    >>> x = torch.randn(256, 256)
    >>> with AllocatorPeak() as mem:
    ...     y = (x @ x).relu()       # the product, then relu's output: both live at relu
    >>> mem.peak_bytes == 2 * x.nbytes
    True
    """

    def __init__(self):
        self.peak_bytes = 0
        self.peak_op: str | None = None
        self.allocations = 0
        self._profiler = None

    def __enter__(self) -> "AllocatorPeak":
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._profiler.__exit__(*exc)
        from torch._C._profiler import _EventType

        results = getattr(getattr(self._profiler, "profiler", None), "kineto_results", None)
        if results is None or not hasattr(results, "experimental_event_tree"):
            raise RuntimeError("AllocatorPeak: this torch's profiler keeps no event tree to read the "
                               "allocator's events from; measure with ResidentPeak instead")
        events = []
        stack = list(reversed(results.experimental_event_tree()))
        while stack:  # depth first, each node's children in the order they were recorded
            node = stack.pop()
            stack.extend(reversed(node.children))
            fields = node.extra_fields
            if node.tag == _EventType.Allocation and fields.device.type == "cpu":
                events.append((node.start_time_ns, len(events), fields.ptr, fields.alloc_size, node))
        events.sort(key=lambda event: event[:2])  # at equal times, in the order recorded
        # A free counts only where the block allocated that storage: a free of storage from before the
        # block has no size to the profiler, and one from an earlier profiled block has, but belongs
        # to the level the block started from. Matched by address (the profiler's allocation_id is
        # None on torch 2.13's CPU events), each free ending the block's allocation at that address.
        mine: set[int] = set()
        live = peak = 0
        at_peak = None
        for _, _, address, nbytes, node in events:
            if nbytes > 0:
                mine.add(address)
                self.allocations += 1
            elif address in mine:
                mine.remove(address)
            else:
                continue
            live += nbytes
            if live > peak:
                peak, at_peak = live, node
        self.peak_bytes = peak
        if at_peak is not None and at_peak.parent is not None:
            self.peak_op = at_peak.parent.name
        return False
