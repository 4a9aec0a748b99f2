"""The allocator a step's memory is counted in: what one allocation of ``n`` bytes charges.

A plan's budget and peak are in the units of the device's own counter: on the CPU, the live storage
bytes a :class:`remat_compiler.LiveStorageTracker` sees; on CUDA, ``torch.cuda.memory_allocated()``
(its peak over the step: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``).
The two differ because CUDA's caching allocator charges whole blocks, so the passes count every new
storage as :meth:`AllocatorModel.charged_bytes` says (:func:`remat_compiler.passes.storage.annotate_storage`), and
the simulator, CP-SAT's sizes, the plan's peak and the emitted-code walk all read those bytes.

What PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, native backend,
default ``PYTORCH_CUDA_ALLOC_CONF``) charges to ``memory_allocated`` for a request of ``n`` bytes:

- ``n == 0``: nothing (no block is taken);
- otherwise the block it hands out, of ``round_size(n)`` bytes: ``n`` rounded up to a multiple of
  ``kMinBlockSize`` = 512 B, at least 512 B. That is :data:`CUDA_CACHING`, and the model here.

What can make ``memory_allocated`` exceed the sum of rounded sizes, and by how much:

- **an unsplit large-pool block.** A request above 1 MiB (``kSmallSize``) is served from the large
  pool, and a free block larger than the request is split only if the remainder exceeds 1 MiB
  (``should_split``); otherwise the whole block is handed out and charged. A fresh segment is
  ``cudaMalloc``-ed at 20 MiB for requests of 1-10 MiB (always split: the remainder is over 10 MiB)
  and rounded up to 2 MiB (``kRoundLarge``) above 10 MiB, so a fresh request of ``n`` >= 10 MiB is
  charged its 2 MiB round-up whenever that adds at most 1 MiB. The excess is at most 1 MiB per live
  large-pool block (more when a user sets ``max_split_size_mb``: blocks above it are never split
  and serve somewhat smaller requests whole). It is deterministic for a given allocator state (the same cached
  blocks and the same request sequence give the same blocks) but depends on what earlier steps
  left cached, so it is bounded, not predicted: ``measured <= predicted + 1 MiB x (large blocks
  live at the peak)``.
- **configuration**: ``roundup_power2_divisions`` rounds requests to power-of-two divisions instead
  of 512 B; ``expandable_segments:True`` splits large blocks down to 512 B (less excess, not more).
- **allocations the dispatcher does not show**: cuBLAS / cuDNN workspaces (cuBLAS's is taken once
  per handle and stream through the caching allocator and kept: resident after a warm-up step),
  flash/memory-efficient attention's scratch, NCCL buffers. Measure after a warm-up step.

Every other allocator here charges what the storage holds (:data:`EXACT`).

>>> CUDA_CACHING.charged_bytes(1), CUDA_CACHING.charged_bytes(513), CUDA_CACHING.charged_bytes(0)
(512, 1024, 0)
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllocatorModel", "EXACT", "CUDA_CACHING", "ALLOCATORS", "allocator_named", "allocator_for"]


@dataclass(frozen=True)
class AllocatorModel:
    """How many bytes one allocation is charged: a multiple of ``block_bytes``, at least one block.

    Attributes
    ----------
    name : str
        ``"exact"`` or ``"cuda_caching"`` (:data:`ALLOCATORS`).
    block_bytes : int
        The rounding unit (1: exact).
    """

    name: str
    block_bytes: int

    def charged_bytes(self, nbytes: int) -> int:
        """What an allocation of ``nbytes`` is charged (0 for 0 bytes)."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            return 0
        return -(-nbytes // self.block_bytes) * self.block_bytes


#: Storage bytes as they are (the CPU: a dispatch-level tracker counts them so).
EXACT = AllocatorModel("exact", 1)
#: PyTorch's CUDA caching allocator (also ROCm's, the same code hipified): 512-byte blocks.
CUDA_CACHING = AllocatorModel("cuda_caching", 512)
ALLOCATORS = {a.name: a for a in (EXACT, CUDA_CACHING)}


def allocator_named(name: str) -> AllocatorModel:
    """The allocator model called ``name``.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; known: {', '.join(sorted(ALLOCATORS))}")
    return ALLOCATORS[name]


def allocator_for(device_type: str) -> AllocatorModel:
    """The allocator a device's tensors come from: CUDA's caching allocator for ``"cuda"`` (ROCm
    included), exact bytes for every other device."""
    return CUDA_CACHING if device_type == "cuda" else EXACT
