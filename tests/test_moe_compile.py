"""The MoE strategies through the whole compiler (issue 3): segment tags, plans, gradients, ranks.

Workloads: a residual stack of two :class:`MoELayer` (float64, see ``moe_compile_worker.CONFIG``) on
1, 2 and 4 gloo ranks, the same kind of stack with dropless uneven splits on 2 and 4 ranks (issue 16,
``moe_uneven_worker``; in the same spawned jobs, as are the bare layer's checks against one process,
``moe_dist_worker``, and moe_custom's peak against moe_fast's on 2 ranks, ``moe_peak_worker``), and a
tiny random HuggingFace Mixtral (2 layers, 8 experts, top-2).
"""

from __future__ import annotations

import json

import dist_spawn
import pytest
import torch

import moe_compile_worker as worker
import moe_dist_worker as layer_worker
import moe_peak_worker as peak_worker
import moe_uneven_worker as uneven
import remat_compiler
from helpers import assert_same, run_step, token_step
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.moe import MoELayer
from remat_compiler.moe.layer import fused_combine_mode
from remat_compiler.solvers.moe import moe_segments
from tiny_models import tiny_mixtral

TOL = dict(rtol=1e-10, atol=1e-12)  # float64
CFG = worker.CONFIG
LAYER_ROLES = {"input", "router", "probs", "routing", "permute", "gemm1", "act", "gemm2", "unpermute",
               "output"}
HAND_PICKED = ("save_all", "moe_origin", "moe_fast", "moe_custom")


def measured_peak(compiled, x, g) -> int:
    """Live-storage peak of one step, after the first (tracing) call; the step creates its tangent (a
    copy of ``g``)."""
    token_step(compiled, x, g)
    return token_step(compiled, x, g.clone, measure=True)[1]


def tags(cg, n):
    return cg.attr(n, "moe")


# ---------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def batch():
    return worker.make_batch()


@pytest.fixture(scope="module")
def eager(batch):
    return token_step(worker.make_model(), *batch)


@pytest.fixture(scope="module")
def compiled(batch):
    """Every hand-picked strategy and CP-SAT between origin's and fast's peaks, compiled and run once."""
    return worker.compile_strategies(None, *batch)


@pytest.fixture(scope="module")
def measured(compiled, batch):
    return {name: measured_peak(compiled[name][0], *batch) for name in HAND_PICKED}


@pytest.mark.parametrize("combine", ["autograd", "fused"])
def test_moe_layer_segments_are_tagged(combine, batch):
    model = worker.make_model()
    solver = "moe_custom" if combine == "fused" else "save_all"
    gm, cg = remat_compiler.analyze(model, (batch[0].detach().clone().requires_grad_(True),), solver=solver)
    segments = moe_segments(cg)
    assert sorted(segments) == ["layers.0", "layers.1"]
    tokens, k, e, h, f = CFG["tokens"], CFG["top_k"], CFG["num_experts"], CFG["hidden_size"], \
        CFG["ffn_hidden_size"]
    capacity = tokens * k // e * 2
    for seg, roles in segments.items():
        assert set(roles) == LAYER_ROLES  # one rank: no all-to-all nodes at all
        (probs,) = roles["probs"]
        assert cg.attr(probs, "shape") == (tokens, k) and cg.attr(probs, "dtype") == "float64"
        (routing,) = roles["routing"]
        assert cg.attr(routing, "shape") == (tokens, k) and cg.attr(routing, "dtype") == "int64"
        gemm = {r: [n for n in roles[r] if cg.attr(n, "op") == "aten.bmm.default"] for r in ("gemm1", "gemm2")}
        assert [cg.attr(n, "shape") for n in gemm["gemm1"]] == [(e, capacity, 2 * f)]
        assert [cg.attr(n, "shape") for n in gemm["gemm2"]] == [(e, capacity, h)]
        assert any(cg.attr(n, "op") == "aten.silu.default" for n in roles["act"])
        fused = {n for names in roles.values() for n in names if tags(cg, n)["fused"]}
        assert fused == (set(roles["gemm2"]) | set(roles["unpermute"]) if combine == "fused" else set())
        assert all(tags(cg, n)["kind"] == "moe_layer" for names in roles.values() for n in names)
    # every forward op inside a layer is tagged with that layer; the residual adds are not
    for n in cg.fw_order:
        module = cg.attr(n, "module")
        if module.startswith("layers."):
            assert tags(cg, n)["segment"] == ".".join(module.split(".")[:2]), n
        else:
            assert tags(cg, n) is None, n


@pytest.mark.parametrize("name", [*HAND_PICKED, "cpsat"])
def test_every_strategy_matches_eager_on_one_rank(name, compiled, eager):
    module, got = compiled[name]
    assert module.plan.solver == name
    assert_same(got, eager, name, **TOL)


def test_strategy_rules(compiled):
    """origin keeps only input + routing inside the segments; fast recomputes only the activation."""
    plans = {name: compiled[name][0].plan for name in HAND_PICKED}
    cg = compiled["moe_origin"][0].planned.cg
    role = {n: tags(cg, n) and tags(cg, n)["role"] for n in cg.fw_order}
    inside = {n for n in cg.fw_order if role[n]}
    assert {role[n] for n in plans["moe_origin"].saved if n in inside} <= {"probs", "routing", "input"}
    recomputed = {role[n] for n in plans["moe_origin"].recomputed}
    assert {"router", "permute", "gemm1", "act", "gemm2", "unpermute"} <= recomputed
    assert {role[n] for n in plans["moe_fast"].recomputed if cg.attr(n, "bytes") > 0} == {"act"}
    assert plans["moe_fast"].recompute_flops == 0
    gemm1_out = [n for n in cg.candidates if role[n] == "gemm1"]
    assert set(gemm1_out) <= set(plans["moe_fast"].saved)


def test_custom_saves_exactly_y_less_than_fast(compiled, batch):
    y_bytes = CFG["num_layers"] * CFG["tokens"] * CFG["top_k"] * CFG["hidden_size"] * 8  # float64
    fast, custom = compiled["moe_fast"][0], compiled["moe_custom"][0]
    assert fast.plan.saved_bytes - custom.plan.saved_bytes == y_bytes == 16384
    cg = custom.planned.cg
    assert not [n for n in custom.plan.saved
                if (tags(cg, n) or {}).get("role") in ("gemm2", "combine_a2a", "unpermute")]

    def forward_only(module):
        """Bytes the step holds after its forward (saved for backward + output), and saved-tensor bytes."""
        packed = []
        x = batch[0].detach().clone().requires_grad_(True)
        with LiveStorageTracker() as mem:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
                out = module(x)
            held = mem.current_bytes
        saved = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in packed}
        out.backward(batch[1])
        return held, sum(saved.values())

    (fast_held, fast_saved), (custom_held, custom_saved) = forward_only(fast), forward_only(custom)
    assert fast_held - custom_held == y_bytes
    assert fast_saved - custom_saved == y_bytes


def test_cpsat_against_hand_picked_at_their_measured_peaks(compiled, measured, batch, eager):
    plans = {name: compiled[name][0].plan for name in HAND_PICKED}
    for name in HAND_PICKED:  # DESIGN: the predicted peak is the measured one within 5%
        assert measured[name] == pytest.approx(plans[name].peak_bytes, rel=0.05), name
    low, high = measured["moe_origin"], measured["moe_fast"]
    assert low < high
    for reference, budget in (("moe_origin", low), ("moe_fast", high), (None, (low + high) // 2)):
        module = remat_compiler.compile(worker.make_model(), memory_budget=budget, solver="cpsat",
                                        **worker.CPSAT_OPTIONS)
        assert_same(token_step(module, *batch), eager, f"cpsat at {budget}", **TOL)
        plan = module.plan
        assert plan.status in ("optimal", "feasible")
        assert plan.peak_bytes <= budget
        assert measured_peak(module, *batch) <= budget
        if reference is not None:
            assert plan.recompute_s <= plans[reference].recompute_s + 1e-15, reference
            if all(c["mode"] == "autograd" for c in plan.extras["moe_combine"].values()):
                # a plan of the reference's own graph; where the solve chose the fused combine for a
                # segment (issue 16 part 2), a plan that is cheaper still may recompute a small GEMM
                assert plan.recompute_flops <= plans[reference].recompute_flops, reference
        else:
            assert low < budget < high
            assert all(set(plan.saved) != set(p.saved) for p in plans.values())


def test_strategies_reject_models_they_do_not_apply_to(batch):
    linear = torch.nn.Sequential(torch.nn.Linear(CFG["hidden_size"], 8), torch.nn.ReLU()).double()
    for name in ("moe_origin", "moe_fast", "moe_custom"):
        with pytest.raises(ValueError, match="MoE block"):
            remat_compiler.plan_model(linear, (batch[0].detach().clone().requires_grad_(True),), solver=name)


def test_fused_combine_mode_sets_and_restores():
    model = worker.make_model()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    layers[0].combine_mode = "fused"
    with fused_combine_mode(model):
        assert [m.combine_mode for m in layers] == ["fused", "fused"]
    assert [m.combine_mode for m in layers] == ["fused", "autograd"]
    with pytest.raises(RuntimeError), fused_combine_mode(model):
        raise RuntimeError("restored even on error")
    assert [m.combine_mode for m in layers] == ["fused", "autograd"]


# ---------------------------------------------------------------- expert parallel (gloo)


@pytest.fixture(scope="module", params=[2, 4], ids=str)
def ep_ranks(request, tmp_path_factory):
    """One gloo job per world size, shared by the tests below: ``(world, [each rank's results])``."""
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"ep{world}")
    dist_spawn.spawn_ranks(worker.run_rank, world, out_dir, timeout_s=240)
    return world, [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def _assert_choice_on_ranks(ranks):
    """Two ranks, a stack without an expert-parallel group, the default compile: rank 0 chooses each
    layer's combine in its one solve and broadcasts it; both ranks trace those combines, run the
    identical plan (rank 1's from rank 0), match their eager steps and measure the predicted peak."""
    first = ranks[0]["choice"]
    assert sorted(first["modes"]) == ["layers.0", "layers.1"]
    for r, res in enumerate(ranks):
        c = res["choice"]
        assert c["modes"] == c["traced"] == first["modes"], (r, c["modes"], c["traced"])
        assert all("chosen in the one CP-SAT solve" in why for why in c["why"].values()), (r, c["why"])
        assert c["digest"] == first["digest"]
        assert c["source"] == ("solved" if r == 0 else "rank 0"), (r, c["source"])
        assert_same(c["compiled"], c["eager"], f"rank {r} chosen combines", **TOL)
        assert c["peak"] == c["predicted"] <= c["budget"], (r, c["peak"], c["predicted"], c["budget"])


def _assert_chosen(*combines, label: str) -> None:
    """Every segment of each plan's ``{segment: (mode, why, traced mode)}`` (the stack's layers, under
    ``inner.`` where the loss wraps it) was chosen in the one CP-SAT solve, and its graph traced the
    mode chosen."""
    for combine in combines:
        layers = sorted(seg.removeprefix("inner.") for seg in combine)
        assert layers == [f"layers.{i}" for i in range(CFG["num_layers"])], (label, combine)
        for seg, (mode, why, traced) in combine.items():
            assert "chosen in the one CP-SAT solve" in why and mode == traced, (label, seg, mode, why, traced)


def _assert_union_collectives(union: dict) -> None:
    """The two combines' backward pieces of each expert-parallel layer (equal and uneven splits)
    hold different collectives, each in its own piece: the autograd piece sends dL/dy back through
    the all-to-all that reverses the combine; the fused piece sends G the same bytes and the
    probabilities and dL/dp in two small ones (one scalar a row), so the choice model charges it
    more. Outside the pieces the collectives pair op for op, in the same order."""
    for kind, found in union.items():
        assert sorted(found["pieces"]) == sorted(found["units"]) and len(found["pieces"]) == 2, kind
        for seg, both in found["pieces"].items():
            auto, fused = both["autograd"], both["fused"]
            assert len(auto) == 1 and len(fused) == 3, (kind, seg, both)
            assert fused[0] == auto[0], (kind, seg, both)
            assert all(op == auto[0][0] and 0 < size < auto[0][1] / 4 for op, size in fused[1:]), (kind, seg, both)
            units = found["units"][seg]
            assert units["fused"] > units["autograd"] > 0, (kind, seg, units)
        assert len(found["shared"]) >= 2 and all(a == f for a, f in found["shared"]), (kind, found["shared"])


def test_expert_parallel_strategies(ep_ranks):
    world, ranks = ep_ranks
    if world == 2:  # the combine choice on several ranks: in the 2-rank job only (the suite's time)
        _assert_choice_on_ranks(ranks)
        for res in ranks:
            _assert_union_collectives(res["union"])
    for r, res in enumerate(ranks):
        # each rank's compiled step equals its eager step, for every strategy
        assert set(res["compiled"]) == {*(HAND_PICKED if world == 2 else worker.FOUR_RANK_STRATEGIES), "cpsat"}
        for name, got in res["compiled"].items():
            assert_same(got, res["eager"], f"rank {r} {name}", **TOL)
        # all ranks hold the identical plan (digests all-gathered on every rank)
        assert res["digests"] == ranks[0]["digests"] == [ranks[0]["digests"][0]] * world
        plans = res["plans"]
        # both all-to-alls of every layer, in forward and in backward, are tagged
        assert res["a2a_roles"] == {("fw", "dispatch_a2a"): CFG["num_layers"],
                                    ("fw", "combine_a2a"): CFG["num_layers"],
                                    ("bw", "dispatch_a2a"): CFG["num_layers"],
                                    ("bw", "combine_a2a"): CFG["num_layers"]}
        # recomputing an all-to-all is charged: origin sends every forward all-to-all again
        fw_comm = plans["moe_fast"]["fw_comm_bytes"]  # the model's graph, as save_all's (2 ranks) is
        assert fw_comm > 0
        assert plans["moe_origin"]["recompute_comm_bytes"] == fw_comm
        assert plans["moe_fast"]["recompute_comm_bytes"] == 0
        if world == 2:
            assert plans["save_all"]["fw_comm_bytes"] == fw_comm
            assert plans["moe_custom"]["recompute_comm_bytes"] == 0
            assert plans["save_all"]["recompute_comm_bytes"] == 0
        # ... and priced at the link bandwidth in recompute_s (checked on 2 ranks)
        if world == 2:
            (slow_s, slow_comm), (fast_s, fast_comm) = (res["link"][worker.SLOW_LINK],
                                                        res["link"][worker.FAST_LINK])
            assert slow_comm == fast_comm == fw_comm
            assert slow_s - fast_s == pytest.approx(fw_comm * (1 / worker.SLOW_LINK - 1 / worker.FAST_LINK),
                                                    rel=1e-9)
        cp = plans["cpsat"]
        assert plans["moe_origin"]["peak_bytes"] < cp["budget_bytes"] < plans["moe_fast"]["peak_bytes"]
        assert cp["peak_bytes"] <= cp["budget_bytes"]
        # the default solver chose each expert-parallel layer's combine in its one solve (rank 0), and
        # every rank traced those combines (the digests above: the same plan)
        _assert_chosen(cp["combine"], res["measured"]["combine"], label=f"rank {r}")
        assert cp["combine"] == ranks[0]["plans"]["cpsat"]["combine"]
        # every step measures the predicted peak: a collective's inputs and result are released at a
        # planned point (after its wait), not whenever gloo's worker thread lets go of its work
        m = res["measured"]
        assert m["waits"] >= 4 * CFG["num_layers"] and m["released"]  # 2 all-to-alls a layer, fw and bw
        # Most steps measure the prediction exactly; never less, and never 32 KiB more.
        # About one step in 500 on a loaded machine used to measure an all-to-all's result more,
        # freed by gloo's thread after the graph had let go of it; the release now waits for the
        # Python reference gloo's thread drops last where the work still holds the tensor as it
        # starts, which it cannot tell once gloo's thread has brought the count back to one before
        # (collectives.release_collective_inputs).
        peaks = m["peaks"]
        assert sorted(peaks)[len(peaks) // 2] == m["predicted"] <= m["budget"], (r, m)
        assert all(m["predicted"] <= p <= m["predicted"] + 32 * 1024 for p in peaks), (r, m)


def test_expert_parallel_uneven_splits(ep_ranks):
    """Dropless expert parallelism (``MoELayer(splits="uneven")``): each compiled module is planned
    once, for the capacity bound, identically on every rank, and stepped on a random, a skewed and a
    one-rank routing with the real split sizes. Every step equals the same model run eagerly, and the
    single-process model's; every step measures the plan's peak, within the budget; a routing over
    the capacity raises on every rank, compiled as eagerly, and the module steps on afterwards."""
    world, ranks = ep_ranks
    results = [res["uneven"] for res in ranks]
    rows = world * uneven.CONFIG["tokens"] * uneven.CONFIG["top_k"]  # rows sent by all ranks, one layer
    sent = {routing: torch.tensor([u["sent_to"][routing] for u in results]) for routing in uneven.ROUTINGS}
    # the routings are what they say: uneven splits everywhere, skewed and one_rank to rank 0's experts
    assert all(len(set(row)) > 1 for routing in sent for row in sent[routing].tolist())
    assert sent["skewed"].sum(0)[0] > 0.6 * rows
    assert sent["one_rank"].sum(0)[0] == rows
    local = uneven.CONFIG["num_experts"] // world
    raised = set()
    for name, (spec, _) in uneven.COMPILED.items():
        reference = {routing: uneven.single_process_reference(world, routing, spec["num_layers"])
                     for routing in uneven.ROUTINGS}
        # one plan on every rank: digests and whole JSON, all-gathered on each rank
        plans = results[0]["plans"][name]
        assert all(u["plans"][name] == plans for u in results)
        assert [d for d, _ in plans] == [plans[0][0]] * world and len({j for _, j in plans}) == 1
        if name == "cpsat":  # the default solver chose each layer's combine on rank 0, for every rank
            combine = json.loads(plans[0][1])["extras"]["moe_combine"]
            assert sorted(combine) == ["inner.layers.0", "inner.layers.1"]
            assert all("chosen in the one CP-SAT solve" in c["why"] for c in combine.values()), combine
        if spec["combine"] == "fused":  # moe_origin sends the routed rows again in backward, and pays for it
            plan = json.loads(plans[0][1])
            again = {v["op"] for v in plan["values"] if v["decision"] == "recomputed"}
            assert {"remat.all_to_all_uneven.default", "remat.dropless_route.default",
                    "_c10d_functional.all_gather_into_tensor.default"} <= again
            assert plan["recompute_comm_bytes"] > 0
        for r, u in enumerate(results):
            predicted, budget = u["predicted"][name], u["budget"][name]
            assert predicted <= budget
            for routing in uneven.ROUTINGS:
                got, want = u["compiled"][name][routing], u["eager"][name][routing]
                if isinstance(want, str):  # over capacity: the same clear error, compiled and eager
                    assert got == want and "capacity_factor >=" in want, (name, routing, got)
                    raised.add((name, routing, r))
                    continue
                label = f"{name} {routing} rank {r}"
                assert_same(got, want, label, **TOL)
                ref = reference[routing]
                torch.testing.assert_close(want["loss"], ref["loss"][r], **TOL)
                torch.testing.assert_close(want["x"], ref["x"][r], **TOL)
                for param, grad in want.items():
                    if "gemm" in param:  # this rank's experts
                        torch.testing.assert_close(grad, ref[param][r * local:(r + 1) * local], **TOL,
                                                   msg=lambda m: f"{label} {param}: {m}")
                # every routing measures the plan's peak (most steps exactly; see the gloo note above),
                # never above the budget
                peaks = u["peaks"][name][routing]
                assert max(peaks) <= budget and sorted(peaks)[len(peaks) // 2] == predicted, (label, peaks)
            assert_same(u["after_overflow"][name], u["eager"][name]["random"], f"{name} after", **TOL)
        # the replicated routers' gradients sum over the ranks to the single-process one
        for routing in uneven.ROUTINGS:
            steps = [u["eager"][name][routing] for u in results]
            if not isinstance(steps[0], str):
                for param in (p for p in steps[0] if "router" in p):
                    torch.testing.assert_close(sum(s[param] for s in steps), reference[routing][param], **TOL)
    assert raised == {("cpsat", "one_rank", r) for r in range(world)}


def test_expert_parallel_layer_matches_single_process(ep_ranks):
    """The bare layer (both combines) on each rank of the job against one process holding every
    expert on all ranks' tokens: outputs, input and expert gradients equal each rank's share, the
    replicated router's gradients sum to the one process's; traced with AOTAutograd it gives the
    same, with the all-to-alls each combine needs; experts that do not divide are refused."""
    world, ranks = ep_ranks
    per_rank = layer_worker.CONFIG["tokens_per_rank"]
    local_experts = layer_worker.CONFIG["num_experts"] // world
    for combine in ("autograd", "fused"):
        want = layer_worker.single_process(combine, world)
        for r, res in enumerate(ranks):
            got = res["layer"][combine]
            rows = slice(r * per_rank, (r + 1) * per_rank)
            experts = slice(r * local_experts, (r + 1) * local_experts)
            torch.testing.assert_close(got["out"], want["out"][rows], **TOL)
            torch.testing.assert_close(got["x"], want["x"][rows], **TOL)
            torch.testing.assert_close(got["w1"], want["w1"][experts], **TOL)
            torch.testing.assert_close(got["w2"], want["w2"][experts], **TOL)
            assert not torch.allclose(got["router"], want["router"]), "router grad should be partial"
            for name, key in [("x", "x"), ("router.linear.weight", "router"),
                              ("gemm1.weight", "w1"), ("gemm2.weight", "w2")]:
                torch.testing.assert_close(got["traced"][name], got[key], **TOL)
            torch.testing.assert_close(got["traced"]["out"], got["out"], **TOL)
            # forward: dispatch + combine; backward: their transposes (autograd) or dispatch's
            # transpose + G, probs and d(probs) inside FusedCombine.backward (fused)
            assert got["a2a_nodes"] == {"fw": 2, "bw": 2 if combine == "autograd" else 4}
        router_sum = sum(res["layer"][combine]["router"] for res in ranks)  # replicated router: reduce
        torch.testing.assert_close(router_sum, want["router"], **TOL)
    assert all(res["layer"]["indivisible_raised"] for res in ranks)


@pytest.mark.parametrize("ep_ranks", [2], indirect=True, ids=str)
def test_inductor_runs_the_expert_parallel_stack_on_two_ranks(ep_ranks):
    """backend="inductor" on 2 gloo ranks (issue 14: the MoE layer on 2 ranks): each rank runs
    Inductor's code with eager's gradients, measures under the budget and within 10% of the walk of
    its code, its first step's own check measures the same, and no collective release warns (their
    operator form once spun 0.2 s and warned at every wait)."""
    _, ranks = ep_ranks
    for r, res in enumerate(ranks):
        ind = res["inductor"]
        assert ind["runs as"] == "inductor", (r, ind["warnings"])
        assert_same(ind["grads"], ind["eager"], f"rank {r}", rtol=1e-10, atol=1e-12, none_ok=True)  # float64
        assert ind["measured"] <= ind["budget"], (r, ind)
        assert ind["measured"] <= ind["walked"] <= 1.10 * ind["measured"], (r, ind)
        assert ind["first step"] == ind["measured"], (r, ind)
        assert not [w for w in ind["warnings"] if "still held" in w or "above" in w], (r, ind["warnings"])


@pytest.mark.parametrize("ep_ranks", [2], indirect=True, ids=str)
def test_custom_peak_on_two_ranks(ep_ranks):
    """tests/test_moe_custom_peak.py's checks of moe_custom against moe_fast on each rank of the
    2-rank job, for ``moe_peak_worker.RANK_SHAPES``."""
    _, ranks = ep_ranks
    for r, res in enumerate(ranks):
        assert len(res["custom_peak"]) == len(peak_worker.RANK_SHAPES)
        for shape, got in zip(peak_worker.RANK_SHAPES, res["custom_peak"]):
            peak_worker.check_shape(got, shape, f"rank {r}")


# ---------------------------------------------------------------- HuggingFace Mixtral


MIXTRAL_TOL = dict(rtol=1e-5, atol=1e-6)  # float32
# CP-SAT's deterministic time: load-proof
MIXTRAL_CPSAT = dict(time_limit_s=0.5, num_workers=2, minimize_peak=False, deterministic=True)


def make_mixtral():
    return tiny_mixtral(num_local_experts=8)


MIXTRAL_IDS = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))


def mixtral_step(model):
    """The loss and every gradient the step reaches."""
    got = run_step(model, lambda: model(input_ids=MIXTRAL_IDS, labels=MIXTRAL_IDS), loss=lambda out: out.loss,
                   hold_outputs=True)
    return {"loss": got.loss, **{n: g for n, g in got.grads.items() if g is not None}}


def test_mixtral_segments_are_recognised():
    model = make_mixtral()
    gm, cg = remat_compiler.analyze(model, (), {"input_ids": MIXTRAL_IDS, "labels": MIXTRAL_IDS},
                                    solver="save_all")
    segments = moe_segments(cg)
    assert sorted(segments) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    tokens, k, h, f = MIXTRAL_IDS.numel(), 2, 32, 16
    for seg, roles in segments.items():
        assert set(roles) == LAYER_ROLES
        assert all(tags(cg, n)["kind"] == "hf_sparse_moe" for names in roles.values() for n in names)
        assert [cg.attr(n, "module") for n in roles["router"] + roles["probs"] + roles["routing"]] \
            == [f"{seg}.gate"] * (len(roles["router"]) + 2)
        (probs,), (routing,) = roles["probs"], roles["routing"]
        assert (cg.attr(probs, "shape"), cg.attr(probs, "dtype")) == ((tokens, k), "float32")
        assert (cg.attr(routing, "shape"), cg.attr(routing, "dtype")) == ((tokens, k), "int64")
        # the experts' two grouped GEMMs: [T*k, 2F] then [T*k, H]; SwiGLU between them
        gemms = {r: [cg.attr(n, "shape") for n in roles[r] if "grouped_mm" in cg.attr(n, "op")]
                 for r in ("gemm1", "gemm2")}
        assert gemms == {"gemm1": [(tokens * k, 2 * f)], "gemm2": [(tokens * k, h)]}
        assert [cg.attr(n, "op") for n in roles["act"] if cg.attr(n, "bytes")] == \
            ["aten.silu.default", "aten.mul.Tensor"]
        assert any(cg.attr(n, "op") == "aten.sort.default" for n in roles["permute"])
        assert cg.attr(roles["unpermute"][-1], "shape") == (tokens, h)
    attention = [n for n in cg.fw_order if ".self_attn" in cg.attr(n, "module")]
    assert attention and all(tags(cg, n) is None for n in attention)


def test_mixtral_plans_match_eager():
    want = mixtral_step(make_mixtral())
    # the fused combine needs transformers' default grouped_mm experts (tests/test_hf_fused_combine.py);
    # batched_mm experts (one weight copy per routed row) are refused
    batched = make_mixtral()
    batched.model.set_experts_implementation("batched_mm")
    with pytest.raises(ValueError, match="fused combine"):
        remat_compiler.plan_model(batched, (), {"input_ids": MIXTRAL_IDS, "labels": MIXTRAL_IDS},
                                  solver="moe_custom")
    peaks = {}

    def run(solver, budget=None):
        options = MIXTRAL_CPSAT if solver == "cpsat" else {}
        module = remat_compiler.compile(make_mixtral(), memory_budget=budget, solver=solver, **options)
        assert_same(mixtral_step(module), want, f"{solver} at {budget}", **MIXTRAL_TOL)
        plan = module.plan
        assert plan.budget_bytes is None or plan.peak_bytes <= plan.budget_bytes
        peaks[(solver, budget)] = plan.peak_bytes
        return plan

    plans = {}
    for solver in ("moe_origin", "moe_fast"):
        plans[solver] = run(solver)
    origin, fast = (peaks[(s, None)] for s in ("moe_origin", "moe_fast"))
    baseline = plans["moe_fast"].baseline_peak_bytes  # the no-recompute plan's peak, on the same graph
    assert origin < fast < baseline
    # CP-SAT at the hand-picked strategies' peaks (the MoE table's comparisons): below fast's, and at origin's
    for budget in (fast - 1, origin):
        run("cpsat", budget)


def _waits_for_the_work(release, tensor: torch.Tensor, owner: list | None = None) -> bool:
    """Hold a view of ``tensor`` (a reference, as gloo's work object holds one), or the one object in
    ``owner`` (a C++ owner of the tensor itself), and drop it from another thread 50 ms later:
    whether ``release()`` returned only after the drop. With ``owner``, a Python reference to the
    tensor takes the owner's place and is dropped 50 ms later still (gloo's thread's last step,
    under the GIL), and the question is whether release returned only after that."""
    import threading
    import time

    hand_over = owner is not None
    work = {"held": owner.pop() if hand_over else tensor.view(-1), "python": None, "dropped": False}

    def drop_later():
        time.sleep(0.05)
        if hand_over:  # the count is back at one, a Python reference stays
            work["python"], work["held"] = tensor, None
            time.sleep(0.05)
        work["dropped"] = True
        work["held"] = work["python"] = None

    t = threading.Thread(target=drop_later)
    t.start()
    release()
    dropped = work["dropped"]
    t.join()
    return dropped


@pytest.mark.parametrize("kind", ["input", "result"])
def test_release_waits_until_the_work_lets_go_of_a_collective_tensor(kind):
    """release_collective_inputs returns only once the work's references are gone (as gloo's worker
    thread drops its work object), and warns instead of hanging if they never are. An input comes back
    to the counts use_counts took before the collective; a result the collective allocated, to
    FRESH_RESULT (the graph's one reference)."""
    import warnings

    from remat_compiler import collectives

    x = torch.zeros(1024)
    counts = collectives.use_counts(x) if kind == "input" else collectives.use_counts(results=1)
    if kind == "result":
        assert counts == (collectives.FRESH_RESULT,) == (collectives._refs(x),)
    assert _waits_for_the_work(lambda: collectives.release_collective_inputs(counts, x), x)
    keep = x.view(32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collectives.release_collective_inputs(counts, x)
    assert keep is not None and any("still held" in str(w.message) for w in caught)


def test_release_waits_for_the_python_reference_the_work_drops_last():
    """While anything besides its Python object owns a tensor, torch keeps a reference from the tensor
    to that object, dropped under the GIL by the owner whose release brings the count back to one.
    gloo's thread takes the GIL for it after its counts are back; had the release returned then, a
    graph dropping the tensor at once left gloo's thread to free it later than planned. Here another
    thread drops a C++ owner (the autograd node that saved the tensor) while keeping one Python
    reference in its place for 50 ms: the release returns only after that reference goes, and
    without the 'still held' warning (it did not wait out its time limit instead)."""
    import warnings

    from remat_compiler import collectives

    x = torch.zeros(1024)  # a collective's fresh result, the graph's one reference
    counts = collectives.use_counts(results=1)
    owner = [torch.ones(1024, requires_grad=True) * x]  # the product's autograd node saves x
    assert x._use_count() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 'still held' warning fails the test
        assert _waits_for_the_work(lambda: collectives.release_collective_inputs(counts, x), x, owner)


def test_the_release_operators_wait_for_the_work_and_only_for_it():
    """The operator form (what Inductor's code calls): counts taken inside one operator compare with
    counts taken inside the other, so a release whose tensors nothing else holds returns at once,
    without the 'still held' warning, and one whose input or fresh result the work still holds
    returns once the work lets go."""
    import warnings

    ops = torch.ops.remat
    x = torch.zeros(8)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("error")  # a 'still held' warning fails the test
            counts = ops.collective_refs.default([x])
            result = torch.zeros(4)  # allocated by the collective
            ops.release_collective_inputs.default([counts, x, result])
            for held in (x, result):
                counts = ops.collective_refs.default([x])
                assert _waits_for_the_work(lambda: ops.release_collective_inputs.default([counts, x, result]),
                                           held), (grad, held.shape)


def test_release_after_waits_holds_a_functional_collectives_inputs_and_result():
    """The pass follows each wait with the release of the collective's inputs and, when the collective
    allocates its result (all_to_all_single), of that result; an in-place collective's result is its
    input, already counted. The Inductor form carries the same rows."""
    import torch.fx as fx

    from remat_compiler import collectives

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    a2a = g.call_function(c10d.all_to_all_single.default, (x, [2, 2], [2, 2], "0"))
    waited = g.call_function(c10d.wait_tensor.default, (a2a,))
    red = g.call_function(c10d.all_reduce_.default, (waited, "sum", "0"))
    reduced = g.call_function(c10d.wait_tensor.default, (red,))
    g.output(reduced)
    gm = collectives.release_after_waits(fx.GraphModule(torch.nn.Module(), g))
    releases = [n for n in gm.graph.nodes if n.target is collectives.release_collective_inputs]
    assert [n.prev for n in releases] == [waited, reduced]
    assert [n.args[1:] for n in releases] == [(x, waited), (waited,)]
    assert [n.args[0].kwargs["results"] for n in releases] == [1, 0]
    assert [n.args[0].next for n in releases] == [a2a, red]  # counted before the collective is issued
    collectives.as_library_ops(gm)
    refs = [n for n in gm.graph.nodes if n.target is torch.ops.remat.collective_refs.default]
    assert [n.args for n in refs] == [([x],), ([waited],)]
    releases = [n for n in gm.graph.nodes if n.target is torch.ops.remat.release_collective_inputs.default]
    assert [n.args for n in releases] == [([refs[0], x, waited],), ([refs[1], waited],)]
