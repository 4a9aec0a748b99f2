"""The FSDP2 units of a model sharded with ``fully_shard``, as the compiled step gathers them.

A unit is one ``fully_shard`` call's parameter group: its parameters, each sharded on dim 0 over
the unit's process group and padded so that every rank holds the same number of rows
(``FSDPParam._sharded_param_data``, 1-D). The compiled step takes those padded shards as its inputs
and all-gathers each unit's in one collective (:mod:`remat_compiler.fsdp.gather`), as FSDP2 does.

:func:`fsdp_units` reads the units and refuses, with an :class:`UnsupportedShardingError` that says
what to do, the FSDP2 setups the compiled step does not reproduce: parameters outside every unit,
HSDP and 2-D meshes (FSDP over a tensor-parallel DTensor), units over different process groups or
over a group other than the whole job, sharding on a dim other than 0, CPU offload, custom
all-gather / reduce-scatter, and tensor-subclass all-gather extensions (float8).

>>> units = fsdp_units(model)                                  # doctest: +SKIP
>>> [(u.path, len(u.params)) for u in units]                   # doctest: +SKIP
[('layers.0', 9), ('layers.1', 9), ('', 3)]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from remat_compiler.errors import UnsupportedShardingError

__all__ = ["UnitParam", "Unit", "fsdp_units", "is_fsdp_model", "refuse_sharded_after"]


@dataclass
class UnitParam:
    """One sharded parameter of a unit.

    Attributes
    ----------
    fsdp_param : FSDPParam
        FSDP2's record (the DTensor parameter, its padded shard, sizes).
    names : tuple[str, ...]
        Its dotted names in the model (more than one where modules share it).
    module, attr : nn.Module, str
        Where it is registered (and ``shared``: the other ``(module, attr)`` places).
    """

    fsdp_param: object
    names: tuple[str, ...]
    places: tuple[tuple[torch.nn.Module, str], ...]

    @property
    def padded_numel(self) -> int:
        return self.fsdp_param._sharded_param_data.numel()

    @property
    def orig_size(self) -> torch.Size:
        return self.fsdp_param._orig_size

    @property
    def padded_rows(self) -> int:
        return self.fsdp_param.padded_sharded_param_size[0]


@dataclass
class Unit:
    """One ``fully_shard`` unit: its module path (``""`` for the root), the module whose forward
    hooks gather it, FSDP2's state and parameter group, and its parameters in FSDP2's order (a
    unit without parameters of its own, a root over sharded blocks, has no group and none)."""

    path: str
    module: torch.nn.Module
    state: object
    group: object
    params: list[UnitParam]

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group.mesh_info.shard_process_group

    @property
    def world(self) -> int:
        return self.group.mesh_info.shard_mesh_size

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.group.mp_policy.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.group.mp_policy.reduce_dtype

    @property
    def divide_factor(self) -> float:
        """What the summed gradient is divided by: FSDP2's ``gradient_divide_factor``, else the
        world size (the mean over data-parallel ranks, FSDP2's default)."""
        factor = self.group.gradient_divide_factor
        return float(self.world if factor is None else factor)

    @property
    def label(self) -> str:
        return self.path or "(root)"


def is_fsdp_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a module inside it was sharded with FSDP2's ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


_ORDER = ("shard blocks then the root, then compile: for block in model.layers: fully_shard(block); "
          "fully_shard(model); m = remat_compiler.compile(model, memory_budget=...)")


def fsdp_units(model: torch.nn.Module) -> list[Unit]:
    """The units of an FSDP2 model, innermost first, those without parameters of their own included
    (their forward hooks are FSDP2's too).

    Raises
    ------
    UnsupportedShardingError
        For a setup the compiled step does not reproduce (see the module docstring), naming it and
        what to do instead.
    """
    if not isinstance(model, FSDPModule):
        raise UnsupportedShardingError(
            f"the model's root ({type(model).__name__}) is not sharded, but modules inside it are: "
            f"FSDP2 needs a root unit that owns the step. {_ORDER}")
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    units, seen = [], set()
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:  # fully_shard([a, b]): one state for several modules
            continue
        seen.add(id(state))
        if len(getattr(state, "_modules", (module,))) > 1:
            raise UnsupportedShardingError(
                f"fully_shard over several modules at once ({path or '(root)'}) is not supported: "
                f"shard each module with its own fully_shard call")
        group = state._fsdp_param_group  # None: no parameters of its own (a root over sharded blocks)
        params = [UnitParam(fp, _names(fp, paths), _places(fp)) for fp in group.fsdp_params] if group else []
        units.append(Unit(path, module, state, group, params))
    _check_units(model, units)
    units.sort(key=lambda u: -u.path.count(".") - (u.path != ""))
    return units


def _names(fp, paths: dict) -> tuple[str, ...]:
    info = fp._module_info
    mods = [info.module, *info.shared_modules]
    attrs = [info.param_name, *info.shared_param_names]
    return tuple(".".join(x for x in (paths[id(m)], a) if x) for m, a in zip(mods, attrs))


def _places(fp) -> tuple:
    info = fp._module_info
    return tuple(zip([info.module, *info.shared_modules], [info.param_name, *info.shared_param_names]))


def _check_units(model: torch.nn.Module, units: list[Unit]) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    managed = {id(up.fsdp_param.sharded_param) for u in units for up in u.params}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in managed:
            raise UnsupportedShardingError(
                f"parameter {name!r} is not sharded by any fully_shard unit (a plain tensor beside "
                f"FSDP2's DTensor parameters, or one FSDP2 ignores): the compiled step gathers every "
                f"parameter by its unit. Apply fully_shard to a module that holds it (the root, last), "
                f"or compile the model without FSDP2")
    groups = set()
    for u in units:
        if not u.params:  # its hooks only (root setup, the casts of its mixed-precision policy)
            continue
        info = u.group.mesh_info
        if isinstance(info, HSDPMeshInfo) or info.mesh.ndim != 1:
            raise UnsupportedShardingError(
                f"unit {u.label} is sharded over a {info.mesh.ndim}-D mesh {tuple(info.mesh.shape)} "
                f"(HSDP or FSDP with tensor parallelism): remat_compiler plans FSDP2 over a 1-D mesh "
                f"only. Shard with fully_shard(..., mesh=init_device_mesh(device, (world_size,))) or "
                f"leave mesh= out")
        for up in u.params:
            fp = up.fsdp_param
            if fp.is_dtensor:
                raise UnsupportedShardingError(
                    f"parameter {up.names[0]!r} was already a DTensor (tensor parallel) when "
                    f"fully_shard sharded it: FSDP over TP is a 2-D layout that remat_compiler does "
                    f"not plan. Shard plain parameters over a 1-D mesh")
            if fp.fsdp_placement.dim != 0:
                raise UnsupportedShardingError(
                    f"parameter {up.names[0]!r} is sharded on dim {fp.fsdp_placement.dim} "
                    f"(shard_placement_fn): the compiled step gathers dim-0 shards only. Leave "
                    f"shard_placement_fn out")
            if fp.offload_to_cpu:
                raise UnsupportedShardingError(
                    f"unit {u.label} offloads its parameters to the CPU (CPUOffloadPolicy), which "
                    f"the compiled step does not reproduce: shard without offload_policy")
            if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                raise UnsupportedShardingError(
                    f"parameter {up.names[0]!r} is a tensor subclass with its own all-gather "
                    f"(fsdp_pre_all_gather, as float8 training uses): not supported; shard plain "
                    f"parameters")
        if type(u.group._all_gather_comm) is not DefaultAllGather or \
                type(u.group._reduce_scatter_comm) is not DefaultReduceScatter:
            raise UnsupportedShardingError(
                f"unit {u.label} has a custom all-gather or reduce-scatter (set_custom_all_gather / "
                f"set_custom_reduce_scatter / symmetric memory): the compiled step issues its own "
                f"functional collectives. Leave them at FSDP2's defaults")
        dtypes = {up.fsdp_param._sharded_param_data.dtype for up in u.params}
        if u.param_dtype is None and len(dtypes) > 1:
            raise UnsupportedShardingError(
                f"unit {u.label} mixes parameter dtypes {sorted(map(str, dtypes))} without a "
                f"MixedPrecisionPolicy param_dtype: gather it in one dtype (a MixedPrecisionPolicy, or "
                f"one dtype for the unit's parameters)")
        groups.add(u.process_group)
    if len(groups) > 1:
        raise UnsupportedShardingError(
            "the model's units are sharded over different process groups (different meshes passed to "
            "fully_shard): remat_compiler plans one step over one group. Pass the same mesh to every "
            "fully_shard call")
    if groups and dist.is_initialized():
        group = next(iter(groups))
        if dist.get_world_size(group) != dist.get_world_size():
            raise UnsupportedShardingError(
                f"the model is sharded over {dist.get_world_size(group)} of the job's "
                f"{dist.get_world_size()} ranks: remat_compiler plans FSDP over the whole job (every "
                f"rank runs rank 0's plan). Shard over a mesh of all ranks")


def refuse_sharded_after(compiled: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedShardingError` for a compiled module that ``fully_shard`` was
    applied to, or whose model it sharded inside, after :func:`remat_compiler.compile`: FSDP2's
    hooks would gather and reduce around a step that was planned without them."""
    if isinstance(compiled, FSDPModule) or is_fsdp_model(compiled._orig_mod):
        raise UnsupportedShardingError(
            "fully_shard was applied after remat_compiler.compile (fully_shard(compile(model))): "
            "FSDP2's hooks would gather and free parameters around a step planned without them. "
            "Use the other order: " + _ORDER)
