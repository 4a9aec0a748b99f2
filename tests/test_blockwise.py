"""The per-block decomposition (solvers/blockwise.py): composed plans fit when simulated, and beat
the hand-picked plans they start from."""
from __future__ import annotations

import pytest

import remat_compiler as rc
from remat_compiler.examples.gpt2 import build
from remat_compiler.schedule import build_schedule, save_all_set, simulate
from remat_compiler.clock import Deadline
from remat_compiler.graph import block_boundary_set, block_stack
from remat_compiler.solvers.cpsat.blockwise import blockwise_saved_set
from remat_compiler.solvers.cpsat import cost_units

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    model, inputs, _ = build(n_layer=4, n_embd=64, n_head=4, vocab_size=256, batch=2, seq=64)
    _, cg = rc.analyze(model, (), inputs, hold_outputs=False)
    return cg


def _cost(cg, saved):
    return sum(cost_units(cg, n) for n in build_schedule(cg, saved).recomputed)


def test_stack_finds_the_layers_aligned(gpt2):
    stack = block_stack(gpt2)
    assert stack.blocks == [f"transformer.h.{i}" for i in range(4)]
    assert len(stack.positions) > 10
    for pos in stack.positions:  # each position: the same op and shape in every layer
        assert len({(gpt2.attr(v, "op"), gpt2.attr(v, "shape")) for v in pos}) == 1
        assert [gpt2.attr(v, "block") for v in pos] == stack.blocks


def test_composed_plans_fit_and_beat_checkpointing(gpt2):
    cg = gpt2
    base_peak = simulate(cg, build_schedule(cg, save_all_set(cg))).peak_bytes
    checkpoint = block_boundary_set(cg)
    ck_peak = simulate(cg, build_schedule(cg, checkpoint)).peak_bytes
    costs = {}
    budgets = sorted({base_peak, int(0.6 * base_peak), int(0.4 * base_peak), ck_peak}, reverse=True)
    for budget in budgets:
        saved = blockwise_saved_set(cg, budget, checkpoint, lambda n: cost_units(cg, n), deadline=Deadline(5))
        assert saved is not None, budget
        assert simulate(cg, build_schedule(cg, saved)).peak_bytes <= budget
        costs[budget] = _cost(cg, saved)
    assert costs[base_peak] == _cost(cg, save_all_set(cg))  # everything fits: only views are re-taken
    by_budget = [costs[b] for b in budgets]
    assert by_budget == sorted(by_budget)           # less memory never costs less recompute
    assert costs[ck_peak] <= _cost(cg, checkpoint)  # at checkpointing's own peak, no worse than it
    assert costs[int(0.6 * base_peak)] < costs[ck_peak]


def test_below_every_option_nothing_is_returned(gpt2):
    cg = gpt2
    ck_peak = simulate(cg, build_schedule(cg, block_boundary_set(cg))).peak_bytes
    assert blockwise_saved_set(cg, ck_peak // 4, block_boundary_set(cg), lambda n: cost_units(cg, n),
                               deadline=Deadline(5)) is None
