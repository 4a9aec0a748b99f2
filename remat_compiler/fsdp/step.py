"""The rank's whole FSDP2 step as one module whose parameters are the rank's padded shards.

:class:`ShardedStep` wraps a model sharded with ``fully_shard``. Its own parameters are the
rank's padded shards of every unit (``FSDPParam._sharded_param_data``, sharing their storage: the
optimizer's steps on the DTensor parameters are seen here), its buffers are the model's, and its
forward runs the model with FSDP2's forward hooks set aside and hooks of its own in their place:
at each unit's entry the unit's shards are all-gathered (:class:`~remat_compiler.fsdp.gather.GatherUnit`)
and its unsharded parameters put in the modules, with FSDP2's input cast of the mixed-precision
policy; at its exit the DTensor parameters go back and the output is cast as the policy says.
Traced by the compiler, this is the step's joint graph with every unit's all-gather and
reduce-scatter in it, so the plan covers them.

The shards' gradients (the reduce-scatter's outputs) reach the shard parameters; a hook then hands
each to its DTensor parameter as ``.grad`` (a sharded DTensor, a view of the reduced gradient, as
FSDP2 leaves it) and clears the shard's, so the optimizer and ``torch.distributed.checkpoint`` see
the model they expect.
"""
from __future__ import annotations

import contextlib

import torch

from remat_compiler.fsdp.gather import GatherSpec, GatherUnit, unsharded_params
from remat_compiler.fsdp.units import Unit, fsdp_units

__all__ = ["ShardedStep", "shard_name"]


def shard_name(unit_index: int, param_index: int) -> str:
    """The name of a shard parameter of :class:`ShardedStep`: ``u<unit>_p<param>``."""
    return f"u{unit_index}_p{param_index}"


class ShardedStep(torch.nn.Module):
    """The step of an FSDP2 model as a module of its shards (see the module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        Sharded with ``fully_shard`` (blocks, then the root).
    gloo : bool, optional
        Whether the gathers and reduce-scatters are written in gloo's form (all-to-alls, see
        :mod:`remat_compiler.fsdp.gather`); default: where the unit's group has a gloo backend.

    Raises
    ------
    UnsupportedShardingError
        For an FSDP2 setup that is not supported (:func:`~remat_compiler.fsdp.units.fsdp_units`).
    """

    def __init__(self, model: torch.nn.Module, *, gloo: bool | None = None):
        super().__init__()
        self.units: list[Unit] = fsdp_units(model)
        self.model = model
        self._specs = [GatherSpec.of(u, gloo=gloo) if u.params else None for u in self.units]
        self._sources: dict[str, torch.Tensor] = {}
        self.refresh()

    # training mode is the model's: model.eval() / model.train() on the FSDP2 model count here too
    @property
    def training(self) -> bool:
        model = self.__dict__.get("_modules", {}).get("model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_modules", {}).get("model")
        if model is not None and model.training != mode:
            model.train(mode)

    # the shards are this module's parameters; the model's DTensor parameters are not
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return super().named_parameters(prefix, recurse=False, remove_duplicate=remove_duplicate)

    def refresh(self) -> None:
        """Point each shard parameter at its FSDP2 shard again where FSDP2 replaced it
        (``load_state_dict(assign=True)``, ``model.to(...)``): ``reset_sharded_param`` as FSDP2's
        lazy init does, then a new shard parameter for a moved shard."""
        for i, unit in enumerate(self.units):
            for j, up in enumerate(unit.params):
                fp, name = up.fsdp_param, shard_name(i, j)
                fp.reset_sharded_param()
                data = fp._sharded_param_data
                if self._sources.get(name) is data:
                    continue
                shard = torch.nn.Parameter(data, requires_grad=fp.sharded_param.requires_grad)
                if shard.requires_grad:
                    shard.register_post_accumulate_grad_hook(_to_dtensor_grad(fp))
                self._sources[name] = data
                self.register_parameter(name, shard)

    def forward(self, *args, **kwargs):
        if not (torch.is_grad_enabled() and self.training):
            return self.model(*args, **kwargs)  # FSDP2 as it is
        with self._gathering_hooks():
            return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def _gathering_hooks(self):
        """FSDP2's forward hooks set aside, gathering hooks in their place, for one forward."""
        stashed, handles = [], []
        try:
            for i, unit in enumerate(self.units):
                stashed.append(_stash_fsdp_hooks(unit))
                handles.append(unit.module.register_forward_pre_hook(self._enter(i), prepend=True,
                                                                     with_kwargs=True))
                handles.append(unit.module.register_forward_hook(self._exit(i), always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for unit, saved in zip(self.units, stashed):
                _restore_hooks(unit.module, saved)
            for unit in self.units:  # a forward that raised leaves no unsharded tensor in the model
                _put(unit, [up.fsdp_param.sharded_param for up in unit.params])

    def _enter(self, i: int):
        unit, spec = self.units[i], self._specs[i]
        shards = [shard_name(i, j) for j in range(len(unit.params))]

        def hook(module, args, kwargs):
            if shards:
                with _traced_as_part_of(self, module):
                    gathered = GatherUnit.apply(spec, *(getattr(self, n) for n in shards))
                _put(unit, unsharded_params(gathered, unit))
            return unit.state._cast_forward_inputs(args, kwargs)
        return hook

    def _exit(self, i: int):
        unit = self.units[i]

        def hook(module, args, output):
            _put(unit, [up.fsdp_param.sharded_param for up in unit.params])
            return unit.state._cast_output_dtype(output)
        return hook


@contextlib.contextmanager
def _traced_as_part_of(step: "ShardedStep", module: torch.nn.Module):
    """While the step is traced, record the nodes made here (a unit's all-gather, and so its
    reduce-scatter in backward) as its module's, whose forward pre-hook this runs in before the
    trace's own: a unit that is a repeated layer then holds its gather, so identical layers stay
    identical with it and the block methods of the solve decide its re-gather with its layer's
    recomputation (:mod:`remat_compiler.graph.blocks`)."""
    from torch.fx import traceback as fx_traceback

    from remat_compiler.passes.keys import TRACE_MODULE, TRACE_MODULE_CLASS

    meta = fx_traceback.current_meta
    old = meta.get("custom")
    tracing = old is not None and TRACE_MODULE in old  # by remat_compiler.trace
    path = next((name for name, m in step.named_modules() if m is module), None) if tracing else None
    if path is None:
        yield
        return
    meta["custom"] = {**old, TRACE_MODULE: path, TRACE_MODULE_CLASS: type(module).__name__}
    try:
        yield
    finally:
        meta["custom"] = old


def _put(unit: Unit, tensors) -> None:
    """Register ``tensors`` as the unit's parameters in their modules (FSDP2's own way: straight
    into ``_parameters``, as ``unsafe_setattr_param`` does)."""
    for up, t in zip(unit.params, tensors):
        for module, attr in up.places:
            module._parameters[attr] = t


def _hook_ids(unit: Unit) -> set[int]:
    state = unit.state
    return {h.id for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle) if h is not None}


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def _stash_fsdp_hooks(unit: Unit) -> dict:
    """Take FSDP2's forward hooks off the unit's module; return the hook dicts as they were."""
    ids, module = _hook_ids(unit), unit.module
    saved = {name: list(getattr(module, name).items()) for name in _HOOK_DICTS}
    for name in _HOOK_DICTS:
        for k in ids & set(getattr(module, name)):
            del getattr(module, name)[k]
    return saved


def _restore_hooks(module: torch.nn.Module, saved: dict) -> None:
    for name, items in saved.items():
        d = getattr(module, name)
        d.clear()
        d.update(items)


def _to_dtensor_grad(fp):
    """The hook that moves a shard parameter's accumulated gradient to its DTensor parameter."""
    def hook(shard: torch.nn.Parameter) -> None:
        grad, shard.grad = shard.grad, None
        local = grad.view(fp.padded_sharded_param_size).narrow(0, 0, fp.sharded_size[0])
        param = fp.sharded_param
        if param.grad is None:
            param.grad = fp.to_sharded_dtensor(local)
        else:
            param.grad._local_tensor.add_(local)
    return hook
