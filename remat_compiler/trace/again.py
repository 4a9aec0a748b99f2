"""AOTAutograd with the partition and the compile tried again on one capture of the step.

:func:`aot_step_again` is ``aot_function`` (the two stages it runs on the first call: capture the joint
graph, then partition and compile it) where a partition or compile that raises one of the ``again``
errors is handed to ``again``, which returns the partition function and compilers of the next try;
that try partitions a copy of the joint graph captured the first time, as it was before anything ran
on it, so the step is traced once however many times it is planned. The Inductor backend re-plans
this way when Inductor's code for a plan peaks above the budget
(:func:`remat_compiler.inductor.backend.first_call`; on the test GPT-2 with one forced re-plan, the
first call took a median 18.8 s against 20.2 s when the re-plan traced again, four interleaved pairs;
``python -m benchmarks.replan``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch.utils._pytree as pytree

from remat_compiler.trace import copy_graph_module

__all__ = ["aot_step_again", "sizes_as_nodes"]


def aot_step_again(step: Callable, partition_fn: Callable, *, fw_compiler: Callable, bw_compiler: Callable,
                   decompositions: dict | None, again: Callable, errors: tuple, enable_log: bool) -> Callable:
    """``aot_function(step, ...)`` whose partition and compile are tried again, without tracing again.

    Parameters
    ----------
    step, partition_fn, fw_compiler, bw_compiler, decompositions, enable_log :
        As for ``aot_function``.
    again : callable
        ``again(exc)`` for an ``errors`` exception raised while partitioning or compiling: returns the
        next try's ``(partition_fn, fw_compiler, bw_compiler)``, or raises (the call then raises it).
    errors : tuple of exception types

    Returns
    -------
    callable
        Called like the step; its first call captures, partitions and compiles, later calls run.
    """
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput
    from torch._functorch._aot_autograd.graph_compile import aot_stage1_graph_capture, aot_stage2_compile
    from torch._functorch.aot_autograd import (AOT_COUNTER, AOTConfig, construct_fake_mode, create_aot_state,
                                               create_tree_flattened_fn, process_inputs)

    config = AOTConfig(fw_compiler=None, bw_compiler=None, inference_compiler=None, partition_fn=None,
                       decompositions=decompositions, num_params_buffers=0, aot_id=next(AOT_COUNTER),
                       keep_inference_input_mutations=False, dynamic_shapes=False,
                       aot_autograd_arg_pos_to_source=None, is_export=False, no_tangents=False,
                       enable_log=enable_log, disable_functionalization=False,
                       _disable_torch_fn_metadata_mode=False)
    compiled: list = []

    def run(*args, **kwargs):
        flat_args = pytree.arg_tree_leaves(*args, **kwargs)
        if not compiled:
            flat_fn, out_spec = create_tree_flattened_fn(step, args, kwargs)
            fake_mode, shape_env = construct_fake_mode(flat_args, config)
            fake_args, act_input_indices = process_inputs(flat_args, config, fake_mode, shape_env)
            descs = [PlainAOTInput(i) for i in range(len(fake_args))]
            with contextlib.ExitStack() as stack:
                state = create_aot_state(stack, flat_fn, fake_args, descs, config, fake_mode, shape_env)
                state.fw_metadata.act_input_indices = act_input_indices
                captured = aot_stage1_graph_capture(state, flat_fn)
                sizes_as_nodes(captured.graph_module)
                joint = copy_graph_module(captured.graph_module)  # as captured: the first try's passes rewrite it
                metadata = _copied(state.fw_metadata)  # as captured: stage 2 records the try's saved values in it
                partition, fw, bw = partition_fn, fw_compiler, bw_compiler
                while True:
                    try:
                        fn, _ = aot_stage2_compile(state, captured, partition, fw, bw, fw)
                        break
                    except errors as exc:
                        partition, fw, bw = again(exc)
                        captured = dataclasses.replace(captured, graph_module=copy_graph_module(joint))
                        state.fw_metadata = _copied(metadata)
            compiled.append((fn, out_spec))
        fn, out_spec = compiled[0]
        return out_spec.unflatten(fn(flat_args))

    return run


def _copied(metadata):
    """A copy of AOTAutograd's metadata of the step with containers of its own: stage 2 adds to them
    (``dynamic_saved_tensors_idxs``: which saved values have symbolic sizes, by position), so a try
    after one that saved other values must start from them as captured."""
    import copy

    out = copy.copy(metadata)
    for name, value in vars(metadata).items():
        if isinstance(value, (dict, list, set)):
            setattr(out, name, copy.copy(value))
    return out


def sizes_as_nodes(gm) -> None:
    """Give each size symbol of ``gm``'s inputs a node (``aten.sym_size.int`` of the first input
    dimension it sizes), placed after the inputs, as Dynamo's graphs have theirs as inputs.

    AOTAutograd's pass turning Python float arithmetic on sizes into tensor ops
    (``tensorify_python_scalars``, run on the joint graph before it is partitioned) reads each symbol
    from such a node: over symbolic sizes with Inductor's decompositions (``mse_loss``'s backward
    scales by ``2 / numel``), it failed with ``KeyError: s10`` without them. Nodes nothing reads are
    removed by that pass; a graph of static sizes is left as it is."""
    import torch
    import sympy

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not placeholders:
        return
    named = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" and isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            named.add(val.node.expr)
    with gm.graph.inserting_after(placeholders[-1]):
        for node in placeholders:
            val = node.meta.get("val")
            for dim, size in enumerate(getattr(val, "shape", ())):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) \
                        and size.node.expr not in named:
                    named.add(size.node.expr)
                    gm.graph.call_function(torch.ops.aten.sym_size.int, (node, dim)).meta["val"] = size
