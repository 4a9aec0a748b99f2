"""Differential fuzzing in CI: random training steps (benchmarks/fuzz.py) planned at no limit, at the
no-recompute peak, at the smallest feasible budget and at random budgets between, each compared with
eager (loss and gradients bit-exact in float64, None where eager's are None; buffers; measured peak
under the budget and equal to the prediction; a smaller budget never a larger planned peak).

A bounded number of seeds here (about a minute); the soak is ``python -m benchmarks.fuzz --seeds 0:2000``."""
from __future__ import annotations

import pytest

from benchmarks.fuzz import check_model, random_model

SEEDS = range(100, 112)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_matches_eager_at_every_budget(seed):
    case = random_model(seed)
    res = check_model(case, time_limit_s=1.0, n_random=1)
    assert res.skipped is None or res.skipped.startswith("eager fails"), res.skipped
    assert res.failures == [], res.failures
    if res.skipped is None:
        assert len(res.runs) >= 3  # no limit, the no-recompute peak and the smallest feasible budget


def test_the_generator_covers_every_op_kind():
    """Over the CI seeds, every kind of op the generator knows appears (so the seeds test them all)."""
    kinds = {k for s in SEEDS for k in random_model(s).ops}
    assert kinds >= {"linear", "matmul", "act", "softmax", "layer_norm", "batch_norm", "conv", "view",
                     "slice_cat", "inplace", "inplace_slice", "const", "empty_const", "buffer",
                     "buffer_inplace"}, kinds
    dtypes = {str(random_model(s).dtype) for s in SEEDS}
    assert dtypes == {"torch.float32", "torch.float64"}
