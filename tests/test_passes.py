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
