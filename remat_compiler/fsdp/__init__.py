"""Sharded training: remat_compiler on a model sharded with FSDP2's ``fully_shard``.

:func:`remat_compiler.compile` on an FSDP2 model returns an
:class:`~remat_compiler.fsdp.module.FSDPCompiledModule`: the rank's whole step (every unit's
all-gather, the activations, the unsharded gradients, their reduce-scatter, the sharded gradients)
is one traced graph, planned under the per-rank budget, where keeping a unit's gathered
parameters to backward or gathering them again is decided in the same solve as recomputation
(``docs/fsdp.md``).

- :mod:`.units`: the model's ``fully_shard`` units, and what is refused.
- :mod:`.gather`: a unit's all-gather / reduce-scatter as one traced autograd function.
- :mod:`.step`: the step as a module of the rank's shards.
- :mod:`.choices`: each unit's reshard choice in the plan, and the fixed settings as policies.
- :mod:`.module`: the compiled module users train.
"""
from remat_compiler.fsdp.units import Unit, fsdp_units, is_fsdp_model

__all__ = ["Unit", "fsdp_units", "is_fsdp_model", "FSDPCompiledModule", "ShardedStep"]


def __getattr__(name):  # the compiled module imports remat_compiler.api, which dispatches here
    if name == "FSDPCompiledModule":
        from remat_compiler.fsdp.module import FSDPCompiledModule
        return FSDPCompiledModule
    if name == "ShardedStep":
        from remat_compiler.fsdp.step import ShardedStep
        return ShardedStep
    raise AttributeError(name)
