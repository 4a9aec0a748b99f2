"""The fused cross-entropy backward: same values as aten's two kernels, one logits-sized output."""
from __future__ import annotations

import pytest
import torch

import remat_compiler as rc
from passes.loss import log_softmax_nll_backward

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
    out = log_softmax_nll_backward(grad, ls, target, weight, reduction, -100, total_weight)
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
