"""Stamped traces (remat_compiler.stamp): the joint graph built from traces of 3 and 4 identical layers
is the full trace's node for node, plans as it does, and its plan is accepted by (and trains) the
compiled real model, which traces in full; models that are not regular enough are traced in full."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

import remat_compiler as rc
import remat_compiler.stamp as stamp
from remat_compiler.passes import keys
from remat_compiler.stamp import StampError, repeated_layers, trace_stamped
from remat_compiler.trace import trace

transformers = pytest.importorskip("transformers")

LAYERS = 6
# MistralConfig's library defaults, only the sizes shrunk
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)



def mistral(device: str):
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES)).train()


def batch(device: str):
    ids = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def traced_both():
    model = mistral("meta")
    return trace(model, (), batch("meta")), trace_stamped(model, (), batch("meta"), min_layers=5, strict=True)


def _values(gm):
    """Each node's tensors: sizes, strides, offset, dtype, storage bytes and the storage's first node."""
    owner, out = {}, []
    for n in gm.graph.nodes:
        row = []
        for t in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(t, torch.Tensor):
                first = owner.setdefault(StorageWeakRef(t.untyped_storage()), n.name)
                row.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
                            t.untyped_storage().nbytes(), first, type(t).__name__))
            else:
                row.append(repr(t))
        out.append(row)
    return out


def test_stamped_graph_is_the_full_trace_node_for_node(traced_both):
    full, stamped = traced_both
    a, b = list(full.joint.graph.nodes), list(stamped.joint.graph.nodes)
    assert len(b) == len(a) and stamped.num_fwd_outputs == full.num_fwd_outputs
    assert [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in b] == \
           [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in a]
    assert _values(stamped.joint) == _values(full.joint)
    for key in ("custom", "desc", "tensor_meta", "fwd_nn_module_stack", "partitioner_tag", "original_aten"):
        assert [str(n.meta.get(key)) for n in b] == [str(n.meta.get(key)) for n in a], key
    # autograd's counter goes on across traces: the numbers from the first node on are the same
    assert [n.meta.get("seq_nr", 0) - b[0].meta["seq_nr"] for n in b] == \
           [n.meta.get("seq_nr", 0) - a[0].meta["seq_nr"] for n in a]
    assert stamped.joint.code == full.joint.code
    assert stamped.joint.meta == {**full.joint.meta, keys.STAMPED: ("model.layers", LAYERS, (3, 4))}
    for n in b:
        if n.op == "get_attr":
            assert getattr(stamped.joint, n.target).shape == getattr(full.joint, n.target).shape


def _costs(cg):
    keep = ("op", "phase", "storage", "bytes", "flops", "runtime_s", "never_recompute", "shape", "dtype", "block")
    return {n: tuple(a[k] for k in keep) for n, a in cg.g.nodes(data=True)}


def test_meta_plan_from_a_stamped_trace_is_the_full_trace_plan_and_trains_the_real_model(monkeypatch):
    monkeypatch.setattr(stamp, "MIN_LAYERS", 5)
    planned = rc.plan_model(mistral("meta"), (), batch("meta"), solver="checkpoint_blocks")
    assert keys.STAMPED in planned.gm.meta
    full = rc.plan_model(mistral("meta"), (), batch("meta"), solver="checkpoint_blocks", stamp_layers=False)
    assert keys.STAMPED not in full.gm.meta
    assert planned.cg.fingerprint == full.cg.fingerprint
    assert _costs(planned.cg) == _costs(full.cg)  # storage structure, bytes, FLOPs, runtimes, blocks
    assert planned.plan.saved == full.plan.saved and planned.plan.peak_bytes == full.plan.peak_bytes
    assert planned.plan.recomputed == full.plan.recomputed
    real, inputs = mistral("cpu"), batch("cpu")
    real(**inputs).loss.backward()
    eager = {n: p.grad.clone() for n, p in real.named_parameters()}
    real.zero_grad(set_to_none=True)
    compiled = rc.compile(real, plan=planned.plan)  # traces the real model in full
    compiled(**inputs).loss.backward()
    assert compiled.planned.cg.fingerprint == planned.cg.fingerprint
    for n, p in real.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-5, atol=1e-6, msg=n)


class _Block(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 8), scale

    def forward(self, x, first=None):
        y = torch.relu(self.lin(x)) * self.scale + x
        return y if first is None else y + first


class _Stack(nn.Module):
    """Identical blocks; with ``skip``, every block also adds block 0's output (block 0 the input),
    so that block 2 reads beyond its neighbours."""

    def __init__(self, n: int = 6, skip: bool = False, scales=None):
        super().__init__()
        self.layers = nn.ModuleList(_Block(s) for s in (scales or [1.0] * n))
        self.skip = skip

    def forward(self, x):
        first = x
        for i, layer in enumerate(self.layers):
            x = layer(x, first if self.skip else None)
            first = x if i == 0 else first
        return x.sum()


def test_layers_that_differ_are_not_stamped():
    assert repeated_layers(_Stack(6), min_layers=5) is not None
    assert repeated_layers(_Stack(scales=[1.0] * 5 + [0.5]), min_layers=5) is None  # a plain attribute differs
    assert repeated_layers(_Stack(4), min_layers=2) is None  # no more layers than are traced


def test_irregular_traces_fall_back_to_the_full_trace(monkeypatch):
    x = torch.randn(4, 8, requires_grad=True)
    model = _Stack(6, skip=True)
    with pytest.raises(StampError):
        trace_stamped(model, (x,), min_layers=5, strict=True)
    assert trace_stamped(model, (x,), min_layers=5) is None
    monkeypatch.setattr(stamp, "MIN_LAYERS", 5)
    _, cg = rc.analyze(model, (x,))
    _, cg_full = rc.analyze(model, (x,), stamp_layers=False)
    assert cg.fingerprint == cg_full.fingerprint
