"""Tests for remat_compiler.moe: the MoE layer, its fused combine, tracing. Its expert-parallel checks
against one process (``moe_dist_worker.layer_checks``) run in tests/test_moe_compile.py's gloo jobs."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import moe_dist_worker
from moe_dist_worker import run_layer
from remat_compiler.errors import ExpertCapacityError
from remat_compiler.moe import MoELayer, fused_combine, layer as layer_module

H, FFN, E, K = 8, 6, 4, 2  # hidden, ffn, experts, top_k; FFN, 2*FFN and H differ on purpose
NO_DROP = E / K  # capacity_factor that makes C >= T, so no assignment is ever dropped
TOL = dict(rtol=1e-10, atol=1e-12)
MODES = ("autograd", "fused")


def make_layer(combine, capacity_factor=NO_DROP, **kw):
    torch.manual_seed(0)
    return MoELayer(H, FFN, E, K, capacity_factor=capacity_factor, combine=combine, **kw).double()


def tokens(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def layer_params(layer):
    return {
        "router": layer.router.linear.weight,
        "w1": layer.gemm1.weight,
        "w2": layer.gemm2.weight,
    }


def naive_moe(x, router_w, w1, w2, top_k, capacity=None):
    """Per-token loops over experts. With ``capacity``, assignments claim expert rows in (k, t) order."""
    tokens_, ffn = x.shape[0], w2.shape[1]
    routes = []
    for t in range(tokens_):
        scores = torch.softmax(x[t] @ router_w.t(), dim=-1)
        vals, idx = torch.topk(scores, top_k)
        routes.append((vals / vals.sum(), [int(e) for e in idx]))
    kept = {(t, k) for t in range(tokens_) for k in range(top_k)}
    if capacity is not None:
        used = [0] * w1.shape[0]
        kept = set()
        for k in range(top_k):
            for t in range(tokens_):
                e = routes[t][1][k]
                if used[e] < capacity:
                    used[e] += 1
                    kept.add((t, k))
    rows = []
    for t in range(tokens_):
        vals, idx = routes[t]
        out_t = torch.zeros_like(x[t])
        for k in range(top_k):
            if (t, k) in kept:
                h = x[t] @ w1[idx[k]]
                out_t = out_t + vals[k] * ((F.silu(h[:ffn]) * h[ffn:]) @ w2[idx[k]])
        rows.append(out_t)
    return torch.stack(rows), len(kept)


def run_naive(layer, x, g, capacity=None):
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer_params(layer).items()}
    x = x.clone().requires_grad_(True)
    out, num_kept = naive_moe(
        x.reshape(-1, H), params["router"], params["w1"], params["w2"], K, capacity
    )
    out = out.view_as(x)
    out.backward(g)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in params.items()}}, num_kept


def assert_results_close(got, want, label):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{label} {name}: {m}")


# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("shape", [(12, H), (3, 4, H)], ids=["T,H", "B,S,H"])
def test_both_combines_match_naive_reference_without_drops(shape):
    x, g = tokens(shape), tokens(shape, seed=2)
    results = {mode: run_layer(make_layer(mode), x, g) for mode in MODES}
    want, num_kept = run_naive(make_layer("autograd"), x, g)
    assert num_kept == x.numel() // H * K
    assert results["autograd"]["out"].shape == shape
    for mode in MODES:
        assert_results_close(results[mode], want, f"{mode} vs naive")
    assert_results_close(results["fused"], results["autograd"], "fused vs autograd")


def test_capacity_overflow_drops_by_k_major_rule():
    x, g = tokens((16, H)), tokens((16, H), seed=2)
    capacity_factor = 0.5
    capacity = layer_module.expert_capacity(16, K, E, capacity_factor)
    want, num_kept = run_naive(make_layer("autograd"), x, g, capacity=capacity)
    assert num_kept < 16 * K, "the test needs some dropped assignments"
    for mode in MODES:
        first = run_layer(make_layer(mode, capacity_factor), x, g)
        again = run_layer(make_layer(mode, capacity_factor), x, g)
        assert_results_close(first, want, f"{mode} vs naive with capacity {capacity}")
        for name in first:
            assert torch.equal(first[name], again[name]), f"{mode} {name} not deterministic"


@pytest.mark.parametrize("mode", MODES)
def test_uneven_splits_are_dropless_on_one_rank(mode):
    """splits="uneven" with no group: every assignment is kept, also at a capacity that holds the
    routing exactly; one row less raises instead of dropping."""
    x, g = tokens((16, H)), tokens((16, H), seed=2)
    want, num_kept = run_naive(make_layer("autograd"), x, g)
    assert num_kept == 16 * K
    got = run_layer(make_layer(mode, splits="uneven"), x, g)
    assert_results_close(got, want, f"{mode} uneven vs naive")
    fits = max(torch.bincount(make_layer(mode).router(x)[1].reshape(-1), minlength=E).tolist())
    factor = fits / (16 * K / E)  # the least capacity_factor that holds this routing: no drop, no error
    assert factor < NO_DROP
    exact = run_layer(make_layer(mode, factor, splits="uneven"), x, g)
    assert_results_close(exact, want, f"{mode} at {factor}")
    less = make_layer(mode, (fits - 1) / (16 * K / E), splits="uneven")
    with pytest.raises(ExpertCapacityError, match=rf"routed {fits} rows .* at most {fits - 1} rows per expert"):
        run_layer(less, x, g)


def naive_route(counts: torch.Tensor, rank: int, rows_per_expert: int):
    """dropless_route by loops: splits, each expert row's received row, each received row's slot."""
    world, num_experts = counts.shape
    local = num_experts // world
    send = [int(counts[rank, j * local:(j + 1) * local].sum()) for j in range(world)]
    recv = [int(counts[s, rank * local:(rank + 1) * local].sum()) for s in range(world)]
    expert_rows = torch.full((local, rows_per_expert), local * rows_per_expert)
    recv_slots = torch.zeros(local * rows_per_expert, dtype=torch.long)
    received, filled = 0, [0] * local
    for s in range(world):  # received rows come by source rank, then local expert
        for e in range(local):
            for _ in range(int(counts[s, rank * local + e])):
                expert_rows[e, filled[e]] = received
                recv_slots[received] = e * rows_per_expert + filled[e]
                filled[e] += 1
                received += 1
    return torch.tensor(send), torch.tensor(recv), expert_rows, recv_slots


def test_dropless_route_matches_loops():
    # [source rank, expert]: 4 ranks, 2 experts each; experts 4 and 6 get 7 rows, the capacity
    counts = torch.tensor([[3, 0, 2, 1, 4, 0, 0, 1], [0, 5, 1, 0, 2, 2, 1, 0], [1, 1, 0, 3, 0, 0, 5, 0],
                           [2, 0, 0, 0, 1, 1, 1, 4]])
    for rank in range(4):
        got = torch.ops.remat.dropless_route(counts, rank, 7)
        want = naive_route(counts, rank, 7)
        for name, a, b in zip(("send", "recv", "expert_rows", "recv_slots"), got, want):
            assert torch.equal(a, b), (rank, name, a, b)
    counts[0, 6] += 1
    for rank in range(4):  # every rank sees every rank's counts: all raise alike
        with pytest.raises(ExpertCapacityError, match=r"expert 6 \(on rank 3\) was routed 8 rows .* at most "
                                                      r"7 rows per expert .* capacity_factor >= "):
            torch.ops.remat.dropless_route(counts, rank, 7)


def saved_tensor_log(layer, x):
    """Shapes and bytes (numel * element_size) of every tensor autograd saves in one forward."""
    log = []

    def pack(t):
        log.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.clone().requires_grad_(True))
    return log


def test_fused_combine_never_saves_y():
    tokens_ = 12
    x = tokens((tokens_, H))
    # y as the unpermute sees it, one row per (t, k). The expert-side y [E_local, C, H] cannot be
    # told apart by shape (GEMM1 saves the dispatched tokens, same shape); the byte count covers it.
    y_shapes = {(tokens_, K, H), (tokens_ * K, H)}
    y_bytes = tokens_ * K * H * 8  # float64
    logs = {mode: saved_tensor_log(make_layer(mode), x) for mode in MODES}
    assert not [s for s, _ in logs["fused"] if s in y_shapes]
    assert [s for s, _ in logs["autograd"] if s in y_shapes] == [(tokens_, K, H)]
    saved_bytes = {mode: sum(b for _, b in log) for mode, log in logs.items()}
    assert saved_bytes["autograd"] - saved_bytes["fused"] == y_bytes == 1536


@pytest.mark.parametrize("splits", ["equal", "uneven"])
@pytest.mark.parametrize("combine", MODES)
def test_layer_traces_with_aot_autograd_static_shapes(combine, splits):
    tokens_ = 12
    x, g = tokens((tokens_, H)), tokens((tokens_, H), seed=2)
    out, grads, graphs = moe_dist_worker.trace_step(make_layer(combine, splits=splits), x, g)

    want = run_layer(make_layer(combine, splits=splits), x, g)
    torch.testing.assert_close(out, want["out"], **TOL)
    for name, key in [("x", "x"), ("router.linear.weight", "router"), ("gemm1.weight", "w1"),
                      ("gemm2.weight", "w2")]:
        torch.testing.assert_close(grads[name], want[key], **TOL)

    for gm in graphs.values():
        assert moe_dist_worker.count_all_to_all(gm) == 0  # one rank: no collective at all
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert all(isinstance(d, int) for d in val.shape), f"{n.name} has shape {val.shape}"
    saved = [
        tuple(n.meta["val"].shape)
        for n in graphs["bw"].graph.nodes
        if n.op == "placeholder" and not n.name.startswith("tangents")
    ]
    y_saved = [s for s in saved if s in {(tokens_, K, H), (tokens_ * K, H)}]
    assert y_saved == ([] if combine == "fused" else [(tokens_, K, H)])


def test_bad_arguments_raise_value_error(monkeypatch):
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(H, FFN, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(H, FFN, num_experts=4, top_k=0)
    with pytest.raises(ValueError, match="combine"):
        MoELayer(H, FFN, num_experts=4, top_k=2, combine="magic")
    with pytest.raises(ValueError, match="splits"):
        MoELayer(H, FFN, num_experts=4, top_k=2, splits="ragged")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoELayer(H, FFN, num_experts=4, top_k=2, capacity_factor=0)
    layer = make_layer("fused")
    for bad in (torch.randn(H), torch.randn(1, 2, 3, H), torch.randn(5, H + 1)):
        with pytest.raises(ValueError, match="hidden_size|expects"):
            layer(bad.double())
    act, w2 = torch.randn(E, 12, FFN), torch.randn(E, FFN, H)
    probs, slot = torch.rand(12, K), torch.zeros(12, K, dtype=torch.long)
    with pytest.raises(ValueError, match="w2"):
        fused_combine(act, w2.transpose(1, 2), probs, slot)
    with pytest.raises(ValueError, match="slot"):
        fused_combine(act, w2, probs, slot[:, :1])
    monkeypatch.setattr(layer_module, "group_world_size", lambda group: 3)
    with pytest.raises(ValueError, match="not divisible by the expert-parallel group size 3"):
        MoELayer(H, FFN, num_experts=4, top_k=2, group=object())
