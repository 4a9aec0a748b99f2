"""The compiled module of an FSDP2 model: :class:`FSDPCompiledModule`, built by
:func:`remat_compiler.compile` when the model was sharded with ``fully_shard``.

It is a :class:`~remat_compiler.module.CompiledModule` of the model's
:class:`~remat_compiler.fsdp.step.ShardedStep` (the step whose inputs are the rank's shards and
whose graph holds every unit's all-gather and reduce-scatter), that presents the FSDP2 model itself
to the user: ``parameters()`` are its DTensor parameters (the optimizer steps them), ``state_dict()``
is FSDP2's (``torch.distributed.checkpoint`` saves and loads it), and after backward each DTensor
parameter has its sharded ``.grad``. Each plan records per unit whether the unit's unsharded
parameters are kept from forward to backward or gathered again (``plan.extras["fsdp_units"]``,
:mod:`remat_compiler.fsdp.choices`).
"""
from __future__ import annotations

import warnings

import torch

from remat_compiler.module import CompiledModule
from remat_compiler.pipeline import PlanSpec, plan_joint
from remat_compiler.runtime import grad_deps
from remat_compiler.trace import annotate_joint
from remat_compiler.fsdp.choices import record_unit_choices
from remat_compiler.fsdp.seeds import FSDPSeeds
from remat_compiler.fsdp.step import ShardedStep

__all__ = ["FSDPCompiledModule", "GradientSyncWarning"]


class GradientSyncWarning(UserWarning):
    """``set_requires_gradient_sync(False)`` on a compiled FSDP2 model: the compiled step still
    reduce-scatters (see :meth:`FSDPCompiledModule._step`)."""


class FSDPCompiledModule(CompiledModule):
    """An FSDP2 model that trains with one plan for the rank's whole step (see the module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        Sharded with ``fully_shard`` on its blocks, then on the root.
    spec, hold_outputs, backend :
        As :class:`~remat_compiler.module.CompiledModule` takes them.

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
        self._sync_warned = False

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
            self._warn_if_sync_is_off()
        return super()._step(*args, **kwargs)

    def _warn_if_sync_is_off(self) -> None:
        """The plan's graph reduce-scatters every unit's gradient in each backward; a micro-batch
        under ``set_requires_gradient_sync(False)`` is not a graph of its own. The step still adds
        each micro-batch's reduced shard into ``.grad``, so the sums FSDP2 would reduce at the sync
        step are the same (allclose: the reduction is linear); what differs is that every micro-batch
        communicates. Said once per module."""
        off = [u.path or "(root)" for u in self._orig_mod.units
               if u.group is not None and not (u.group.reduce_grads and u.group.all_reduce_grads)]
        if off and not self._sync_warned:
            self._sync_warned = True
            warnings.warn(
                f"set_requires_gradient_sync(False) is not honoured by the compiled step (FSDP units "
                f"{', '.join(off)}): each micro-batch's gradients are reduce-scattered and added to the "
                f"sharded .grad, which sums to what FSDP2 reduces at the sync step, at the cost of one "
                f"reduce-scatter per micro-batch. To skip that communication, accumulate with the FSDP2 "
                f"model itself (uncompiled) or use larger micro-batches", GradientSyncWarning, stacklevel=4)

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
