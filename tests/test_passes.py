"""The pass list: run_passes runs PASSES in order, dumps each step, and writes only keys of passes.keys."""
from __future__ import annotations

import torch

from remat_compiler.examples.models import MLPChain
from remat_compiler.passes import PASSES, keys, run_passes
from remat_compiler.trace import trace


def _documented_keys() -> set[str]:
    return {getattr(keys, name) for name in keys.__all__ if name != "PREFIX"}


def test_run_passes_dumps_every_pass_and_writes_only_documented_keys(tmp_path):
    traced = trace(MLPChain(16, 3), (torch.randn(4, 16),))
    gm = run_passes(traced.joint, num_fwd_outputs=traced.num_fwd_outputs, dump_dir=tmp_path / "dump")
    assert gm is traced.joint  # in place, as documented
    names = [p.name for p in PASSES]
    assert names[0] == "eliminate_dead_code" and len(set(names)) == len(names)
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == \
        [f"{i:02d}_{name}.txt" for i, name in enumerate(names)]
    last = (tmp_path / "dump" / f"{len(names) - 1:02d}_{names[-1]}.txt").read_text()
    assert f"{keys.BLOCK_CONTAINER} = 'layers'" in last
    documented = _documented_keys()
    written = {k for n in gm.graph.nodes for k in n.meta if k.startswith(keys.PREFIX)}
    written |= {k for k in gm.meta if k.startswith(keys.PREFIX)}
    written |= {k for n in gm.graph.nodes for k in (n.meta.get("custom") or {}) if k.startswith(keys.PREFIX)}
    assert written <= documented, written - documented
    assert {n.meta[keys.BLOCK] for n in gm.graph.nodes} >= {"layers.0", "layers.1", "layers.2"}


def test_device_presets_give_each_accelerators_roofline():
    """Named presets carry the vendors' dense bf16 rate, bandwidth and capacity; the runtime estimate
    of a pointwise op follows the memory bandwidth."""
    import pytest
    import torch.nn as nn

    import remat_compiler as rc
    from remat_compiler.passes.costs import DEVICE_PRESETS, CostModel

    h100 = CostModel.preset("H100")
    assert (h100.compute_flops_per_s, h100.memory_bytes_per_s, h100.memory_capacity_bytes) == \
        (989e12, 3.35e12, 80 * 10 ** 9)
    assert CostModel.preset("mi300x").memory_capacity_bytes == 192 * 10 ** 9
    assert set(DEVICE_PRESETS) == {"h100", "h200", "a100", "mi300x"}
    with pytest.raises(ValueError, match="known: a100, h100, h200, mi300x"):
        CostModel.preset("tpu")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(256, 256), nn.Tanh()), torch.randn(128, 256)
    runtimes = {}
    for name in ("h100", "a100"):
        _, cg = rc.analyze(model, (x,), cost_model=CostModel.preset(name))
        runtimes[name] = {cg.attr(n, "op"): cg.attr(n, "runtime_s") for n in cg.fw_order}
    assert runtimes["a100"]["aten.tanh.default"] == pytest.approx(
        runtimes["h100"]["aten.tanh.default"] * 3.35 / 2.039, rel=1e-9)


class _TwoMasks(torch.nn.Module):
    """Builds one causal mask twice from positions (as a traced decoder's mask code does), draws two
    random integers alike, applies one Linear twice, and has a sub-module that builds the mask again."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.inner = _Causal()

    def forward(self, x):
        n = x.shape[1]
        first = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        second = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        scores = self.lin(x) @ self.lin(x).transpose(-1, -2)
        a = scores.masked_fill(~first, -1e9).softmax(-1)
        b = scores.masked_fill(~second, -1e9).softmax(-1)
        jitter = torch.randint(1, 4, (n,)) * torch.randint(1, 4, (n,))  # two draws, not one squared
        second_position = torch.arange(n)[1:2]  # a view of a repeated arange, itself written once
        return (a * jitter * second_position + b + self.inner(scores)).sum()


class _Causal(torch.nn.Module):
    def forward(self, scores):
        n = scores.shape[-1]
        return scores.masked_fill(~(torch.arange(n)[None, :] <= torch.arange(n)[:, None]), 0.0)


def test_repeated_index_work_is_merged_within_a_module_and_nothing_else_is():
    """The mask's arange, comparison and inversion exist once in the top module (they were written
    twice there); the sub-module keeps its own; the two Linear calls and the two random draws stay
    two; the step's gradients are eager's."""
    import remat_compiler
    from remat_compiler.passes import merge_repeated_index_work

    torch.manual_seed(0)
    model, x = _TwoMasks(), torch.randn(2, 6, 8)
    traced = trace(model, (x,))
    gm = traced.joint
    before = {n.name for n in gm.graph.nodes}
    merge_repeated_index_work(gm, num_fwd_outputs=traced.num_fwd_outputs)
    merged = before - {n.name for n in gm.graph.nodes}

    def count(op: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for n in gm.graph.nodes:
            if n.op == "call_function" and op in str(n.target):
                module = (n.meta.get("custom") or {}).get(keys.TRACE_MODULE)
                found[module] = found.get(module, 0) + 1
        return found

    assert merged and all(name.startswith(("arange", "iota", "unsqueeze", "le", "bitwise_not", "add"))
                          for name in merged), merged
    assert count("arange") == {"": 1, "inner": 1}
    assert count("aten.le") == {"": 1, "inner": 1}
    assert sum(count("aten.addmm").values()) == 2  # the Linear's two calls: float work, not merged
    assert count("randint") == {"": 2}  # from constants alone, but random draws are never merged
    # a view of a merged-away arange shares the storage of the arange that replaced it
    annotated = run_passes(trace(model, (x,)).joint, num_fwd_outputs=traced.num_fwd_outputs)
    views = [n for n in annotated.graph.nodes if getattr(n.target, "is_view", False)]
    assert any(n.target is torch.ops.aten.slice.Tensor for n in views)
    assert all(n.meta[keys.STORAGE] != n.name and n.meta[keys.BYTES] == 0 for n in views), \
        [(n.name, n.meta[keys.STORAGE]) for n in views]
    again = {n.name for n in gm.graph.nodes}
    merge_repeated_index_work(gm, num_fwd_outputs=traced.num_fwd_outputs)
    assert {n.name for n in gm.graph.nodes} == again  # nothing left to merge

    torch.manual_seed(1)
    reference = _TwoMasks()
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(2)
    reference(x).backward()
    m = remat_compiler.compile(model, memory_budget=0.9, time_limit_s=2)
    torch.manual_seed(2)
    m(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name


def test_a_grouped_matmul_costs_what_the_loop_of_its_groups_matmuls_costs():
    """Tokens by experts' weights, and the weight gradient whose groups run along the tokens: each
    token meets one expert's matrix, so the FLOPs are those of one mm per expert over its tokens
    (the weight gradient was once counted once per expert over every token)."""
    from remat_compiler.passes.costs import grouped_mm_flops

    tokens, k, n, rows = 16, 8, 12, [3, 4, 9]
    per_expert = sum(2 * r * k * n for r in rows)
    assert grouped_mm_flops((tokens, k), (len(rows), k, n), (tokens, n)) == per_expert
    assert grouped_mm_flops((k, tokens), (tokens, n), (len(rows), k, n)) == per_expert
    assert grouped_mm_flops((len(rows), 5, k), (len(rows), k, n), (len(rows), 5, n)) == len(rows) * 2 * 5 * k * n


def test_a_collective_is_charged_the_bytes_a_rank_sends():
    """On 4 ranks a ring all-gather sends 3 times its shard, a reduce-scatter and an all-to-all 3/4 of
    their input, an all-reduce twice that; the gloo gather (an all-to-all of the shard repeated 4
    times) is charged what the all-gather of that shard is, and the MoE layer's all-to-all with split
    sizes 3/4 of its buffer (its split tensors are not data), an argument passed by keyword as one
    passed in place. A charge of the input's bytes would make the all-gather 3 times too cheap and
    the all-to-all 4/3 too dear. Where the group is not in the process: the input's bytes, said."""
    import pytest
    import torch.distributed as dist
    import torch.fx as fx

    import remat_compiler.moe._uneven  # noqa: F401 - registers remat::all_to_all_uneven
    from remat_compiler.fsdp.planning import fake_process_group
    from remat_compiler.passes.costs import UnknownGroupWarning, sent_bytes

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    shard, full, splits = g.placeholder("shard"), g.placeholder("full"), g.placeholder("splits")
    shard.meta["val"], full.meta["val"] = torch.empty(1000), torch.empty(4000)
    splits.meta["val"] = torch.empty(4, dtype=torch.long)
    with fake_process_group(4):
        name = dist.group.WORLD.group_name
        calls = {"all_gather": g.call_function(c10d.all_gather_into_tensor.default, (shard, 4, name)),
                 "by_keyword": g.call_function(c10d.all_gather_into_tensor.default, (),
                                               {"input": shard, "group_size": 4, "group_name": name}),
                 "gloo_gather": g.call_function(c10d.all_to_all_single.default, (full, [1000] * 4, [1000] * 4, name)),
                 "uneven": g.call_function(torch.ops.remat.all_to_all_uneven.default, (full, splits, splits, 4000, name)),
                 "reduce_scatter": g.call_function(c10d.reduce_scatter_tensor.default, (full, "sum", 4, name)),
                 "all_reduce": g.call_function(c10d.all_reduce.default, (full, "sum", name))}
        charged = {k: sent_bytes(n) for k, n in calls.items()}
    assert charged == {"all_gather": 12_000, "by_keyword": 12_000, "gloo_gather": 12_000, "uneven": 12_000,
                       "reduce_scatter": 12_000, "all_reduce": 24_000}
    with pytest.warns(UnknownGroupWarning, match="charged its input's 16,000 bytes"):
        assert sent_bytes(calls["gloo_gather"]) == 16_000
