"""The command line: every subcommand and format through ``main`` in-process, as the console script
calls it (exit code, stdout and stderr captured, in the run's own working directory), and the console
entry as a real subprocess once, on an infeasible budget (its exit code and one stderr line). Each
subprocess costs the imports of torch and the library again (about 3.5 s of CPU), which in-process
runs share. Models are small: the demo MLP chain at width 64 (activations dominate), GPT-2 at 2
layers and width 64.
"""
from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from contextlib import chdir, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest

from remat_compiler.cli import EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, format_progress, main
from remat_compiler.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
DEMO = f"{ROOT / 'examples' / 'demo.py'}:build"
SMALL = [DEMO, "--arg", "width=64", "--arg", "depth=4", "--arg", "batch=512"]
OTHER_WIDTH = [DEMO, "--arg", "width=48", "--arg", "depth=4", "--arg", "batch=512"]
GPT2 = [f"{ROOT / 'examples' / 'gpt2.py'}:build", "--arg", "n_layer=2", "--arg", "n_embd=64",
        "--arg", "n_head=2", "--arg", "seq=32"]
MOE = [f"{ROOT / 'examples' / 'moe.py'}:build", "--arg", "tokens=128", "--arg", "hidden_size=32",
       "--arg", "ffn_hidden_size=64"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ERROR_LINE = re.compile(r"^remat-compiler: error: \S.*$")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _run_process(argv: list[str], cwd: Path) -> Result:
    """``python -m remat_compiler.cli ARGV`` in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "remat_compiler.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def _run_in_process(argv: list[str], cwd: Path) -> Result:
    """``main(ARGV)`` as the console script calls it, in ``cwd``, its output captured."""
    out, err = StringIO(), StringIO()
    with chdir(cwd), redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return Result(code, out.getvalue(), err.getvalue())


class Runs:
    """Named CLI runs, each made when a test first asks for it (``runs[name]``) and kept."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self._argv: dict[str, tuple[list[str], bool]] = {}
        self._done: dict[str, Result] = {}

    def add(self, name: str, *args: str, process: bool = False) -> None:
        self._argv[name] = (list(args), process)

    def __getitem__(self, name: str) -> Result:
        if name not in self._done:
            argv, process = self._argv[name]
            self._done[name] = (_run_process if process else _run_in_process)(argv, self.dir)
        return self._done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("cli"))
    r.add("json", "plan", *SMALL, "--budget", "0.7", "--format", "json", "-o", "plan.json")
    r.add("compare", "compare", *SMALL, "--strategies", "save_all,checkpoint_blocks,cpsat",
            "--budget", "0.8", "--steps", "2", "--time-limit", "5")
    r.add("pareto", "pareto", *SMALL, "--budgets", "1.0,0.7,0.05", "--png", "pareto.png",
            "--time-limit", "5")
    r.add("demo", "demo", "-o", "demo.png", "--time-limit", "10")
    r.add("dot", "plan", *SMALL, "--budget", "0.7", "--format", "dot")
    r.add("infeasible", "plan", *SMALL, "--budget", "1KiB", process=True)
    return r


@pytest.fixture(scope="module")
def saved_plan(runs) -> Path:
    """plan.json from the ``json`` run, and the two ``--load`` runs on it."""
    assert runs["json"].returncode == EXIT_OK, runs["json"].stderr
    path = runs.dir / "plan.json"
    runs.add("load_table", "plan", *SMALL, "--load", str(path), "--all", "--timeline", "timeline.png")
    runs.add("load_other", "plan", *OTHER_WIDTH, "--load", str(path))
    return path


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    assert len(data) > 5 * 1024, f"{path} is only {len(data)} bytes"
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert height >= 200 and width >= 300


def assert_one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert ERROR_LINE.match(lines[0]), lines[0]
    assert "Traceback" not in stderr
    return lines[0]


# ---------------------------------------- JSON
def test_json_round_trips_through_plan_from_json(runs, saved_plan):
    text = saved_plan.read_text()
    doc = json.loads(text)
    assert doc["schema_version"] >= 1 and doc["digest"]
    plan = Plan.from_json(text)
    assert plan.to_json() == text.strip()
    assert plan.digest() == doc["digest"]
    assert plan.recomputed, "budget 0.7 should make the plan recompute something"
    assert plan.peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert "wrote plan.json" in runs["json"].stderr


# ---------------------------------------- corrupt plan files (in-process)
def _corruptions(text: str) -> dict[str, str]:
    doc = json.loads(text)
    wrong_schema = dict(doc, schema_version=99)
    no_schedule = {k: v for k, v in doc.items() if k != "schedule"}
    bad_values = dict(doc, values=[{"name": "x"}])
    edited = text.replace(f'"{doc["saved"][0]}"', '"not_a_node"', 1)
    return {"truncated": text[: len(text) // 2], "edited": edited, "not a plan": '{"a": 1}',
            "schema": json.dumps(wrong_schema), "no schedule": json.dumps(no_schedule),
            "bad values": json.dumps(bad_values), "empty": "", "binary": "\udcff\x00\x01"}


@pytest.mark.parametrize("kind", ["truncated", "edited", "not a plan", "schema", "no schedule",
                                  "bad values", "empty", "binary"])
def test_load_detects_a_corrupt_file(kind, saved_plan, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    text = _corruptions(saved_plan.read_text())[kind]
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["plan", *SMALL, "--load", str(bad)]) == EXIT_USAGE
    line = assert_one_error_line(capsys.readouterr().err)
    assert "not a valid plan" in line


# ---------------------------------------- examples (in-process)
@pytest.fixture(scope="module")
def gpt2_plan() -> Plan:
    """The GPT-2 factory planned through the CLI (in-process: once), holding its outputs."""
    argv = ["-q", "plan", *GPT2, "--budget", "0.9", "--solver", "checkpoint_blocks", "--format", "json"]
    out = StringIO()
    with redirect_stdout(out):
        assert main(argv) == EXIT_OK
    return Plan.from_json(out.getvalue())


def test_gpt2_factory_from_the_cli(gpt2_plan):
    """Keyword example inputs and a loss taken from the output, through the CLI."""
    plan = gpt2_plan
    assert plan.solver == "checkpoint_blocks" and plan.recomputed
    assert plan.peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes


def test_drop_outputs_and_flops_objective(tmp_path, capsys, gpt2_plan):
    """--drop-outputs plans for a caller keeping only the loss (a smaller no-recompute peak than
    holding the logits); its plan file re-applies only with --drop-outputs; --objective reaches CP-SAT."""
    out = tmp_path / "dropped.json"
    argv = ["-q", "plan", *GPT2, "--budget", "0.9", "--time-limit", "3", "--format", "json"]
    assert main([*argv, "--drop-outputs", "--objective", "flops", "-o", str(out)]) == EXIT_OK
    dropped = Plan.load(str(out))
    assert dropped.extras["objective"] == "flops" and dropped.peak_bytes <= dropped.budget_bytes
    assert dropped.baseline_peak_bytes < gpt2_plan.baseline_peak_bytes  # the outputs held
    assert main(["-q", "plan", *GPT2, "--load", str(out)]) == EXIT_USAGE
    assert "graph" in assert_one_error_line(capsys.readouterr().err)
    assert main(["-q", "plan", *GPT2, "--load", str(out), "--drop-outputs"]) == EXIT_OK


def test_moe_factory_from_the_cli(capsys):
    assert main(["-q", "plan", *MOE, "--budget", "0.95", "--format", "json", "--time-limit", "5"]) == EXIT_OK
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.peak_bytes <= plan.budget_bytes


def test_demo_script_runs(capsys):
    from remat_compiler.workload import load_factory

    load_factory(f"{ROOT / 'examples' / 'demo.py'}:main")()
    out = capsys.readouterr().out
    assert "plan by cpsat" in out and "measured peak" in out


# ---------------------------------------- argument errors (in-process)
@pytest.mark.parametrize("argv, needle", [
    (["plan", *SMALL, "--budget", "lots"], "--budget"),
    (["plan", *SMALL, "--solver", "magic"], "unknown solver"),
    (["plan", "examples/demo.py", "--budget", "0.5"], "MODULE:FACTORY"),
    (["plan", "no/such/file.py:build"], "does not exist"),
    (["plan", "no_such_module_xyz:build"], "no module named"),
    (["plan", f"{ROOT / 'examples' / 'demo.py'}:nope"], "has no function"),
    (["plan", *SMALL, "--arg", "colour=red"], "does not take arguments"),
    (["plan", *SMALL, "--arg", "novalue"], "KEY=VALUE"),
    (["plan", *SMALL, "--format", "yaml"], "--format"),
    (["plan", *SMALL, "--time-limit", "0"], "--time-limit"),
    (["plan", *SMALL, "--load", "plan.json", "--budget", "0.5"], "--load"),
    (["pareto", *SMALL, "--budgets", "1.0,lots"], "--budgets"),
    (["pareto", *SMALL], "--budgets"),
    (["compare", *SMALL, "--strategies", "save_all,magic"], "unknown solver"),
    (["compare", *SMALL, "--strategies", "save_all", "--steps", "0"], "--steps"),
    (["-q", "-v", "plan", *SMALL], "exclude each other"),
    (["plan", *SMALL, "--budget", "1e400"], "too large"),
    (["plan", *SMALL, "--budget", "1.5"], "neither a fraction"),
    (["plan", *SMALL, "-o", "/no_such_dir_xyz/plan.json"], "cannot write /no_such_dir_xyz/plan.json"),
    (["plan", *SMALL, "--timeline", "/no_such_dir_xyz/t.png"], "cannot write /no_such_dir_xyz/t.png"),
    (["frobnicate"], "No such command"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("{}")
    assert main(argv) == EXIT_USAGE
    assert needle in assert_one_error_line(capsys.readouterr().err)


def test_verbose_adds_the_traceback(capsys):
    assert main(["-v", "plan", *SMALL, "--budget", "1KiB"]) == EXIT_INFEASIBLE
    err = capsys.readouterr().err
    assert "Traceback" in err and "InfeasibleBudgetError" in err
    assert ERROR_LINE.match(err.strip().splitlines()[-1])


def test_python_dash_m_remat_compiler(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["remat-compiler", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("remat_compiler", run_name="__main__")
    assert exit_info.value.code == EXIT_OK
    assert "plan" in capsys.readouterr().out


# ---------------------------------------- progress
def test_progress_shows_on_a_terminal_and_not_when_quiet(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["plan", *SMALL, "--budget", "0.7", "--format", "json"]) == EXIT_OK
    err = capsys.readouterr().err
    assert re.search(r"cpsat: \d+\.\d s, best cost [\d,]+, bound [\d,]+, gap \d+\.\d%", err), err
    assert main(["--quiet", "plan", *SMALL, "--budget", "0.7", "--format", "json"]) == EXIT_OK
    assert capsys.readouterr().err == ""


def test_progress_stays_quiet_when_stderr_is_not_a_terminal(runs):
    assert "gap" not in runs["json"].stderr and "\r" not in runs["json"].stderr


def test_format_progress():
    line = format_progress("cpsat", {"elapsed_s": 2.25, "objective": 1500.0, "bound": 1200.0, "gap": 0.2})
    assert line == "cpsat: 2.2 s, best cost 1,500, bound 1,200, gap 20.0%"


# ---------------------------------------- infeasible budget
def test_infeasible_budget_exits_3_and_names_the_smallest_budget(runs, capsys):
    res = runs["infeasible"]
    assert res.returncode == EXIT_INFEASIBLE
    line = assert_one_error_line(res.stderr)
    m = re.search(r"smallest feasible budget .* is (\d+) bytes", line)
    assert m, line
    assert main(["-q", "plan", *SMALL, "--budget", m.group(1), "--format", "json"]) == EXIT_OK
    assert Plan.from_json(capsys.readouterr().out).peak_bytes <= int(m.group(1))


# ---------------------------------------- --load (started once plan.json exists)
def test_load_reapplies_the_plan_and_prints_every_row_with_the_totals(runs, saved_plan):
    res = runs["load_table"]
    assert res.returncode == EXIT_OK, res.stderr
    plan = Plan.from_json(saved_plan.read_text())
    out = res.stdout
    for label in ("budget", "predicted peak", "no-recompute peak", "of the step", "solved in"):
        assert label in out
    assert f"plan {plan.digest()} for graph {plan.fingerprint}" in out
    assert plan.status in out
    header = next(line for line in out.splitlines() if line.startswith("name "))
    assert header.split() == ["name", "op", "shape", "bytes", "FLOPs", "decision", "reason"]
    rows = [re.match(r"(\S+)\s.*?\s(saved|recomputed)\s{2,}\S", line) for line in out.splitlines()]
    decisions = {m.group(1): m.group(2) for m in rows if m}
    assert decisions == {v.name: v.decision for v in plan.values}  # --all: every row, no "more rows"
    assert_png(runs.dir / "timeline.png")


def test_load_refuses_a_plan_for_another_graph(runs, saved_plan):
    res = runs["load_other"]
    assert res.returncode == EXIT_USAGE
    line = assert_one_error_line(res.stderr)
    assert "--load" in line and "made for graph" in line


# ---------------------------------------- DOT
def _parse_dot_minimal(text: str) -> tuple[dict[str, dict[str, str]], list[tuple[str, str]]]:
    """Nodes with attributes and edges, from the one-statement-per-line DOT that plan_to_dot writes."""
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    nodes, edges = {}, []
    for line in text.splitlines()[1:-1]:
        if m := re.fullmatch(r'\s*"([^"]+)" -> "([^"]+)";', line):
            edges.append(m.groups())
        elif m := re.fullmatch(r'\s*"([^"]+)" \[(.*)\];', line):
            nodes[m.group(1)] = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        else:
            assert re.fullmatch(r"\s*(graph|node|edge) \[.*\];", line), f"unexpected DOT line {line!r}"
    return nodes, edges


@pytest.mark.filterwarnings("ignore:.*deprecated:DeprecationWarning")  # pydot's use of pyparsing
def test_dot_parses_and_colours_the_plan(runs, saved_plan):
    res = runs["dot"]
    assert res.returncode == EXIT_OK, res.stderr
    plan = Plan.from_json(saved_plan.read_text())
    nodes, edges = _parse_dot_minimal(res.stdout)
    assert all(u in nodes and v in nodes for u, v in edges)
    classes = {n: a["class"] for n, a in nodes.items()}
    assert {n for n, c in classes.items() if c == "saved"} == set(plan.saved)
    assert {n for n, c in classes.items() if c == "recomputed"} == set(plan.recomputed)
    assert "backward" in classes.values() and "dropped" not in set(plan.saved)

    pydot = pytest.importorskip("pydot")
    import networkx as nx

    (dot_graph,) = pydot.graph_from_dot_data(res.stdout)
    g = nx.drawing.nx_pydot.from_pydot(dot_graph)
    assert set(g.nodes) == set(nodes) and g.number_of_edges() == len(edges)
    assert {n for n, a in g.nodes(data=True) if a.get("class", "").strip('"') == "saved"} == set(plan.saved)


# ---------------------------------------- pareto, compare, demo
def test_pareto_table_and_picture(runs):
    res = runs["pareto"]
    assert res.returncode == EXIT_OK, res.stderr
    rows = {line.split("  ")[0].strip(): line for line in res.stdout.splitlines()}
    for label in ("cpsat @ 1.0", "cpsat @ 0.7", "cpsat @ 0.05", "save_all", "checkpoint_blocks"):
        assert label in rows, res.stdout
    # no plan in the time limit; the lowest peak found, not proven minimal (reruns leave no proof)
    assert "no plan found" in rows["cpsat @ 0.05"] and "not proven minimal" in res.stdout
    assert "optimal" in rows["save_all"] and "+0.0%" in rows["save_all"]
    assert_png(runs.dir / "pareto.png")


def test_compare_runs_each_strategy_for_real(runs):
    res = runs["compare"]
    assert res.returncode == EXIT_OK, res.stderr
    lines = res.stdout.splitlines()
    header = lines[0]
    rows = {line.split()[0]: line for line in lines[2:] if line.strip()}
    assert set(rows) >= {"eager", "save_all", "checkpoint_blocks", "cpsat"}
    assert "infeasible" in rows["save_all"]  # budget 0.8 is below the no-recompute peak
    for name in ("checkpoint_blocks", "cpsat"):
        cells = re.split(r"\s{2,}", rows[name])
        named = dict(zip(re.split(r"\s{2,}", header), cells))
        assert named["status"] == "ok" and named["fits budget"] == "yes", rows[name]
        assert float(named["max |grad err|"]) < 1e-4
        assert 0.9 <= float(named["meas/pred"]) <= 1.05  # measured peak is what the plan predicted
        assert named["median step"].endswith(" ms")
        assert int(named["FLOPs"].replace(",", "")) > 0


def test_demo_prints_the_plan_and_writes_the_timeline(runs):
    res = runs["demo"]
    assert res.returncode == EXIT_OK, res.stderr
    assert "plan by cpsat" in res.stdout and "predicted peak" in res.stdout
    m = re.search(r"timeline picture written to (.+)$", res.stdout.strip())
    assert m and Path(m.group(1)) == runs.dir / "demo.png"
    assert_png(runs.dir / "demo.png")


def test_device_preset_sets_the_runtime_estimate(capsys):
    """--device plans with an accelerator's rates: the plan's estimated recompute time is the H100's,
    far below this CPU's for the same saved set; an unknown name is a usage error."""
    assert main(["-q", "plan", *SMALL, "--budget", "0.7", "--device", "h100", "--format", "json"]) == EXIT_OK
    on_h100 = Plan.from_json(capsys.readouterr().out)
    assert main(["-q", "plan", *SMALL, "--budget", "0.7", "--format", "json"]) == EXIT_OK
    on_cpu = Plan.from_json(capsys.readouterr().out)
    assert on_h100.baseline_s < on_cpu.baseline_s / 10
    assert main(["-q", "plan", *SMALL, "--device", "tpu"]) == EXIT_USAGE
