"""Plans for CUDA made on this CPU-only machine (issue 15, parts 2 and 3).

- The allocator model: with CUDA's caching allocator every storage counts its 512-byte block, in the
  plan's peak (hand-computed below), the simulator, CP-SAT and the emitted-code walk alike, and a
  stand-in allocator (``LiveStorageTracker(allocator=CUDA_CACHING)``) measures what the plan predicts.
- Planning for CUDA: a meta model planned with a GPU preset traces on the CPU (this PyTorch has no
  CUDA: autograd over fake CUDA tensors would abort the process) and is marked for CUDA. What the GPU
  machine's ``compile(model.cuda(), plan=Plan.load(path))`` does with the plan file is re-trace the
  model with CUDA FakeTensors, count bytes with the same allocator model and compare fingerprints.
  Here the GPU's graph is stood in for by the same model traced from real CPU weights with the
  allocator forced to CUDA's: the aten graph is the one CUDA gives wherever no op is picked per
  device (eager attention; :func:`remat_compiler.trace.trace_device` says what differs on a real GPU:
  sdpa's kernel, which the tests show is reported and refused, and the CPU kernels' scalar buffers,
  which are not calibrated for CUDA).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import remat_compiler as rc
from remat_compiler.passes import CostModel
from remat_compiler.passes.allocator import CUDA_CACHING, EXACT, allocator_for
from remat_compiler.errors import PlanMismatchError
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.plan import Plan
from remat_compiler.trace import DeviceTraceWarning

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
OPTS = dict(deterministic=True, time_limit_s=5, num_workers=1)
H200 = CostModel.preset("h200")
#: what the GPU's trace gives, on the CPU: real CPU tensors whose bytes CUDA's allocator charges
GPU_STAND_IN = dataclasses.replace(H200, allocator="cuda_caching")


def llama(device: str, attn: str = "eager"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES)
    config._attn_implementation = attn
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).train()


def batch(device: str = "cpu"):
    ids = torch.randint(0, SIZES["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}


class Scale(torch.nn.Module):
    """loss = sum(x * w) with 150 float32 weights: every tensor's size is known by hand."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(150))

    def forward(self, x):
        return (x * self.w).sum()


def test_allocator_rounds_to_512_byte_blocks():
    assert [CUDA_CACHING.charged_bytes(n) for n in (0, 1, 512, 513, 600, 1 << 20)] == \
        [0, 512, 512, 1024, 1024, 1 << 20]
    assert EXACT.charged_bytes(600) == 600
    assert allocator_for("cuda") is CUDA_CACHING and allocator_for("cpu") is EXACT


@pytest.mark.parametrize("cost_model, peak", [(None, 608), (CostModel(allocator="cuda_caching"), 2048)])
def test_plan_peak_is_the_sum_of_rounded_sizes(cost_model, peak):
    """Backward peaks with the held loss (4 B), its tangent (4 B) and w's gradient (600 B) live:
    608 bytes exact; on CUDA 512 + 512 + 1024 = 2048. The stand-in allocator measures the same."""
    x = torch.randn(150)
    planned = rc.plan_model(Scale(), (x,), {}, None, cost_model=cost_model)
    assert planned.plan.peak_bytes == peak
    assert all(b % 512 == 0 for b in (a["bytes"] for _, a in planned.cg.g.nodes(data=True))) \
        == (cost_model is not None)
    model = Scale()
    compiled = rc.compile(model, None, cost_model=cost_model)
    compiled(x).backward()
    model.w.grad = None
    with LiveStorageTracker(allocator=CUDA_CACHING if cost_model else None) as mem:
        compiled(x).backward()
    assert mem.peak_bytes == compiled.plan.peak_bytes == peak


def test_stand_in_allocator_measures_the_cuda_prediction():
    """A recomputing plan in CUDA's units (CP-SAT sizes, simulator, emitted-code walk all rounded):
    measured with the rounding tracker, its peak is the prediction to the byte."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layers = [m for _ in range(5) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
            self.net = torch.nn.Sequential(torch.nn.Linear(30, 64), *layers, torch.nn.Linear(64, 5))

        def forward(self, x):
            return self.net(x).square().mean()

    model, x = Net(), torch.randn(500, 30)
    compiled = rc.compile(model, 0.7, cost_model=CostModel(allocator="cuda_caching"), **OPTS)
    compiled(x).backward()
    assert compiled.planned.cg.allocator == "cuda_caching" and compiled.plan.recomputed
    model.zero_grad(set_to_none=True)
    with LiveStorageTracker(allocator=CUDA_CACHING) as mem:
        compiled(x).backward()
    assert mem.peak_bytes == compiled.plan.peak_bytes <= compiled.plan.budget_bytes


@pytest.fixture(scope="module")
def cuda_planned():
    """Planned here for an H200, from a model on the meta device (checkpointing every layer: a plan
    that recomputes, made in a fraction of CP-SAT's time)."""
    return rc.plan_model(llama("meta"), (), batch("meta"), None, cost_model=H200, solver="checkpoint_blocks")


def test_meta_model_plans_for_cuda_on_a_cpu_only_build(cuda_planned):
    cg = cuda_planned.cg
    assert not torch.backends.cuda.is_built()
    assert (cg.g.graph["device"], cg.g.graph["traced_on"], cg.allocator) == ("cuda", "cpu", "cuda_caching")
    assert cuda_planned.plan.recomputed and cuda_planned.plan.extras["device"] == "cuda"
    assert cuda_planned.plan.peak_bytes % 512 == 0
    _, cpu = rc.analyze(llama("meta"), (), batch("meta"))
    assert cpu.fingerprint != cg.fingerprint  # bytes in other units: not the same plan's graph
    _, other_rates = rc.analyze(llama("meta"), (), batch("meta"), device="cuda")
    assert other_rates.fingerprint == cg.fingerprint  # the rates are not the graph


def test_plan_file_for_cuda_applies_to_the_gpu_graph(cuda_planned, tmp_path):
    """The plan file written here is accepted by the graph the GPU machine traces (stood in for by
    real weights with CUDA's allocator), with the rates it was made with, and trains correctly."""
    path = tmp_path / "llama.h200.plan.json"
    cuda_planned.plan.save(path)
    plan = Plan.load(path)
    real, inputs = llama("cpu"), batch()
    real(**inputs).loss.backward()
    eager = {n: p.grad.clone() for n, p in real.named_parameters()}
    real.zero_grad(set_to_none=True)
    compiled = rc.compile(real, plan=plan, cost_model=GPU_STAND_IN)
    compiled(**inputs).loss.backward()  # fingerprint, check_plan and the emitted-code walk accept it
    assert compiled.planned.source == "given" and compiled.planned.cg.allocator == "cuda_caching"
    assert compiled.planned.sim.peak_bytes == plan.peak_bytes
    for n, p in real.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-5, atol=1e-6, msg=n)
    # on the CPU's own allocator the same plan's graph is another one: refused, not mis-measured
    with pytest.raises(PlanMismatchError, match="made for cuda .* runs on cpu"):
        rc.compile(llama("cpu"), plan=plan)(**inputs)


def test_cpu_only_kernels_are_reported():
    """sdpa picks a CPU kernel here and CUDA's own on the GPU: the plan would not transfer."""
    with pytest.warns(DeviceTraceWarning, match="_scaled_dot_product_flash_attention_for_cpu"):
        rc.plan_model(llama("meta", attn="sdpa"), (), batch("meta"), None, device="cuda", solver="save_all")


def test_fake_cuda_tensors_are_refused_on_a_cpu_only_build():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    x = mode.fake_tensor_converter.from_meta_and_device(mode, torch.empty(4, 3, device="meta"),
                                                        torch.device("cuda"))
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="built without CUDA"):
        rc.plan_model(model, (x,), {}, None, solver="save_all")


def test_gpu_check_dry_run_plans_for_cuda_and_prints_the_table(tmp_path, capsys):
    """benchmarks/gpu_check.py runs its CPU side here: arguments, models on meta planned for cuda,
    the table skeleton, and the plan files its GPU run applies; without --dry-run it needs a GPU."""
    from benchmarks import gpu_check

    out = tmp_path / "table.md"
    assert gpu_check.main(["--dry-run", "--quick", "--workloads", "gpt2", "--budgets", "1.0",
                           "--solver", "save_all", "--write-plans", str(tmp_path), "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("## CUDA") and gpu_check.HEADER in lines
    rows = [line for line in lines if line.startswith("| gpt2 |")]
    assert len(rows) == 1 and rows[0].startswith("| gpt2 | remat_compiler | @ 1.0 x no-recompute |")
    assert "for cuda traced on cpu" in rows[0]
    plan = Plan.load(tmp_path / "gpt2.quick.1.0.plan.json")
    assert plan.extras["device"] == "cuda" and plan.peak_bytes % 512 == 0
    assert plan.extras["cost_model"]["name"] == "h100"
    with pytest.raises(SystemExit):
        gpu_check.main(["--quick"])  # no CUDA device here
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--workloads", "bert"])
    capsys.readouterr()
