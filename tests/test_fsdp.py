"""remat_compiler.compile on models sharded with FSDP2 (issue 35), on 2 gloo ranks against FSDP2 eager.

One spawn (tests/fsdp_worker.py) runs every check's job on both ranks; each test reads what both
ranks saved and checks every rank. The unit tests at the end need no process group.
"""
from __future__ import annotations

import pytest
import torch

import dist_spawn
import fsdp_worker as worker
from remat_compiler.graph.blocks import block_stack

WORLD = 2
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    try:
        dist_spawn.spawn_ranks(worker.run_rank, WORLD, out_dir, timeout_s=TIMEOUT_S)
    finally:
        saved = [out_dir / f"rank{r}.pt" for r in range(WORLD)]
        results = [torch.load(p, weights_only=False) if p.exists() else {} for p in saved]
        for r, res in enumerate(results):
            if "error" in res:
                print(f"rank {r}:\n{res['error']}")
    return results


def _assert_trains_like_eager(res: dict, label: str) -> None:
    """Same losses, the same sharded gradients on the first step, the same shards after training."""
    eager, got = res["eager"], res["compiled"]
    n = min(len(eager["losses"]), len(got["losses"]))
    assert n >= 2, label
    torch.testing.assert_close(got["losses"][:n], eager["losses"][:n], rtol=1e-5, atol=1e-6, msg=label)
    assert got["grads"].keys() == eager["grads"].keys(), label
    for k, want in eager["grads"].items():
        torch.testing.assert_close(got["grads"][k], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {k}: {m}")
    if len(got["losses"]) == len(eager["losses"]):
        for k, want in eager["shards"].items():
            torch.testing.assert_close(got["shards"][k], want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{label} {k} after training: {m}")


def _assert_plan_on_ranks(ranks, key: str) -> None:
    """The same plan on every rank (rank 0's, broadcast); on every rank each step after the first
    (which traces and plans) measures exactly the predicted peak, within the budget, and so does the
    allocator in the least of the steps it measures (fsdp.gather writes gloo's buffers as graph
    values; see fsdp_worker.ALLOCATOR_STEPS)."""
    first = ranks[0][key]["plan"]
    for r, res in enumerate(ranks):
        plan, peaks = res[key]["plan"], res[key]["compiled"]["peaks"]
        assert plan["digests"] == [first["digest"]] * WORLD, (key, r)
        assert plan["source"] == ("solved" if r == 0 else "rank 0"), (key, r, plan["source"])
        assert set(peaks[1:]) == {plan["predicted"]}, (key, r, peaks, plan["predicted"])
        allocator = res[key]["compiled"]["allocator_peaks"]
        assert min(allocator) == plan["predicted"], (key, r, allocator, plan["predicted"])
        if plan["budget"] is not None:
            assert plan["predicted"] <= plan["budget"], (key, r, plan)


@pytest.mark.parametrize("key", ["chain", "chain_mp"])
def test_sequential_trains_like_fsdp2_eager(ranks, key):
    """nn.Sequential of Linear+GELU blocks, fully_shard on each block then the root (fp32, and with
    MixedPrecisionPolicy(bf16 params, fp32 reduce)): 5 SGD steps with momentum like FSDP2 eager on every rank."""
    for r, res in enumerate(ranks):
        _assert_trains_like_eager(res[key], f"{key} rank {r}")
    _assert_plan_on_ranks(ranks, key)


def test_gloos_all_to_all_gather_and_reduce_equal_the_plain_collectives_on_three_ranks(tmp_path):
    """fsdp.gather's gloo form (all-to-alls) against the plain all-gather and reduce-scatter, run
    eagerly on 3 gloo ranks with uneven shards: the same gathered buffer (row r rank r's shards) and
    the same shard gradients (the sum over ranks, divided by the world size), in fp32 and with bf16
    parameters reduced in fp32."""
    world = 3
    dist_spawn.spawn_ranks(worker.gather_forms, world, tmp_path, timeout_s=60)
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(saved):
        for param_dtype in (None, torch.bfloat16):
            (gathered, grads), (want, want_grads) = res[(param_dtype, True)], res[(param_dtype, False)]
            assert torch.equal(gathered, want), (r, param_dtype)
            assert gathered.dtype == (param_dtype or torch.float32) and gathered.numel() == world * 22
            for got, ref in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {r}: {m}")
    assert all(torch.equal(res[(None, True)][0], saved[0][(None, True)][0]) for res in saved)  # one buffer on all


def test_the_sharded_step_under_inductor_trains_like_fsdp2_eager(ranks):
    """backend="inductor" on the FSDP2-sharded chain: the planned step, collectives included, compiled
    by Inductor on every rank from rank 0's plan, trains 5 SGD steps with momentum like FSDP2 eager, and the
    allocator measures the walk of Inductor's code (its peak is Inductor's buffers', which the
    tracker does not see), gloo's buffers included."""
    for r, res in enumerate(ranks):
        assert res["chain_inductor"]["backend"] == "inductor", r
        _assert_trains_like_eager(res["chain_inductor"], f"chain under Inductor, rank {r}")
        allocator, walk = res["chain_inductor"]["compiled"]["allocator_peaks"], res["chain_inductor"]["plan"]["walk"]
        assert min(allocator) == walk, (r, allocator, walk)
    digests = {res["chain_inductor"]["plan"]["digest"] for res in ranks}
    assert len(digests) == 1 and ranks[0]["chain_inductor"]["plan"]["source"] == "solved"


@pytest.mark.parametrize("key", ["llama", "llama_mp"])
def test_llama_trains_like_fsdp2_eager(ranks, key):
    """A default-config LlamaForCausalLM (loss inside via labels), every decoder layer a unit, then
    the root: the issue's second reproduction."""
    for r, res in enumerate(ranks):
        _assert_trains_like_eager(res[key], f"{key} rank {r}")
    _assert_plan_on_ranks(ranks, key)
    units = [u["unit"] for u in ranks[0][key]["plan"]["units"]]
    assert sorted(units) == ["(root)", "model.layers.0", "model.layers.1", "model.layers.2"]


def test_gradient_accumulation_without_sync_sums_like_fsdp2_and_says_it_communicates(ranks):
    """set_requires_gradient_sync(False) on the first of two micro-batches: FSDP2 eager reduces the
    summed gradients once; the compiled step reduce-scatters each micro-batch and adds the shards,
    which sums to the same gradients, and warns once that it does not skip the communication."""
    for r, res in enumerate(ranks):
        acc = res["accumulation"]
        assert acc["eager warnings"] == [], (r, acc["eager warnings"])
        assert len(acc["compiled warnings"]) == 1 and "reduce-scatter per micro-batch" in acc["compiled warnings"][0]
        assert acc["compiled"].keys() == acc["eager"].keys()
        for k, want in acc["eager"].items():
            torch.testing.assert_close(acc["compiled"][k], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {k}: {m}")


def test_budget_below_the_no_recompute_peak_recomputes(ranks):
    """At 0.85 of the no-recompute peak (which keeps every unit gathered and every activation) the
    plan peaks under the budget, so below the no-recompute peak: it recomputes or re-gathers, and
    every rank still measures what it predicts (test_sequential_trains_like_fsdp2_eager)."""
    for key in ("chain", "chain_mp"):
        for res in ranks:
            plan = res[key]["plan"]
            assert plan["budget"] == int(0.85 * plan["baseline"]), (key, plan["budget"], plan["baseline"])
            assert plan["predicted"] <= plan["budget"] < plan["baseline"], key


def test_each_unit_choice_is_in_explain_and_json(ranks):
    """explain() and the JSON plan list every unit with its choice and why."""
    plan = ranks[0]["chain_mp"]["plan"]
    assert plan["json_units"] == plan["units"]
    assert [u["unit"] for u in plan["units"]] == ["0", "1", "2"]
    for u in plan["units"]:
        assert u["choice"] in ("kept", "re-gathered") and u["why"], u
        line = next(x for x in plan["explain"].splitlines() if f" {u['unit']}: " in x)
        assert u["why"] in line and ("reshard_after_forward=True" in line) == (u["choice"] == "re-gathered")


def test_joint_reshard_choice_beats_both_fixed_settings(ranks):
    """The mixed model at 0.86 of its no-recompute peak: the joint plan keeps some units and gathers
    others again; the best plan with every unit re-gathered (reshard_after_forward=True) costs more
    (it sends every unit again), and keeping every unit (False) does not fit or costs more."""
    for r, res in enumerate(ranks):
        _assert_trains_like_eager(res["mixed"], f"mixed rank {r}")
    _assert_plan_on_ranks(ranks, "mixed")
    res = ranks[0]["mixed"]
    choices = {u["choice"] for u in res["plan"]["units"]}
    assert choices == {"kept", "re-gathered"}, res["plan"]["units"]
    recompute_line = next(x for x in res["plan"]["explain"].splitlines() if x.startswith("recompute"))
    assert "all-gather again" in recompute_line and "all-to-all" not in recompute_line, recompute_line
    joint = res["joint"]
    assert joint["status"] == "optimal", joint
    for setting in (True, False):
        fixed = res["fixed"][setting]
        if "infeasible" not in fixed:
            assert fixed["recompute_s"] > joint["recompute_s"], (setting, fixed, joint)
    assert "infeasible" not in res["fixed"][True] and res["fixed"][True]["comm"] > joint["comm"], res["fixed"]


def test_checkpoint_round_trip(ranks):
    """torch.distributed.checkpoint saves the compiled model's state (FSDP2's keys) and loads it back
    into its DTensor parameters; the next step runs on the loaded shards."""
    for r, res in enumerate(ranks):
        d = res["dcp"]
        assert d["keys_match"], r
        for k, want in d["saved"].items():
            assert torch.equal(d["loaded"][k], want), (r, k)
        assert all(torch.isfinite(g).all() for g in d["grads_after"].values()), r
        assert d["eval_as_fsdp2"], r


@pytest.mark.parametrize("case, words", [
    ("wrong order", ["fully_shard(compile(model))", "fully_shard(model); m = remat_compiler.compile"]),
    ("root not sharded", ["root (Sequential) is not sharded", "fully_shard(model)"]),
    ("plain parameter", ["'scale' is not sharded", "Apply fully_shard"]),
    ("hsdp", ["2-D mesh", "1-D mesh"]),
    ("two groups", ["different process groups", "same mesh"]),
    ("subgroup", ["1 of the job's 2 ranks", "mesh of all ranks"]),
])
def test_unsupported_setups_raise_library_errors(ranks, case, words):
    """Each refused setup raises UnsupportedShardingError on every rank, naming what and what to do
    (and nothing hangs: the spawn is bounded)."""
    for r, res in enumerate(ranks):
        raised = res["refused"][case]
        assert raised is not None and raised[0] == "UnsupportedShardingError", (case, r, raised)
        for w in words:
            assert w in raised[1], (case, r, raised[1])


def test_a_model_without_fsdp_compiles_as_before():
    """Without a process group: a plain model is not an FSDP2 model, and compile returns the
    ordinary compiled module for it (the dispatch to the sharded step is FSDP2's alone)."""
    import remat_compiler
    from remat_compiler.api import CompiledModule
    from remat_compiler.fsdp import is_fsdp_model

    model = worker.make_chain(sharded=False)
    assert not is_fsdp_model(model)
    cm = remat_compiler.compile(model)
    assert type(cm) is CompiledModule


# ---------------------------------------------------------------- one rank of N, planned in one process

def _meta_llama():
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**worker.LLAMA_SIZES))
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    return model, ids


def test_planning_one_rank_on_meta_gives_the_real_ranks_graph(ranks):
    """plan_model(meta model, fsdp=2) in this process, over a fake process group: the same graph
    (fingerprint), no-recompute peak and resolved budget as the 2 real gloo ranks traced for the
    same Llama sharded as users shard it; the caller's model stays unsharded and no process group
    is left behind."""
    import warnings

    import torch.distributed as dist

    import remat_compiler
    from remat_compiler.fsdp import is_fsdp_model
    from remat_compiler.trace.device import DeviceTraceWarning

    model, ids = _meta_llama()
    planned = remat_compiler.plan_model(model, (ids,), {"labels": ids}, 0.9, hold_outputs=False, fsdp=2,
                                        **worker.CPSAT)
    real = ranks[0]["llama"]["plan"]
    plan = planned.plan
    assert (plan.fingerprint, plan.baseline_peak_bytes, plan.budget_bytes) == \
        (real["fingerprint"], real["baseline"], real["budget"])
    assert plan.peak_bytes <= plan.budget_bytes
    assert [u["unit"] for u in plan.extras["fsdp_units"]] == [u["unit"] for u in real["units"]]
    assert plan.extras["fsdp_world"] == 2 and "FSDP unit" in plan.explain()
    assert not is_fsdp_model(model) and not dist.is_initialized()
    # each layer unit's all-gather is its layer's (the root's is no layer's), so the layers stay identical
    # with their gathers in them and the block methods decide a layer's re-gather with its recomputation
    cg = planned.cg
    gathers = [n for n in cg.fw_order if cg.attr(n, "phase") == "fw"
               and any(g in str(cg.attr(n, "op")) for g in ("all_gather_into_tensor", "all_to_all_single"))]
    stack = block_stack(cg)
    assert len(stack.blocks) == worker.LLAMA_SIZES["num_hidden_layers"]
    assert sorted(cg.attr(n, "block") or "" for n in gathers) == ["", *stack.blocks]
    # planned for a GPU, the step has NCCL's collectives (an all-gather and a reduce-scatter per unit),
    # not the all-to-alls they are written as on gloo (fsdp.gather)
    with warnings.catch_warnings():  # that sdpa is CPU's kernel: its warning is not this test's
        warnings.simplefilter("ignore", DeviceTraceWarning)
        _, gpu = remat_compiler.api.analyze_sharded(model, (ids,), {"labels": ids}, fsdp=2, device="cuda",
                                                    hold_outputs=False)
    ops = [str(gpu.attr(n, "op")) for n in gpu.g.nodes]
    units = len(gathers)
    assert sum("all_gather_into_tensor" in o for o in ops) == units
    assert sum("reduce_scatter_tensor" in o for o in ops) == units
    assert not any("all_to_all" in o for o in ops)


def test_cli_plans_one_rank_of_an_fsdp_step(tmp_path, capsys):
    """plan / pareto / fit take --fsdp N: the plan lists each unit's choice, the sweep plans the
    sharded step, and fit answers with the plan of one rank's step."""
    import transformers

    from remat_compiler.cli import main

    cfg = tmp_path / "config.json"
    transformers.LlamaConfig(**worker.LLAMA_SIZES).to_json_file(str(cfg))
    common = ["--hf-config", str(cfg), "--seq", "16", "--time-limit", "1"]
    assert main(["plan", *common, "--fsdp", "4", "--budget", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "FSDP unit         (root):" in out and "model.layers.2:" in out
    assert main(["pareto", *common, "--fsdp", "4", "--budgets", "1.0,0.9"]) == 0
    assert "cpsat @ 0.9" in capsys.readouterr().out
    assert main(["fit", "--hf-config", str(cfg), "--seq-max", "64", "--step", "32", "--fsdp", "2",
                 "--budget", "10MiB", "--time-limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "fit: seq 64 fits 10.00 MiB" in out and "FSDP unit" in out


def test_fsdp_planning_refuses_what_it_cannot_shard():
    """fsdp=1, and a model without repeated blocks, are library errors saying what to do."""
    import remat_compiler
    from remat_compiler.errors import UnsupportedShardingError

    model, ids = _meta_llama()
    with pytest.raises(UnsupportedShardingError, match="2 ranks or more"):
        remat_compiler.plan_model(model, (ids,), {"labels": ids}, fsdp=1)
    with torch.device("meta"):
        flat = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedShardingError, match="no repeated blocks"):
        remat_compiler.plan_model(flat, (torch.zeros(2, 4, device="meta"),), fsdp=2)


def test_the_solve_starts_from_fsdp2s_own_settings():
    """FSDP2's re-gathering settings are known plans of the sharded step's solve (FSDPSeeds): each
    seed gathers units again and peaks below the no-recompute plan, and a budget far below the
    no-recompute peak (0.55 of it, one rank of 8) gets a plan that re-gathers."""
    import warnings

    import remat_compiler
    from remat_compiler.fsdp.planning import fake_process_group, shard_for_planning
    from remat_compiler.fsdp.seeds import seed_sets
    from remat_compiler.schedule import build_schedule, no_recompute, simulate

    model, _ = _meta_llama()
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    with warnings.catch_warnings(), fake_process_group(8):
        warnings.simplefilter("ignore")
        step = shard_for_planning(model, 8)
        _, cg = remat_compiler.analyze(step, (), batch, hold_outputs=False, stamp_layers=False)
    seeds = seed_sets(cg, [len(u.params) for u in step.units])
    assert len(seeds) == 2
    for saved in seeds:
        sim = simulate(cg, build_schedule(cg, saved))
        assert sim.peak_bytes < no_recompute(cg).peak_bytes
        assert sum(cg.attr(n, "comm_bytes") for n in build_schedule(cg, saved).recomputed) > 0
    planned = remat_compiler.plan_model(model, (), batch, 0.55, hold_outputs=False, fsdp=8, **worker.CPSAT)
    assert planned.plan.peak_bytes <= planned.plan.budget_bytes and planned.plan.recompute_comm_bytes > 0
    assert any(u["choice"] == "re-gathered" for u in planned.plan.extras["fsdp_units"])
