"""The fused cross-entropy backward: same values as aten's two kernels, one logits-sized output."""
from __future__ import annotations

import pytest
import torch

import remat_compiler as rc
from helpers import run_step
from passes.loss import cross_entropy_backward

aten = torch.ops.aten


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_nll_then_log_softmax_backward(reduction, weighted):
    torch.manual_seed(0)
    x = torch.randn(300, 129)
    ls = torch.log_softmax(x, 1)
    target = torch.randint(0, 129, (300,))
    target[::5] = -100  # ignored rows get no gradient
    weight = torch.rand(129) + 0.5 if weighted else None
    _loss, total_weight = aten.nll_loss_forward(ls, target, weight, reduction, -100)
    grad = torch.rand(300) if reduction == 0 else torch.tensor(1.7)
    ref = aten._log_softmax_backward_data(
        aten.nll_loss_backward(grad, ls, target, weight, reduction, -100, total_weight), ls, 1, torch.float32)
    out = cross_entropy_backward(grad, ls, target, weight, reduction, -100, total_weight)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-9)
    assert torch.equal(out[::5], ref[::5])  # ignored rows: exp(ls) * 0 on both sides


def test_gpt2_loss_head_is_fused_and_trains_like_eager():
    pytest.importorskip("transformers")
    from examples.gpt2 import build

    model, inputs, _ = build(n_layer=1, n_embd=32, n_head=2, vocab_size=256, batch=2, seq=32)
    model(**inputs).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    gm, cg = rc.analyze(model, (), inputs, hold_outputs=False)
    ops = [cg.attr(n, "op") for n in cg.order]
    assert "aten.nll_loss_backward.default" not in ops and "aten._log_softmax_backward_data.default" not in ops
    assert ops.count("remat.log_softmax_nll_backward.default") == 1
    fused = next(n for n in cg.order if cg.attr(n, "op") == "remat.log_softmax_nll_backward.default")
    assert cg.attr(fused, "bytes") == 2 * 32 * 256 * 4  # one logits-sized output
    m = rc.compile(model, None, hold_outputs=False)
    for p in model.parameters():
        p.grad = None
    m(**inputs).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, eager[n], rtol=1e-5, atol=1e-7), n


def _gpt2_with_a_large_vocabulary():
    """GPT-2 as users build it (library defaults: dropout 0.1, SDPA, use_cache), sizes shrunk, with a
    vocabulary large against its width, as language models have: the loss head holds the step's peak."""
    import transformers as T

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=2048, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    return model, torch.randint(0, 2048, (2, 64))


def _inductor_step(model, ids):
    """Plan without recomputation for the Inductor backend, step once; the compiled module and the
    gradients (dropout drawn from seed 1)."""
    m = rc.compile(model, None, backend="inductor", hold_outputs=False)
    return m, run_step(model, lambda: m(ids, labels=ids), loss=lambda out: out.loss, seed=1).grads


@pytest.fixture(scope="module")
def inductor_planned():
    """The large-vocabulary GPT-2 under the Inductor backend, stepped once (:func:`_inductor_step`):
    one Inductor compile for the two tests that read it. The compiled module, its first step's
    gradients and the tokens."""
    pytest.importorskip("transformers")
    model, ids = _gpt2_with_a_large_vocabulary()
    return (*_inductor_step(model, ids), ids)


def test_under_inductor_the_loss_head_is_planned_whole_and_holds_one_logits_size_less(inductor_planned,
                                                                                       monkeypatch):
    """The Inductor backend traces with Inductor's decompositions, which turn log_softmax into five
    ops and cross-entropy's backward into a scatter into a zero-filled logits-sized tensor. It keeps
    those three ops whole (``passes.loss.WHOLE_LOSS_OPS``): the backward's pair is fused, so the
    compiled backward holds two logits-sized tensors where it held three, and the plan prices the
    loss head as the code runs it (its prediction is the walk of Inductor's code)."""
    pytest.importorskip("transformers")
    import copy

    import remat_compiler.inductor as inductor

    model, ids = _gpt2_with_a_large_vocabulary()
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    reference(ids, labels=ids).loss.backward()
    logits_bytes = ids.numel() * 2048 * 4

    m, grads, _ = inductor_planned  # the same model (seed 0), compiled and stepped once from seed 1
    ops = [m.planned.cg.attr(n, "op") for n in m.planned.cg.order]
    assert ops.count("remat.log_softmax_nll_backward.default") == 1
    assert ops.count("remat.log_softmax.default") == 1
    assert not [op for op in ops if "scatter" in op or "nll_loss_backward.default" in op
                or "log_softmax_backward_data" in op], ops
    assert "torch.ops.remat.log_softmax_nll_backward.default(" in m.planned.inductor[1].source
    for (name, q) in reference.named_parameters():
        assert torch.allclose(grads[name], q.grad, rtol=1e-4, atol=1e-6), name
    # the plan prices the loss head as the code runs it: its peak is the walk's, up to small values
    # Inductor fuses elsewhere (1,648 bytes here)
    assert abs(m.planned.compiled.peak_bytes - m.plan.peak_bytes) <= 0.001 * m.plan.peak_bytes

    # Inductor's own decompositions (the trace before this change): one logits-sized tensor more
    from torch._inductor.decomposition import select_decomp_table
    monkeypatch.setattr(inductor, "DECOMPOSITIONS", {
        op: fn for op, fn in select_decomp_table().items() if not str(op).startswith("aten.native_dropout.")})
    old, _ = _inductor_step(copy.deepcopy(model), ids)
    assert "scatter" in " ".join(str(old.planned.cg.attr(n, "op")) for n in old.planned.cg.order)
    # its peak, in the backward's loss head, less one logits-sized tensor is above the whole step's now,
    # but for the row vectors the fused graph makes as values of its own (index, factor and its
    # negation: 16 bytes a row; the fused op used to make them inside itself, unseen)
    rows_bytes = ids.numel() * (8 + 4 + 4)
    assert old.planned.compiled.peak_node.startswith("backward:")
    assert old.planned.compiled.peak_bytes - logits_bytes + rows_bytes >= m.planned.compiled.peak_bytes


class _LossHeads(torch.nn.Module):
    """Loss-head ops that are not cross-entropy's pair: nll_loss on values no log_softmax made (its
    backward feeds a tanh's), and a log_softmax read by a KL divergence (its backward has no
    nll_loss_backward to fuse with)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x, target, prior):
        h = self.lin(x)
        nll = torch.nn.functional.nll_loss(torch.tanh(h), target)
        kl = torch.nn.functional.kl_div(torch.log_softmax(h, -1), prior, reduction="batchmean")
        return nll + kl


def test_under_inductor_the_loss_heads_whole_ops_run_unfused_where_they_are_not_a_pair():
    torch.manual_seed(0)
    model = _LossHeads()
    x, target, prior = torch.randn(32, 16), torch.randint(0, 8, (32,)), torch.softmax(torch.randn(32, 8), -1)
    model(x, target, prior).backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    m = rc.compile(model, None, backend="inductor")
    m(x, target, prior).backward()
    ops = [m.planned.cg.attr(n, "op") for n in m.planned.cg.order]
    assert m.planned.backend == "inductor"
    assert {"remat.nll_loss_backward.default", "remat.log_softmax_backward_data.default",
            "remat.log_softmax.default"} <= set(ops)
    assert "remat.log_softmax_nll_backward.default" not in ops
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, eager[n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_fused_loss_head_allocates_nothing_the_plan_does_not_count(backend, request):
    """Where the loss head holds the step's peak, the allocator's count of the step (every tensor a
    kernel makes, inside itself too) is the plan's prediction to the byte: the fused op made its
    per-row vectors inside itself (17 bytes a row) until they became graph values; on the benchmark
    GPT-2 that left a plan 1,007 bytes under its budget by the allocator's count."""
    pytest.importorskip("transformers")
    from remat_compiler.memory import AllocatorPeak

    if backend == "inductor":  # compiled and stepped once from seed 1, as below
        m, _, ids = request.getfixturevalue("inductor_planned")
    else:
        model, ids = _gpt2_with_a_large_vocabulary()
        m = rc.compile(model, None, backend=backend, hold_outputs=False)
        torch.manual_seed(1)
        m(ids, labels=ids).loss.backward()
    predicted = m.planned.compiled.peak_bytes if backend == "inductor" else m.plan.peak_bytes
    for p in m.parameters():
        p.grad = None
    with AllocatorPeak() as allocator:
        m(ids, labels=ids).loss.backward()
    if backend == "eager":  # at the fused op's exp, which allocates its output
        assert allocator.peak_op == "aten::exp", allocator.peak_op
    assert allocator.peak_bytes == predicted
