"""The compiled module of an FSDP2 model: :class:`FSDPCompiledModule`, built by
:func:`remat_compiler.compile` when the model was sharded with ``fully_shard``.

It is a :class:`~remat_compiler.api.CompiledModule` of the model's
:class:`~remat_compiler.fsdp.step.ShardedStep` (the step whose inputs are the rank's shards and
whose graph holds every unit's all-gather and reduce-scatter), that presents the FSDP2 model itself
to the user: ``parameters()`` are its DTensor parameters (the optimizer steps them), ``state_dict()``
is FSDP2's (``torch.distributed.checkpoint`` saves and loads it), and after backward each DTensor
parameter has its sharded ``.grad``. Each plan records per unit whether the unit's unsharded
parameters are kept from forward to backward or gathered again (``plan.extras["fsdp_units"]``,
:mod:`remat_compiler.fsdp.choices`).
"""
from __future__ import annotations

import torch

from remat_compiler.api import CompiledModule, PlanSpec, plan_joint
from remat_compiler.runtime import grad_deps
from remat_compiler.trace import annotate_joint
from remat_compiler.fsdp.choices import record_unit_choices
from remat_compiler.fsdp.seeds import FSDPSeeds
from remat_compiler.fsdp.step import ShardedStep

__all__ = ["FSDPCompiledModule"]


class FSDPCompiledModule(CompiledModule):
    """An FSDP2 model that trains with one plan for the rank's whole step (see the module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        Sharded with ``fully_shard`` on its blocks, then on the root.
    spec, hold_outputs, backend :
        As :class:`~remat_compiler.api.CompiledModule` takes them.

    Raises
    ------
    UnsupportedShardingError
        For an FSDP2 setup that is not supported (:func:`~remat_compiler.fsdp.units.fsdp_units`).
    """

    def __init__(self, model: torch.nn.Module, spec: PlanSpec, hold_outputs: bool = True,
                 backend: str = "eager"):
        step = ShardedStep(model)
        super().__init__(step, spec, hold_outputs, backend)
        # the user's module is the FSDP2 model (its DTensor parameters and state dict); the step
        # module is what the compiler traces, held outside the module tree
        del self._modules["_orig_mod"]
        object.__setattr__(self, "_orig_mod", step)
        self.fsdp_module = model
        self._memo = FSDPSeeds(unit_params=tuple(len(u.params) for u in step.units))  # FSDP2's settings known

    @property
    def original(self) -> torch.nn.Module:
        return self.fsdp_module

    def state_dict(self, *args, **kwargs):
        return self.fsdp_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.fsdp_module.load_state_dict(*args, **kwargs)

    @torch._dynamo.disable
    def _step(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.fsdp_module.training:
            self._orig_mod.refresh()  # shards FSDP2 replaced since the last step
        return super()._step(*args, **kwargs)

    def _partition(self, entry, spec: PlanSpec):
        units = self._orig_mod.units

        def partition(joint, _joint_inputs, *, num_fwd_outputs, **_kw):
            planned = plan_joint(annotate_joint(joint, entry.step), num_fwd_outputs, spec, memo=self._memo)
            record_unit_choices(planned, units)
            entry.planned = planned
            entry.grad_deps = grad_deps(planned.cg)
            return planned.fw, planned.bw
        return partition

    def _check_order(self) -> None:
        """Sharded before compiled: the order this class is made for."""
