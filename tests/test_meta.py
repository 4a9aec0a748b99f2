"""Planning without weights: a model on the meta device plans like the same model with real CPU
weights (same graph fingerprint, same costs, same plan), through plan_model, the CLI, and a plan
made on meta applied to the real model with compile(..., plan=)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

import remat_compiler as rc
from helpers import assert_same, run_step
from remat_compiler.cli import main

transformers = pytest.importorskip("transformers")

# LlamaConfig's library defaults, only the sizes shrunk
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
OPTS = dict(deterministic=True, time_limit_s=5, num_workers=1)


def llama(device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).train()


def batch(device: str = "cpu"):
    ids = torch.randint(0, SIZES["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids}


def _costs(cg):
    keep = ("op", "phase", "storage", "bytes", "flops", "runtime_s", "comm_bytes", "never_recompute",
            "is_tuple", "shape", "dtype", "block")
    return {n: tuple(a[k] for k in keep) for n, a in cg.g.nodes(data=True)}


@pytest.fixture(scope="module")
def cpu_planned():
    return rc.plan_model(llama("cpu"), (), batch("cpu"), 0.6, **OPTS)


@pytest.fixture(scope="module")
def meta_planned():
    """The meta model planned from meta inputs (one trace and solve for the two tests that read it)."""
    return rc.plan_model(llama("meta"), (), batch("meta"), 0.6, **OPTS)


@pytest.mark.parametrize("inputs", ["meta", "cpu"])
def test_meta_model_plans_like_the_cpu_model(cpu_planned, meta_planned, inputs):
    meta = meta_planned if inputs == "meta" else rc.plan_model(llama("meta"), (), batch(inputs), 0.6, **OPTS)
    assert meta.cg.fingerprint == cpu_planned.cg.fingerprint
    assert _costs(meta.cg) == _costs(cpu_planned.cg)  # storage structure, bytes, FLOPs, runtimes
    assert meta.plan.saved == cpu_planned.plan.saved
    assert meta.plan.peak_bytes == cpu_planned.plan.peak_bytes
    assert meta.plan.budget_bytes == cpu_planned.plan.budget_bytes


def test_fake_tensor_model_plans_like_the_cpu_model(cpu_planned):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = llama("cpu")  # built under fake mode: parameters are FakeTensors
    assert all(isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())
    planned = rc.plan_model(model, (), batch("cpu"), 0.6, **OPTS)
    assert planned.cg.fingerprint == cpu_planned.cg.fingerprint
    assert planned.plan.saved == cpu_planned.plan.saved


def test_plan_made_on_meta_trains_the_real_model(meta_planned):
    planned = meta_planned
    real, inputs = llama("cpu"), batch("cpu")
    eager = run_step(real, lambda: real(**inputs), loss=lambda out: out.loss)
    compiled = rc.compile(real, 0.6, plan=planned.plan)
    got = run_step(real, lambda: compiled(**inputs), loss=lambda out: out.loss)
    assert compiled.plan is planned.plan and compiled.planned.cg.fingerprint == planned.cg.fingerprint
    assert_same(got.grads, eager.grads, rtol=1e-5, atol=1e-6)


def test_cli_plans_a_factory_that_builds_on_meta(tmp_path, capsys, cpu_planned):
    factory = tmp_path / "meta_llama.py"
    factory.write_text(textwrap.dedent(f"""
        import torch, transformers
        def build(device="meta"):
            with torch.device(device):
                model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{SIZES!r})).train()
            ids = torch.randint(0, {SIZES['vocab_size']}, (4, 32), generator=torch.Generator().manual_seed(0))
            ids = ids.to(device)
            return model, {{"input_ids": ids, "labels": ids}}
    """))
    out = tmp_path / "plan.json"
    assert main(["-q", "plan", f"{factory}:build", "--budget", "0.6", "--format", "json", "-o", str(out),
                 "--time-limit", "5"]) == 0
    plan = rc.Plan.load(out)
    assert plan.fingerprint == cpu_planned.cg.fingerprint
    assert json.loads(plan.to_json())["fingerprint"] == cpu_planned.plan.fingerprint


def test_compiled_meta_model_says_how_to_plan_it():
    m = rc.compile(llama("meta"), 0.6)
    with pytest.raises(ValueError, match="plan_model"):
        m(**batch("meta"))
