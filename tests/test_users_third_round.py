"""What users brought, third round (issue 33, ``shared/reviews/zoo3-c200a6f.md``): each model built
as users build it, compiled, and checked against eager (loss, gradients, measured = predicted peak).

- a kernel whose traced (fake) strides differ from the real kernel's (Qwen3-Next's softplus gate);
- the model's own ``torch.utils.checkpoint`` with ``use_reentrant=True`` (transformers' recipe);
- Mamba's mixer, which takes another algorithm when told it is compiling;
- a fraction budget on a model that already checkpoints.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import remat_compiler as rc
from remat_compiler.passes.strides import layout_differs
from helpers import SEED, assert_same, eager_step, planned_step
from remat_compiler.eager_paths import FractionOfUncheckpointedWarning

transformers = pytest.importorskip("transformers")
from remat_compiler.examples.zoo import LossOf, build  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def _trains_like_eager(model, kwargs: dict, **options):
    """The compiled module's second step (the first traces and plans) against eager's second, under
    the same seed: loss and gradients allclose, and the measured peak the predicted one, within the
    budget. Returns the compiled module."""
    _, want = eager_step(model, lambda ref: ref(**kwargs), seed=SEED)
    m = rc.compile(copy.deepcopy(model), **options)
    got = planned_step(m, lambda: m(**kwargs), seed=SEED)
    assert_same(got, want, rtol=TOL["rtol"], atol=TOL["atol"], none_ok=True)
    assert got.peak == m.plan.peak_bytes
    assert m.plan.budget_bytes is None or got.peak <= m.plan.budget_bytes
    return m


class SoftplusGate(torch.nn.Module):
    """The review's reduction of Qwen3-Next's gate: softplus, then a transposed use, so the gradient
    reaching ``softplus_backward`` is transposed and autograd's reshape was traced as a view."""

    def __init__(self):
        super().__init__()
        self.projs = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for proj in self.projs:
            x = F.softplus(proj(x)).transpose(1, 2).cumsum(-1).transpose(1, 2)
        return x.sum()


def test_an_op_whose_fake_strides_differ_from_the_real_kernel_is_found():
    """softplus_backward's meta kernel returns contiguous strides for a transposed gradient, the CPU
    kernel follows the gradient's layout: layout_differs runs the real kernel and sees it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = torch.fx.symbolic_trace(lambda g, x: torch.ops.aten.softplus_backward(g, x, 1, 20))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    with FakeTensorMode() as fm:
        g = fm.from_tensor(torch.randn(2, 4, 48).transpose(1, 2))
        x = fm.from_tensor(torch.randn(2, 48, 4))
        node.meta["val"] = torch.ops.aten.softplus_backward(g, x, 1, 20)
    for p, v in zip([n for n in gm.graph.nodes if n.op == "placeholder"], (g, x)):
        p.meta["val"] = v
    assert node.meta["val"].is_contiguous()
    assert layout_differs(node)


@pytest.mark.parametrize("budget", [None, 0.8])
def test_a_view_traced_on_fake_strides_holds_on_the_real_run(budget):
    torch.manual_seed(0)
    model = SoftplusGate()
    x = torch.randn(4, 96, 32)
    _trains_like_eager(model, {"x": x}, memory_budget=budget, time_limit_s=5)


def test_qwen3_next_at_its_defaults_trains_like_eager():
    """The review's F1: a raw RuntimeError in the first backward at every budget, before."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = LossOf(transformers.Qwen3NextForCausalLM(cfg)).train()
    ids = torch.randint(0, 512, (2, 48))
    _trains_like_eager(model, {"input_ids": ids, "labels": ids}, memory_budget=None, time_limit_s=5)


class Reentrant(torch.nn.Module):
    """Blocks under ``torch.utils.checkpoint(..., use_reentrant=True)``, as transformers' recipe runs."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = cp.checkpoint(b, x, use_reentrant=True)
        return x.pow(2).mean()


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_a_reentrant_checkpoint_is_planned_through_with_eagers_gradients(input_requires_grad):
    """Where no input requires grad the reentrant checkpoint gives its function's parameters no
    gradient (eager warns, its loss needs no grad): the compiled step does the same."""
    torch.manual_seed(0)
    model = Reentrant()
    x = torch.randn(8, 16, requires_grad=input_requires_grad)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")  # eager's
        if input_requires_grad:
            m = _trains_like_eager(model, {"x": x}, memory_budget=None)
            assert "torch.utils.checkpoint (reentrant) planned through" in m.plan.explain()
            assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"  # restored
            return
        loss_e = copy.deepcopy(model)(x)
        m = rc.compile(copy.deepcopy(model), memory_budget=None)
        with pytest.warns(RuntimeWarning, match="no backward to plan"):
            loss_c = m(x)
    assert not loss_e.requires_grad and not loss_c.requires_grad  # no gradient path, in both
    torch.testing.assert_close(loss_c, loss_e, **TOL)


def test_transformers_reentrant_gradient_checkpointing_trains_like_eager():
    """The review's F4: ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    True})`` on Llama raised a raw torch RuntimeError while tracing."""
    model, inputs, _ = build("llama")
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _trains_like_eager(model, inputs, memory_budget=None)


def test_a_fraction_budget_on_a_checkpointing_model_says_what_it_is_a_fraction_of():
    model, inputs, _ = build("llama")
    model.model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    m = rc.compile(copy.deepcopy(model), memory_budget=0.7, time_limit_s=5)
    with pytest.warns(FractionOfUncheckpointedWarning, match="not a fraction of the peak the model had"):
        m(**inputs).backward()
    text = m.plan.explain()
    assert "torch.utils.checkpoint (non-reentrant) planned through" in text
    assert "fraction budgets" in text and "without the model's own checkpointing" in text
    m = rc.compile(copy.deepcopy(model), memory_budget=m.plan.baseline_peak_bytes, time_limit_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FractionOfUncheckpointedWarning)  # bytes: nothing to say
        m(**inputs).backward()


def test_mamba_is_planned_on_the_loop_eager_runs_not_the_compile_only_scan():
    """The review's W1: under the trace's is_compiling() the mixer took its associative scan, whose
    no-recompute peak was 1.60x eager's; the plan now follows eager's loop, says so, and leaves the
    module's switch as it was."""
    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)
    assert cfg.use_associative_scan  # the library's default
    torch.manual_seed(0)
    model = LossOf(transformers.MambaForCausalLM(cfg)).train()
    ids = torch.randint(0, 512, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids}
    _, eager = eager_step(model, lambda ref: ref(**kwargs), measure=True)
    m = _trains_like_eager(model, kwargs, memory_budget=None)
    assert m.plan.baseline_peak_bytes == eager.peak
    assert "use_associative_scan=False while tracing" in m.plan.explain()
    assert all(mod.use_associative_scan for mod in m.original.modules() if hasattr(mod, "use_associative_scan"))


def _wav2vec2(**fields):
    cfg = transformers.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16,) * 7, num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=2, **fields)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(cfg).train()


class CTCInside(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, labels=None):
        out = self.model(input_values=x, labels=labels)
        return out.loss if labels is not None else out.logits.float().pow(2).mean()


@pytest.mark.parametrize("fields, labels, line", [
    ({}, True, "labels.max() >= self.config.vocab_size"),
    ({}, False, "if not skip_the_layer"),
    ({"layerdrop": 0.0, "mask_time_prob": 0.5}, False, "hidden_states[mask_time_indices] ="),
])
def test_wav2vec2s_refusals_name_the_model_line_and_the_fields_to_set(fields, labels, line):
    """The review's F3: each of the three data-dependent parts of the default step is named by its
    model line (the third fails in backward, where no model frame is on the stack) and the message
    says which config fields and which module make the step traceable."""
    model = CTCInside(_wav2vec2(**fields))
    x = torch.randn(2, 4000)
    args = (x, torch.randint(1, 32, (2, 6))) if labels else (x,)
    with pytest.raises(rc.UntraceableModelError) as err:
        rc.compile(model, memory_budget=None)(*args)
    text = str(err.value)
    assert "modeling_wav2vec2.py:" in text and line in text
    assert "config.layerdrop=0.0" in text and "config.apply_spec_augment=False" in text and "ctc_loss" in text


def test_wav2vec2_trains_as_the_refusal_advises():
    """With layerdrop and SpecAugment off and the CTC loss outside, the step compiles and trains like
    eager (loss and gradients; the default config's dropout under one seed)."""
    model = _wav2vec2(layerdrop=0.0, apply_spec_augment=False)
    x, labels = torch.randn(2, 4000), torch.randint(1, 32, (2, 6))

    def ctc(logits):
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        lengths = torch.full((2,), log_probs.shape[0], dtype=torch.long)
        return F.ctc_loss(log_probs, labels, lengths, torch.full((2,), 6, dtype=torch.long), blank=0)

    _, want = eager_step(model, lambda ref: ref(input_values=x).logits, loss=ctc, seed=SEED)
    m = rc.compile(copy.deepcopy(model), memory_budget=None)
    got = planned_step(m, lambda: m(input_values=x).logits, loss=ctc, seed=SEED)
    assert_same(got, want, rtol=TOL["rtol"], atol=TOL["atol"], none_ok=True)
