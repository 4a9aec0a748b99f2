"""One plan for every batch size and sequence length up to a bound (``compile(..., max_seq_len=)``,
:mod:`remat_compiler.dynamic`): gradients equal eager's at every length, the measured peak stays
under the budget at every length, and nothing is solved again after the first call."""
import copy
import warnings

import pytest
import sympy
import torch

import remat_compiler as rc
import remat_compiler.pipeline as pipeline
from remat_compiler import LiveStorageTracker
from remat_compiler.budget import parse_budget
from helpers import count_captures
from remat_compiler.dynamic import DynamicShapeError, ShapeBounds, monotone, check_monotone

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")


@pytest.fixture
def solves(monkeypatch):
    """How many plans were decided (solved, looked up or given) in this test."""
    count = [0]
    decide = pipeline.decide

    def counting(*args, **kwargs):
        count[0] += 1
        return decide(*args, **kwargs)
    monkeypatch.setattr(pipeline, "decide", counting)
    return count


def _step(model, inputs: dict, seed: int):
    """One seeded forward and backward of ``model(**inputs)`` (a loss); its loss, gradients, peak."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with LiveStorageTracker() as mem:
        loss = model(**inputs)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        loss.backward()
    named = (model.original if isinstance(model, rc.CompiledModule) else model).named_parameters()
    return loss.detach(), {n: p.grad.clone() for n, p in named}, mem.peak_bytes


def _step_measured(model, inputs: dict, seed: int, tracker: LiveStorageTracker):
    """:func:`_step` under ``tracker`` (entered here; Inductor's buffers shown to it by the caller)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with tracker:
        loss = model(**inputs)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.original.named_parameters()}, tracker.peak_bytes


def _check_lengths(family: str, bound: int, budget, shapes, solves, batch: int = 2):
    from examples.zoo import build

    model, _, _ = build(family, batch=batch, seq=bound)
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=budget, max_seq_len=bound, time_limit_s=2)
    peaks = {}
    for i, (b, length) in enumerate(shapes):
        _, inputs, _ = build(family, batch=b, seq=length, seed=i)
        loss, grads, peak = _step(m, inputs, seed=i)
        want_loss, want, _ = _step(ref, inputs, seed=i)
        assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6), (b, length)
        for name, g in grads.items():
            assert torch.allclose(g, want[name], rtol=1e-4, atol=1e-6), (b, length, name)
        limit = m.plan.budget_bytes
        assert peak <= limit, f"batch {b} x length {length}: measured {peak} bytes above the budget {limit}"
        peaks[b, length] = peak
    assert solves[0] == 1, "a length within the bound was planned again"
    return m, peaks


def test_llama_one_plan_serves_every_length_up_to_the_bound(solves):
    """A default-config Llama: first call at 2 x 20, then lengths and batches up to 2 x 32 in any
    order; one solve, eager's gradients, every measured peak under the budget, and the peak at the
    bound the plan's own (it is the largest: monotone in the length)."""
    shapes = [(2, 20), (2, 32), (1 + 1, 3), (2, 17), (2, 2), (2, 31), (2, 9)]
    m, peaks = _check_lengths("llama", 32, 0.7, shapes, solves)
    assert abs(peaks[2, 32] - m.plan.peak_bytes) <= 0.05 * m.plan.peak_bytes
    assert peaks[2, 32] == max(peaks.values())
    assert m.plan.extras["shape_range"]["bounds"]  # the plan records it serves a range


def test_gpt2_with_dropout_one_plan_for_batch_and_length(solves):
    """A default-config GPT-2 (dropout on, seeded alike): batch below the first call's and lengths
    from 2 to the bound share the plan."""
    shapes = [(3, 16), (3, 32), (2, 5), (3, 2), (2, 32), (3, 23)]
    _check_lengths("gpt2", 32, 0.75, shapes, solves, batch=3)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                            for _ in range(4)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)


def test_mlp_batch_range_and_feature_dim_fixed(solves):
    """An MLP on [batch, 64]: dim 1 is the features, which the Linear pins to 64 (a replacement in
    the ShapeEnv), so the range is over the batch alone, up to the first call's; a larger batch is
    planned for its own shape."""
    torch.manual_seed(0)
    model = _MLP()
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=0.7, max_seq_len=128, time_limit_s=2)
    for i, b in enumerate([256, 70, 256, 2, 131]):
        x, y = torch.randn(b, 64), torch.randn(b, 64)
        loss, grads, peak = _step(m, {"x": x, "y": y}, seed=i)
        want_loss, want, _ = _step(ref, {"x": x, "y": y}, seed=i)
        assert torch.allclose(loss, want_loss) and all(torch.allclose(grads[n], want[n], atol=1e-6) for n in grads)
        assert peak <= m.plan.budget_bytes
    assert solves[0] == 1
    m(x=torch.randn(260, 64), y=torch.randn(260, 64)).backward()  # above the first call's batch
    assert solves[0] == 2


def test_above_the_bound_and_size_one_are_planned_per_shape(solves):
    """A length above ``max_seq_len`` or a batch of 1 is traced and planned for its own shape under
    the bytes the fraction resolved to at the bound; the range still serves the lengths within."""
    from examples.zoo import build

    model, inputs, _ = build("llama", batch=2, seq=16)
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=0.9, max_seq_len=24, time_limit_s=2)
    _step(m, inputs, 0)
    budget = m.plan.budget_bytes
    for i, (b, length, expected) in enumerate([(2, 30, 2), (1, 10, 3), (2, 24, 3), (2, 5, 3)]):
        _, inp, _ = build("llama", batch=b, seq=length, seed=i)
        loss, grads, peak = _step(m, inp, seed=i)
        want_loss, want, _ = _step(ref, inp, seed=i)
        assert torch.allclose(loss, want_loss) and all(torch.allclose(grads[n], want[n], atol=1e-6) for n in grads)
        assert solves[0] == expected, (b, length)
        assert m.plan.budget_bytes == budget and peak <= budget


class _Branchy(torch.nn.Module):
    """Takes another path at one length: a guard the traced graph holds under."""

    def __init__(self, skip: int, above: int | None = None):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.skip, self.above = skip, above

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        if x.shape[1] == self.skip:
            h = h * 3
        if self.above is not None and x.shape[1] > self.above:
            h = torch.cat([h, h], dim=1)
        return (h ** 2).sum()


def test_a_length_the_trace_did_not_hold_for_is_planned_apart(solves):
    """A branch on the length (``if x.shape[1] == 11``) is a ShapeEnv guard: the range serves every
    other length, the guarded one is traced and planned for its own shape, with eager's gradients."""
    torch.manual_seed(0)
    model = _Branchy(skip=11)
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=None, max_seq_len=16, time_limit_s=2)
    for i, (length, expected) in enumerate([(6, 1), (16, 1), (11, 2), (3, 2), (11, 2)]):
        x = torch.randn(4, length, 8)
        loss, grads, peak = _step(m, {"x": x}, seed=i)
        want_loss, want, _ = _step(ref, {"x": x}, seed=i)
        assert torch.allclose(loss, want_loss) and all(torch.allclose(grads[n], want[n], atol=1e-6) for n in grads)
        assert solves[0] == expected, length


def test_a_path_that_changes_below_the_bound_gives_up_the_range(solves):
    """A path chosen by length that differs between the first call and the bound (``if length > 12``,
    the attention-kernel kind of switch): no single graph serves the range, so the module says why
    and plans each shape on its own, with eager's gradients."""
    torch.manual_seed(0)
    model = _Branchy(skip=-1, above=12)
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=None, max_seq_len=16, time_limit_s=2)
    with pytest.warns(RuntimeWarning, match="cannot be planned once for every length"):
        m(x=torch.randn(4, 6, 8))
    for i, length in enumerate([6, 14, 9]):
        x = torch.randn(4, length, 8)
        loss, grads, _ = _step(m, {"x": x}, seed=i)
        want_loss, want, _ = _step(ref, {"x": x}, seed=i)
        assert torch.allclose(loss, want_loss) and all(torch.allclose(grads[n], want[n], atol=1e-6) for n in grads)
    assert solves[0] == 4  # the first call, then per shape: 6, 14 and 9


def test_monotone_sizes():
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    assert monotone(s0 * s1 * 64) and monotone(s1 - 1) and monotone(s0 * s1 - s0) and monotone(sympy.Integer(5))
    assert not monotone(512 - s1) and not monotone(s1 * (20 - s1))
    assert not monotone(sympy.floor(s1 / 3))  # not a polynomial: not proven
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    # the functions Inductor's code and the ShapeEnv write sizes with (no derivative): not proven either
    assert not monotone(64 * FloorDiv(s1, 2)) and not monotone(ModularIndexing(s0 * s1, 1, 8))


def test_check_monotone_names_the_value():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    import torch.fx as fx

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    s = env.create_unbacked_symint()
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(x)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with mode:
        x.meta["val"] = torch.empty(100 - s, 3)
    with pytest.raises(DynamicShapeError, match="x has a size or stride"):
        check_monotone(gm)


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_seq_len=1 must be an int"):
        ShapeBounds.make(1, None)
    with pytest.raises(ValueError, match="pass max_seq_len= too"):
        ShapeBounds.make(None, 4)
    with pytest.raises(ValueError, match="plan= plans per shape"):
        rc.compile(_MLP(), 0.5, max_seq_len=8, plan="{}")


def test_inductor_compiles_one_plan_for_every_length_and_walks_its_code_at_the_bound(solves):
    """backend="inductor" with max_seq_len: Inductor compiles the plan's forward and backward on the
    first call, over symbolic sizes (re-planning there while the walk of its code, taken at the
    bound, peaks above the budget: a plan found on a loaded machine's clock may). Every
    length then runs that code (no trace, no solve, no compile): eager's gradients, a measured peak
    (Inductor's own buffers watched) under the budget at every length, and at the bound the walk's
    to the byte, the largest of all."""
    from examples.zoo import build
    from remat_compiler.inductor import watch

    model, _, _ = build("llama", batch=2, seq=32)
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=0.7, max_seq_len=32, backend="inductor", time_limit_s=2)
    peaks = {}
    for i, length in enumerate((20, 32, 9, 31)):
        _, inputs, _ = build("llama", batch=2, seq=length, seed=i)
        want_loss, want, _ = _step(ref, inputs, seed=i)
        if i == 0:  # the first call traces, plans and compiles (its step is checked by the backend)
            loss, grads, _ = _step(m, inputs, seed=i)
            code = m.planned.inductor
            assert m.planned.backend == "inductor" and m.plan.extras["shape_range"]["bounds"]
            # the budget the code is held to: 0.7 of the no-recompute peak at the bound (a re-plan,
            # where the first plan's code peaked above it, is made under a lower one, plan.budget_bytes)
            limit = parse_budget(0.7).resolve(m.plan.baseline_peak_bytes)
            assert "memory_model" not in m.plan.extras  # a range plans on the graph as traced
            assert m.plan.budget_bytes <= limit and m.planned.first_step_bytes <= limit
            assert m.planned.inductor[0].on_fakes is None  # accepted: every call from now on is real
            planned = solves[0]  # one plan, or more where its code peaked above the budget (re-plans)
        else:
            tracker = LiveStorageTracker()
            with watch(tracker, code):
                loss, grads, _ = _step_measured(m, inputs, i, tracker)
            peaks[length] = tracker.peak_bytes
            assert peaks[length] <= limit, (length, peaks[length], limit)
        assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6), length
        for name, g in grads.items():
            assert torch.allclose(g, want[name], rtol=1e-4, atol=1e-5), (length, name)
    assert m.planned.inductor is code and len(m._entries) == 1 and solves[0] == planned
    assert peaks[32] == m.planned.compiled.peak_bytes == max(peaks.values())


def test_inductor_range_replans_lower_on_its_one_capture_while_its_code_at_the_bound_peaks_above(monkeypatch,
                                                                                                   solves):
    """Where the walk of the range's Inductor code at the bound peaks above the budget (here: that of
    the first two tries, 1 byte over), the range is planned again on the step's one capture
    (partitioned and compiled again, not traced again), as on one shape (the rule:
    test_the_range_replan_rule_...); the code accepted serves the range with eager's gradients."""
    import remat_compiler.inductor.compile as inductor_compile
    import remat_compiler.inductor.ranges as ranges

    limits, walks = [], []
    facts, walk = ranges.inductor_facts, inductor_compile.compiled_peak

    def noting_the_limit(*args, **kwargs):
        noted = facts(*args, **kwargs)
        limits.append(noted.limit_bytes)
        return noted

    def first_walk_over(*args, **kwargs):  # each try walks its code at the bound, then at the first call
        peak = walk(*args, **kwargs)
        walks.append(peak.peak_bytes)
        if len(walks) in (1, 3):
            peak.record("backward:pretend", limits[-1] + 1)
        return peak
    monkeypatch.setattr(ranges, "inductor_facts", noting_the_limit)
    monkeypatch.setattr(inductor_compile, "compiled_peak", first_walk_over)
    captures = count_captures(monkeypatch)
    torch.manual_seed(0)
    model = _MLP()
    ref = copy.deepcopy(model)
    m = rc.compile(model, memory_budget=0.7, max_seq_len=128, backend="inductor", time_limit_s=2)
    for i, b in enumerate([96, 72]):  # Inductor's code guards on a batch above 64
        x, y = torch.randn(b, 64), torch.randn(b, 64)
        loss, grads, _ = _step(m, {"x": x, "y": y}, seed=i)
        want_loss, want, _ = _step(ref, {"x": x, "y": y}, seed=i)
        assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            assert torch.allclose(g, want[name], rtol=1e-4, atol=1e-5), (b, name)
    assert captures == [1] and solves[0] == 3  # three plans of one trace
    assert m.planned.backend == "inductor" and m.plan.extras["shape_range"]["bounds"]
    assert m.plan.budget_bytes < limits[0] and m.planned.compiled.peak_bytes <= limits[0]


def test_the_range_replan_rule_compiles_in_order_then_lowers_by_the_overshoot_then_gives_up():
    """The rule of the range's re-plans, as on one shape: after the first code above the budget with
    horizontal fusion in it, the same budget compiled without; then the lower of budget and plan less
    the overshoot; where that has no plan, the leanest plan's peak; after INDUCTOR_REPLANS re-plans,
    the range is given up (each shape then on its own)."""
    from types import SimpleNamespace

    from remat_compiler.emitted import EmittedPeak
    from remat_compiler.inductor.backend import INDUCTOR_REPLANS
    from remat_compiler.inductor.graph import CompiledOverBudget
    from remat_compiler.inductor.ranges import InductorRange

    def over(live: int) -> CompiledOverBudget:
        peak = EmittedPeak()
        peak.record("backward:buf9", live)
        return CompiledOverBudget(peak, limit_bytes=1000, plan_peak_bytes=990)

    fused = SimpleNamespace(fused_horizontally=True, in_order=False)  # the first try's code
    unfused = SimpleNamespace(fused_horizontally=False, in_order=False)
    rng = InductorRange(compilers=fused)
    planned_under = []

    def attempt(in_order=False):
        planned_under.append((rng.planning_bytes, in_order))
        rng.compilers = SimpleNamespace(fused_horizontally=not in_order, in_order=in_order)
        return "the next try"
    for live in (1100, 1080, 1060):
        assert rng.again(over(live), attempt) == "the next try"
    # in order under the budget's own; then the lower of budget and plan, less the overshoot
    assert planned_under == [(None, True), (990 - 80, True), (990 - 60, True)]
    assert rng.planning(pipeline.PlanSpec.make(0.5, "cpsat", {})).budget.bytes == 990 - 60

    rng, planned_under[:] = InductorRange(compilers=unfused), []  # no horizontal fusion: lower at once
    rng.again(over(1100), attempt)
    assert planned_under == [(890, False)]

    rng, planned_under[:] = InductorRange(compilers=fused), []
    rng.again(over(1100), attempt)
    rng.again(over(1100), attempt)
    rng.again(rc.InfeasibleBudgetError(890, 950, proven=False), attempt)  # then the leanest plan's peak
    assert planned_under == [(None, True), (890, True), (950, True)]

    rng = InductorRange(compilers=fused)
    for _ in range(INDUCTOR_REPLANS + 1):  # the try in order, then the re-plans
        rng.again(over(1100), attempt)
    with pytest.raises(DynamicShapeError, match=f"after up to {INDUCTOR_REPLANS} re-plans"):
        rng.again(over(1100), attempt)
    with pytest.raises(rc.InfeasibleBudgetError):  # the user's own budget has no plan at the bound
        InductorRange().again(rc.InfeasibleBudgetError(890, 950, proven=False), attempt)


def test_a_first_step_above_the_walk_at_its_own_sizes_gives_the_range_up_on_the_next_call(monkeypatch):
    """The walk at the bound holds the budget only if the walk is right: the first step is checked
    against the walk of the code at that step's own sizes (equal to the byte on the Llama above), and
    where it measured more, the next call gives the range up and plans its shape lower by what was
    missed (the per-shape backend's measured re-plan)."""
    from types import SimpleNamespace

    import remat_compiler.inductor.backend as backend
    import remat_compiler.inductor.ranges as ranges
    from remat_compiler.emitted import EmittedPeak

    monkeypatch.setattr(backend, "resolve_budget", lambda cg, budget: 1100)  # the budget, in bytes
    walked = EmittedPeak()
    walked.record("backward:buf3", 1000)
    entry = SimpleNamespace(inductor=backend.InductorState(),
                            planned=SimpleNamespace(cg=None, plan=SimpleNamespace(peak_bytes=990)))
    check = backend.first_step_report(entry, SimpleNamespace(budget=None), 0, walk_relied_on=True)
    check(1000, 0, walked)  # as walked
    check(1030, 30, walked)  # more, but only by outputs the caller held
    assert entry.inductor.over is None
    with pytest.warns(RuntimeWarning, match="it missed 40 bytes"):
        check(1040, 0, walked)
    assert entry.inductor.over == (990 - 40, 40, 990)
    with pytest.raises(DynamicShapeError, match="measured above"):
        ranges.first_call_range(None, entry, [])


def test_the_walk_reads_symbolic_sizes_and_a_range_refuses_code_not_monotone_in_them():
    """Inductor's code over symbolic sizes allocates with expressions (``64*(s1 // 2)``, parentheses
    inside): the walk reads each at the sizes it is given, and refuses one it cannot read; the
    range's acceptance gives the range up where a buffer's size is not provably non-decreasing."""
    from types import SimpleNamespace

    from remat_compiler.inductor import InductorGraph, UnreadableCodeError
    from remat_compiler.inductor.compile import InductorCompilers
    from remat_compiler.inductor.ranges import InductorRange
    from remat_compiler.inductor.walk import _empty_args, _span_bytes, size_at, symbolic_sizes

    sizes, strides, dtype = _empty_args("empty_strided_cpu((s0, 64*(s1 // 2)), (64*(s1 // 2), 1), torch.float32)")
    assert (sizes, strides, dtype) == (["s0", "64*(s1 // 2)"], ["64*(s1 // 2)", "1"], "torch.float32")
    assert _span_bytes(sizes, strides, 4, {"s0": 3, "s1": 9}) == 3 * 256 * 4
    assert size_at("max(1, s1)", {"s1": 5}) == 5 and size_at(7, None) == 7
    with pytest.raises(UnreadableCodeError, match="no sizes for"):
        size_at("s0 * s2", {"s0": 3})
    with pytest.raises(UnreadableCodeError, match="not an expression"):
        size_at("s0 +* 2", {"s0": 3})

    def code(line: str) -> InductorGraph:
        return InductorGraph(None, f"def call(args):\n    arg0_1, = args\n    {line}\n    return (buf0, )\n")
    growing, halving = code("buf0 = empty_strided_cpu((s0, 64), (64, 1), torch.float32)"), \
        code("buf0 = empty_strided_cpu((s0, 64*(s1 // 2)), (64*(s1 // 2), 1), torch.float32)")
    assert [str(e) for e in symbolic_sizes(growing)] == ["s0"]
    rng = SimpleNamespace(require=lambda what: None)  # the ShapeEnv's conditions hold

    def compiled(fw, bw) -> InductorCompilers:
        compilers = InductorCompilers(lambda: None)
        compilers.fw, compilers.bw, compilers.peak = fw, bw, "the walk"
        return compilers
    entry = SimpleNamespace(planned=SimpleNamespace())
    backend = InductorRange()
    backend.compilers = compiled(growing, growing)
    backend.accept(entry, rng)
    assert entry.planned.backend == "inductor" and entry.planned.compiled == "the walk"
    backend.compilers = compiled(growing, halving)
    with pytest.raises(DynamicShapeError, match="not provably non-decreasing"):
        backend.accept(SimpleNamespace(planned=SimpleNamespace()), rng)


#: AdamW's eps where GPT-2's weights after training are compared with eager's. Adam's step is
#: ``lr * g / (|g| + eps)``, of slope ``1 / eps`` at ``g = 0``; GPT-2's key bias has a gradient of
#: zero in exact arithmetic (softmax is shift-invariant along a row), so at torch's default eps (1e-8)
#: its rounding noise alone moved it 1.3e-6 apart from eager's in 4 steps on one machine (one torch
#: thread). At 1e-5 that noise moves a weight by at most 1e-9 a step.
ADAM_EPS = 1e-5


def _rows(n: int, lengths, seed: int = 0) -> list[dict]:
    """Token rows of varying lengths, unpadded (as a tokenizer gives them)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 128, (int(lengths[i % len(lengths)]),), generator=g).tolist()}
            for i in range(n)]


def _pad(rows: list[dict]) -> dict:
    """Pad a batch to its longest row: pad id 0, attention_mask, labels -100 on padding (what
    transformers' DataCollatorForLanguageModeling(mlm=False) gives)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_dataloader_with_dynamic_padding_trains_like_eager(solves):
    """A plain loop over a DataLoader whose collator pads each batch to its own longest row
    (attention_mask and -100 labels): 6 AdamW steps of a default-config Llama, every batch its own
    length, and the last batch of one row; one solve for the batches of two, one more for the batch
    of one (a size 1 is traced apart), and the losses and weights eager's."""
    from examples.zoo import build

    wrapped, _, _ = build("llama")
    hf = wrapped.model
    rows = _rows(11, [9, 23, 14, 30, 5, 17, 27, 12, 20, 8, 31])
    losses = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(hf)
        step_model = rc.compile(model, memory_budget=0.6, max_seq_len=32, time_limit_s=2) if name == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=_pad)
        losses[name] = []
        for i, batch in enumerate(loader):
            torch.manual_seed(i)
            with LiveStorageTracker() as mem:
                loss = step_model(**batch).loss
                loss.backward()
            if name == "compiled":
                assert mem.peak_bytes <= step_model.plan.budget_bytes, (i, batch["input_ids"].shape)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        if name == "eager":
            want = model
    assert len(losses["compiled"]) == 6
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    for a, b in zip(model.parameters(), want.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert solves[0] == 2


def test_hf_trainer_with_a_padding_collator_plans_once(tmp_path, solves):
    """The HF Trainer with transformers' DataCollatorForLanguageModeling (a tokenizer's pad token,
    mlm=False: every batch padded to its own longest row) on a default-config GPT-2 with dropout:
    the same losses and weights as eager after 4 steps, and one solve for all their lengths."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from examples.zoo import build

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, 128)}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1")),
        pad_token="[PAD]")
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    wrapped, _, _ = build("gpt2")
    rows = _rows(8, [7, 30, 12, 21, 16, 9, 25, 4], seed=1)

    def train(model):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
            per_device_train_batch_size=2, save_strategy="no", seed=0, learning_rate=1e-3,
            disable_tqdm=True, remove_unused_columns=False, adam_epsilon=ADAM_EPS)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager = copy.deepcopy(wrapped.model)
    eager_losses = train(eager)
    net = copy.deepcopy(wrapped.model)
    losses = train(rc.compile(net, memory_budget=0.8, max_seq_len=32, time_limit_s=2))
    assert len(losses) == 4
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for a, b in zip(net.parameters(), eager.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert solves[0] == 1
