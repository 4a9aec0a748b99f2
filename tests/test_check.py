"""check_emitted: the emitted forward and backward, walked with storage reference counts, peak exactly
where the plan says; a corrupted backward is caught with the numbers it really peaks at."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.examples.models import MLPChain
from remat_compiler.check import check_emitted, check_plan
from remat_compiler.clock import Deadline
from remat_compiler.codegen import emit
from remat_compiler.emitted import emitted_peak
from remat_compiler.errors import PlanCheckError
from remat_compiler.graph import block_boundary_set
from remat_compiler.plan import make_plan
from remat_compiler.solvers.cpsat.rerun import lower_peak


class Mixed(nn.Module):
    """Views (reshape, transpose, chunk), multi-output ops (max with indices, chunk), a training-mode
    BatchNorm and dropout, in a step that returns its loss and, optionally, its logits."""

    def __init__(self, width: int = 32, with_logits: bool = False):
        super().__init__()
        self.inp = nn.Linear(width, 2 * width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(width, width)
        self.with_logits = with_logits

    def forward(self, x):
        a, b = self.inp(x).chunk(2, dim=-1)                    # a multi-output view op
        h = torch.tanh(a) * torch.sigmoid(b)
        h = self.drop(self.bn(h))
        t = h.reshape(h.shape[0], 4, -1).transpose(1, 2)      # views of an activation
        peak, _ = t.max(dim=-1)                                 # values and indices
        y = self.out(torch.relu(h) + peak.repeat(1, 4))
        loss = (y * y).mean() + peak.sum() * 1e-3
        return (loss, y) if self.with_logits else loss


def _walk(planned, fw, bw):
    cg = planned.cg
    return emitted_peak(fw, bw, num_fwd_outputs=len(cg.fw_outputs), input_updates=cg.g.graph["input_updates"],
                        hold_outputs=cg.hold_outputs)


def _plan(gm, cg, budget, solver="cpsat", **options):
    """Solve and check a plan for an analysed graph (plan_model's steps after the trace)."""
    plan = rc.solve(cg, budget, solver, **options)
    return rc.PlannedGraph(gm, cg, plan, check_plan(cg, plan))


def _checked(planned):
    fw, bw = emit(planned.gm, planned.plan)
    walked = check_emitted(fw, bw, planned.plan, planned.cg)
    assert walked.peak_bytes == planned.plan.peak_bytes
    return fw, bw, walked


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return rc.analyze(MLPChain(64, 4), (torch.randn(64, 64),))


@pytest.mark.parametrize("solver,budget", [("cpsat", None), ("cpsat", 0.8), ("cpsat", 0.7), ("save_all", None),
                                           ("checkpoint_blocks", None), ("greedy", 0.8)])
def test_emitted_peak_is_the_plans_on_an_mlp(mlp, solver, budget):
    gm, cg = mlp
    _checked(_plan(gm, cg, budget, solver=solver, **rc.SOLVERS[solver].options_in({"time_limit_s": 5})))


@pytest.mark.parametrize("hold_outputs,with_logits", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("budget", [None, 0.75])
def test_emitted_peak_is_the_plans_with_views_tuples_batch_norm_and_dropout(hold_outputs, with_logits, budget):
    torch.manual_seed(0)
    gm, cg = rc.analyze(Mixed(with_logits=with_logits), (torch.randn(16, 32),), hold_outputs=hold_outputs)
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.max.dim", "aten.split.Tensor", "aten._native_batch_norm_legit_functional.default",
            "remat.dropout_at.default", "aten.transpose.int"} <= ops
    try:
        planned = _plan(gm, cg, budget, time_limit_s=5)
    except rc.InfeasibleBudgetError as exc:
        planned = _plan(gm, cg, exc.min_feasible_bytes, time_limit_s=5)
    _checked(planned)
    if budget is not None:
        assert planned.plan.recomputed  # the interesting case: the backward recomputes


@pytest.mark.parametrize("hold_outputs", [True, False])
def test_emitted_peak_is_the_plans_on_gpt2_with_reruns(hold_outputs):
    """A tiny GPT-2 (attention, layer norms, the fused cross-entropy), checkpointed per block, then
    with reruns (a value recomputed twice: the emitted backward holds two instances of one
    FakeTensor's storage one after the other), then by CP-SAT."""
    pytest.importorskip("transformers")
    from remat_compiler.examples.gpt2 import build

    torch.manual_seed(0)
    model, inputs, _ = build(n_layer=2, n_embd=32, n_head=2, vocab_size=128, batch=2, seq=32)
    gm, cg = rc.analyze(model, (), inputs, hold_outputs=hold_outputs)
    saved = block_boundary_set(cg)
    rerun, _ = lower_peak(cg, saved, deadline=Deadline(5))
    assert rerun
    plan = make_plan(cg, saved, budget_bytes=None, solver="checkpoint+reruns", rerun=rerun)
    _checked(rc.PlannedGraph(gm, cg, plan, check_plan(cg, plan)))
    _checked(_plan(gm, cg, 0.6, time_limit_s=2))


def _corrupt_with_late_reader(planned, bw):
    """Add a 0-byte reader (an alias) of a saved activation at the end of ``bw``; return its bytes."""
    peak_at = planned.sim.peak_node
    nodes = list(bw.graph.nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    saved = [p for p in bw.graph.find_nodes(op="placeholder")
             if p.name in planned.plan.saved and planned.cg.attr(p.name, "bytes") > 0
             and max(pos[u.name] for u in p.users) < pos[peak_at]]
    victim = saved[0]
    out = next(iter(bw.graph.find_nodes(op="output")))
    with bw.graph.inserting_before(out):
        reader = bw.graph.call_function(torch.ops.aten.alias.default, (victim,))
    reader.meta["val"] = victim.meta["val"]  # an alias: the same storage
    bw.recompile()
    return victim.name, planned.cg.attr(victim.name, "bytes")


def test_a_saved_value_kept_alive_to_the_end_is_caught(mlp):
    gm, cg = mlp
    planned = _plan(gm, cg, 0.8, time_limit_s=5)
    fw, bw = emit(gm, planned.plan)
    victim, nbytes = _corrupt_with_late_reader(planned, bw)
    expected = planned.plan.peak_bytes + nbytes  # it is live again at the plan's own peak
    with pytest.raises(PlanCheckError) as err:
        check_emitted(fw, bw, planned.plan, cg)
    msg = str(err.value)
    assert f"peaks at backward:{planned.sim.peak_node} ({expected} bytes)" in msg, msg
    assert f"the plan predicts {planned.plan.peak_bytes} bytes" in msg, msg


def test_a_recomputation_moved_to_the_start_of_backward_is_caught(mlp):
    """Moving a recomputation (and the 0-byte view it reads) to the start of backward keeps its result
    live through every earlier node: each of them holds its bytes more than the plan says."""
    gm, cg = mlp
    planned = _plan(gm, cg, 0.7, time_limit_s=5)
    plan, sim = planned.plan, planned.sim
    fw, bw = emit(gm, plan)
    moved = next(r for r in plan.recomputed if cg.attr(r, "bytes") > 0)
    node = next(n for n in bw.graph.nodes if n.name == moved)
    first = next(n for n in bw.graph.nodes if n.op != "placeholder")
    for a in node.all_input_nodes:
        if a.op != "placeholder":
            assert cg.attr(a.name, "bytes") == 0  # a view of a parameter: moving it changes no bytes
            first.prepend(a)
    first.prepend(node)
    bw.graph.lint()
    bw.recompile()
    bw_events = sim.events[len(cg.fw_order):]
    before = [b for _, b in bw_events[:[n for n, _ in bw_events].index(moved)]]
    expected = max(plan.peak_bytes, max(before) + cg.attr(moved, "bytes"))
    assert expected > plan.peak_bytes
    walked = _walk(planned, fw, bw)
    assert walked.peak_bytes == expected
    with pytest.raises(PlanCheckError, match=f"peaks at backward:.* \\({expected} bytes\\); the plan predicts "
                                             f"{plan.peak_bytes} bytes"):
        check_emitted(fw, bw, plan, cg)


def test_the_walk_visits_each_emitted_node_once():
    """The check is linear in the emitted graphs: one event per node run, forward then backward."""
    torch.manual_seed(0)
    gm, cg = rc.analyze(MLPChain(32, 24), (torch.randn(16, 32),))
    planned = _plan(gm, cg, None, solver="save_all")
    fw, bw, walked = _checked(planned)
    runs = [n for g in (fw, bw) for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    assert [name.split(":", 1)[1] for name, _ in walked.events] == [n.name for n in runs]


def test_compile_checks_the_emitted_code(monkeypatch):
    """compile runs check_emitted on every step it emits: a codegen that keeps a saved value alive
    to the end of backward is refused before the step runs."""
    import remat_compiler.pipeline as pipeline

    real_emit = pipeline.emit
    seen = {}

    def emit_and_corrupt(gm, plan):
        fw, bw = real_emit(gm, plan)
        saved = [p for p in bw.graph.find_nodes(op="placeholder") if p.name in plan.saved]
        out = next(iter(bw.graph.find_nodes(op="output")))
        with bw.graph.inserting_before(out):
            reader = bw.graph.call_function(torch.ops.aten.alias.default, (saved[0],))
        reader.meta["val"] = saved[0].meta["val"]
        bw.recompile()
        seen["plan"] = plan
        return fw, bw

    monkeypatch.setattr(pipeline, "emit", emit_and_corrupt)
    torch.manual_seed(0)
    m = rc.compile(MLPChain(64, 4), memory_budget=0.8, time_limit_s=5)
    with pytest.raises(PlanCheckError, match="the emitted code"):
        m(torch.randn(64, 64)).sum().backward()
