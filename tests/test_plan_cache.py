"""compile(..., plan_cache=DIR) / plan_model(..., plan_cache=DIR): plans reused across processes,
bad files detected and re-planned, concurrent writers safe."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import remat_compiler as rc
from remat_compiler.passes import CostModel
from remat_compiler.plan_cache import CACHE_SCHEMA_VERSION, PlanCache, PlanCacheWarning, cache_key
from remat_compiler.solvers import get_solver

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "plan_cache_worker.py")
sys.path.insert(0, HERE)
from plan_cache_worker import model_and_input  # noqa: E402

OPTS = dict(time_limit_s=10, num_workers=2)


def _worker(directory, *extra, no_solve=False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
    if no_solve:
        env["REMAT_TEST_NO_SOLVE"] = "1"
    return subprocess.Popen([sys.executable, WORKER, str(directory), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]


def _result(proc: subprocess.Popen) -> dict:
    return _results(proc)[-1]


def _files(directory):
    return sorted(p for p in os.listdir(directory) if p.endswith(".plan.json"))


def _plan(directory, budget=0.6, **kw):
    model, x = model_and_input()
    return rc.plan_model(model, (x,), {}, budget, plan_cache=directory, **{**OPTS, **kw})


def test_another_process_reuses_the_plan_without_solving(tmp_path):
    first = _plan(tmp_path)
    assert first.source == "solved" and len(_files(tmp_path)) == 1
    # one fresh process whose solver raises if called: plan_model, then compile's planner, read the file
    again, compiled = _results(_worker(tmp_path, "both", no_solve=True))
    assert again["how"] == "plan_model" and again["source"] == "cache"
    assert again["digest"] == first.plan.digest() and again["solve_time_s"] == first.plan.solve_time_s
    assert compiled["how"] == "compile" and compiled["source"] == "cache"
    assert compiled["digest"] == first.plan.digest()


def test_the_key_covers_budget_cost_model_solver_and_options(tmp_path):
    _plan(tmp_path)
    assert _plan(tmp_path).source == "cache"
    assert _plan(tmp_path, progress=lambda _: None).source == "cache"  # progress does not change the plan
    assert _plan(tmp_path, budget=0.8).source == "solved"
    assert _plan(tmp_path, cost_model=CostModel(compute_flops_per_s=1e13)).source == "solved"
    assert _plan(tmp_path, objective="flops").source == "solved"
    model, x = model_and_input()
    greedy = rc.plan_model(model, (x,), {}, 0.9, solver="greedy", plan_cache=tmp_path)
    assert greedy.source == "solved" and greedy.plan.solver == "greedy"
    assert len(_files(tmp_path)) == 5


def test_a_plan_cached_under_another_costing_is_not_served(tmp_path, monkeypatch):
    """Plans cached before a change of how nodes are costed (passes.costs.COSTING_VERSION: a
    collective charged the bytes a rank sends) are made with other costs for the same rates: the
    solve runs again rather than serve them."""
    import remat_compiler.plan_cache as plan_cache

    _plan(tmp_path)
    assert _plan(tmp_path).source == "cache"
    monkeypatch.setattr(plan_cache, "COSTING_VERSION", plan_cache.COSTING_VERSION - 1)
    assert _plan(tmp_path).source == "solved"


def test_a_corrupt_file_is_detected_and_replanned(tmp_path):
    first = _plan(tmp_path)
    (path,) = [tmp_path / f for f in _files(tmp_path)]
    doc = json.loads(path.read_text())
    plan_doc = json.loads(doc["plan"])
    plan_doc["peak_bytes"] -= 1  # edited: the plan's digest no longer matches
    doc["plan"] = json.dumps(plan_doc)
    path.write_text(json.dumps(doc))
    with pytest.warns(PlanCacheWarning, match="corrupt"):
        again = _plan(tmp_path)
    assert again.source == "solved" and again.plan.peak_bytes == first.plan.peak_bytes
    assert PlanCache(tmp_path)._verified(path.read_text(), doc["key"], again.cg, again.plan.budget_bytes)
    path.write_text(path.read_text()[:100])  # truncated
    with pytest.warns(PlanCacheWarning, match="invalid JSON"):
        assert _plan(tmp_path).source == "solved"
    doc = json.loads(path.read_text())
    doc["cache_schema_version"] = CACHE_SCHEMA_VERSION + 1
    path.write_text(json.dumps(doc))
    with pytest.warns(PlanCacheWarning, match="schema version"):
        assert _plan(tmp_path).source == "solved"
    assert _plan(tmp_path).source == "cache"


def test_a_plan_for_another_graph_or_budget_is_detected_and_replanned(tmp_path):
    first = _plan(tmp_path)
    (path,) = [tmp_path / f for f in _files(tmp_path)]
    model, x = model_and_input()
    other = rc.plan_model(model, (x[:32],), {}, 0.9, **OPTS)  # another graph: other input shape
    assert other.cg.fingerprint != first.cg.fingerprint
    doc = json.loads(path.read_text())
    doc["plan"] = other.plan.to_json()  # a valid plan, in the right file, for another graph
    path.write_text(json.dumps(doc))
    with pytest.warns(PlanCacheWarning, match="made for graph"):
        assert _plan(tmp_path).source == "solved"
    key = doc["key"]
    wider = rc.plan_model(*model_and_input()[:1], (x,), {}, 0.9, **OPTS)
    doc["plan"] = wider.plan.to_json()  # this graph, another budget
    path.write_text(json.dumps(doc))
    with pytest.warns(PlanCacheWarning, match="budget"):
        assert _plan(tmp_path).source == "solved"
    assert json.loads(path.read_text())["key"] == key and _plan(tmp_path).source == "cache"


def _forked_writer(rank: int, _world: int, _port: int, out_dir: str) -> None:
    """One writer of the cache ``out_dir/cache``, in a forked child: ``plan_model`` with the cache, its
    result to ``out_dir/writer{rank}.jsonl``."""
    import contextlib
    import io

    from plan_cache_worker import main

    lines = io.StringIO()
    with contextlib.redirect_stdout(lines):
        main(os.path.join(out_dir, "cache"))
    with open(os.path.join(out_dir, f"writer{rank}.jsonl"), "w") as f:
        f.write(lines.getvalue())


def test_concurrent_writers_both_succeed_and_leave_a_valid_file(tmp_path):
    """Two processes plan the same graph with the same cache at once. They are forked from this one
    (a process started afresh only adds its imports: about 4 s of CPU each); the other tests here
    that need a fresh process, with nothing of this one's, start one."""
    import dist_spawn

    dist_spawn.spawn_ranks(_forked_writer, 2, tmp_path, timeout_s=120)
    results = [json.loads((tmp_path / f"writer{r}.jsonl").read_text().strip().splitlines()[-1]) for r in range(2)]
    cache = tmp_path / "cache"
    assert all(r["source"] in ("solved", "cache") for r in results)
    assert _files(cache) and not [f for f in os.listdir(cache) if f.startswith(".tmp-")]
    again = _plan(cache)
    assert again.source == "cache" and again.plan.digest() in {r["digest"] for r in results}


def test_key_ignores_progress_and_memo_and_plan_with_cache_is_refused(tmp_path):
    model, x = model_and_input()
    planned = rc.plan_model(model, (x,), {}, 0.6, **OPTS)
    cpsat = get_solver("cpsat")
    key = cache_key(planned.cg, 1000, CostModel(), cpsat, {"time_limit_s": 10})
    assert key == cache_key(planned.cg, 1000, CostModel(), cpsat,
                            {"time_limit_s": 10, "progress": print, "memo": object()})
    assert key != cache_key(planned.cg, 1001, CostModel(), cpsat, {"time_limit_s": 10})
    with pytest.raises(ValueError, match="plan_cache"):
        rc.compile(model, plan=planned.plan, plan_cache=tmp_path)


def test_cli_plan_cache_option(tmp_path, capsys):
    from remat_compiler.cli import main

    args = ["plan", f"{WORKER}:build", "--budget", "0.6", "--time-limit", "10", "--plan-cache", str(tmp_path),
            "--format", "json"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert "written to the plan cache" in first.err
    assert main(args) == 0
    second = capsys.readouterr()
    assert "read from the plan cache" in second.err and second.out == first.out
