"""Training as users run it: optimizer trajectories, gradient accumulation, autocast, pickling,
torch.compile and DDP in both orders, HF Trainer; each compared with eager PyTorch."""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from dist_spawn import spawn_ranks


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 1)).to(dtype)


def _batches(n, dtype=torch.float64, batch=64):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 32, generator=g, dtype=dtype) for _ in range(n)]


def _train(model, call, batches, steps_per_update=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for i, x in enumerate(batches):
        loss = call(x).pow(2).mean() / steps_per_update
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % steps_per_update == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("budget", [None, 0.75])
def test_adamw_trajectory_equals_eager_bit_for_bit(budget):
    """Five AdamW steps (BatchNorm in training mode, float64): every loss, parameter and running
    statistic equal to eager's, at the no-recompute plan and at a budget that recomputes."""
    eager, model = _mlp(), _mlp()
    batches = _batches(5)
    eager_losses = _train(eager, eager, batches)
    m = rc.compile(model, memory_budget=budget, time_limit_s=2)
    losses = _train(model, m, batches)
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    if budget is not None:
        assert m.plan.recomputed, "the budget was meant to make the plan recompute"


def test_gradient_accumulation_with_two_shapes():
    """Two micro-batches of different shapes accumulated into one update, as eager accumulates."""
    eager, model = _mlp(), _mlp()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(64, 32, generator=g, dtype=torch.float64),
               torch.randn(48, 32, generator=g, dtype=torch.float64)] * 2
    _train(eager, eager, batches, steps_per_update=2)
    m = rc.compile(model, memory_budget=0.8, time_limit_s=2)
    _train(model, m, batches, steps_per_update=2)
    assert len(m._entries) == 2
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name


def test_autocast_and_plain_calls_get_their_own_plans():
    """The same shapes with and without autocast: each call runs the graph of its own mode (the
    output dtype and gradients of eager in that mode), in either order."""
    base = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(32, 64)
    for order in (("fp32", "bf16", "fp32"), ("bf16", "fp32", "bf16")):
        eager, model = copy.deepcopy(base), copy.deepcopy(base)
        m = rc.compile(model)
        for mode in order:
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16" else torch.autocast("cpu", enabled=False)
            for net in (eager, model):
                net.zero_grad(set_to_none=True)
            with ctx:
                out_e, out_c = eager(x), m(x)
            assert out_c.dtype == out_e.dtype, (order, mode)
            out_e.float().pow(2).mean().backward()
            out_c.float().pow(2).mean().backward()
            for a, b in zip(model.parameters(), eager.parameters()):
                assert torch.equal(a.grad, b.grad), (order, mode)
        assert len(m._entries) == 2


def test_pickled_compiled_module_trains_like_the_original():
    """torch.save of a compiled module after it has run; the loaded copy re-plans on its first call
    and trains with eager's gradients."""
    model = _mlp()
    x = _batches(1)[0]
    m = rc.compile(model, memory_budget=0.8, time_limit_s=2)
    m(x).pow(2).mean().backward()
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ref = copy.deepcopy(loaded.original)
    for net in (loaded.original, ref):
        net.zero_grad(set_to_none=True)
    loaded(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert loaded.plan is not None and loaded.plan.budget_bytes == m.plan.budget_bytes
    for a, b in zip(loaded.original.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_around_the_compiled_module(backend):
    """torch.compile(remat_compiler.compile(m)) runs the plan as emitted: eager's gradients; the
    other order is refused with what to do."""
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(8, 16)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    try:
        outer = torch.compile(rc.compile(model), backend=backend)
        outer(x).pow(2).mean().backward()
    finally:
        torch._dynamo.reset()
    eager(x).pow(2).mean().backward()
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match=r"Pass the model \(remat_compiler.compile\(model"):
        rc.compile(torch.compile(copy.deepcopy(base), backend=backend))


def _ddp_rank(rank, world, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        shards = [torch.randn(128, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        try:
            rc.compile(DDP(copy.deepcopy(model)))
            raise AssertionError("compile(DDP(model)) was accepted")
        except ValueError as exc:
            assert "DDP(remat_compiler.compile(model" in str(exc)
        try:  # rank 0 plans; its error reaches every rank (none is left waiting for a plan)
            rc.compile(copy.deepcopy(model), memory_budget=1, time_limit_s=1)(shards[rank])
            raise AssertionError("a 1-byte budget was accepted")
        except rc.InfeasibleBudgetError as exc:
            assert exc.min_feasible_bytes > 1
        ddp = DDP(rc.compile(model, memory_budget=0.9, time_limit_s=2))
        ref = copy.deepcopy(model)
        for _step in range(3):
            model.zero_grad(set_to_none=True)
            ddp(shards[rank]).pow(2).mean().backward()
            ref.zero_grad(set_to_none=True)
            for x in shards:  # the all-reduced gradient is the mean over the ranks' shards
                (ref(x).pow(2).mean() / world).backward()
            for a, b in zip(model.parameters(), ref.parameters()):
                assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), _step
    finally:
        dist.destroy_process_group()


def test_ddp_of_compiled_module_all_reduces_every_step(tmp_path):
    """DDP(compile(model)) on 2 gloo ranks: every step's gradients are the mean over both ranks'
    shards; compile(DDP(model)), which would silently keep local gradients, is refused; an
    infeasible budget raises on every rank."""
    spawn_ranks(_ddp_rank, 2, tmp_path, timeout_s=180)


def test_hf_trainer_trains_the_compiled_model_like_eager(tmp_path):
    """HF Trainer with its defaults (dataset columns picked from forward's signature, dropout on)
    on a default-config GPT-2: the same losses and weights after 3 steps as eager."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from remat_compiler.examples.zoo import build

    wrapped, _, _ = build("gpt2")
    hf_model = wrapped.model
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (6, 16), generator=g)]

    def train(model):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
            per_device_train_batch_size=2, save_strategy="no", seed=0, learning_rate=1e-3,
            disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager = copy.deepcopy(hf_model)
    eager_losses = train(eager)
    compiled_net = copy.deepcopy(hf_model)
    losses = train(rc.compile(compiled_net, memory_budget=0.9, time_limit_s=2))
    assert len(losses) == 3
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for a, b in zip(compiled_net.parameters(), eager.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
