"""The pass list: run_passes runs PASSES in order, dumps each step, and writes only keys of passes.keys."""
from __future__ import annotations

import torch

from examples.models import MLPChain
from passes import PASSES, keys, run_passes
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
    from passes.costs import DEVICE_PRESETS, CostModel

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
