"""Do peak resident-set growth (:class:`remat_compiler.memory.ResidentPeak`) and the allocator's
peak (:class:`remat_compiler.memory.AllocatorPeak`) measure what the dispatch-mode tracker measures?
On eager steps, where the tracker sees every tensor the step makes, they must agree; both also see
Inductor's buffers, which the tracker does not.

::

    python -m benchmarks.rss_check            # a table: tracker, RSS and allocator peaks

Each row runs in a fresh process started with ``MALLOC_MMAP_THRESHOLD_=65536``: two warm-up steps, one
step under the tracker, one under ``ResidentPeak``, one under ``AllocatorPeak`` (gradients reset to
None before each, as training starts a step).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from remat_compiler.memory import RSS_ENV

__all__ = ["CASES", "run_fresh", "measure_case", "main"]

ROOT = Path(__file__).resolve().parents[1]

#: The eager cases (where the two methods must agree) and one under torch.compile's Inductor, whose
#: buffers the tracker does not see.
CASES = ("mlp", "mlp-wide", "gpt2-small", "mlp-inductor")


def _build(case: str):
    import torch

    torch.manual_seed(0)
    if case.startswith("mlp"):
        from remat_compiler.examples.models import MLPChain

        width, depth, batch = (512, 8, 256) if case == "mlp" else (1024, 6, 512)
        model = MLPChain(width, depth)
        x = torch.randn(batch, width)
        return model, (x,), {}, lambda out: out.float().square().mean() if out.dim() else out
    from remat_compiler.examples.gpt2 import build

    model, inputs, _ = build(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, batch=2, seq=128)
    return model, (), inputs, lambda out: out.loss


def _child(case: str) -> dict:
    """Runs in the fresh process: the tracker's, the resident set's and the allocator's peak of one
    step each."""
    import torch

    from remat_compiler.memory import AllocatorPeak, LiveStorageTracker, ResidentPeak

    torch.set_num_threads(1)  # one thread: no per-thread arenas growing between the two steps
    model, args, kwargs, loss_fn = _build(case.removesuffix("-inductor"))
    if case.endswith("-inductor"):
        model = torch.compile(model)

    def step():
        for p in model.parameters():
            p.grad = None
        loss_fn(model(*args, **kwargs)).backward()
    step()
    step()  # warm-up: kernels, code pages, autograd's first-use allocations
    with LiveStorageTracker() as tracker:
        step()
    for p in model.parameters():
        p.grad = None
    with ResidentPeak() as rss:
        step()
    for p in model.parameters():
        p.grad = None
    with AllocatorPeak() as allocator:
        step()
    return {"case": case, "tracker_bytes": tracker.peak_bytes, "rss_bytes": rss.peak_bytes,
            "allocator_bytes": allocator.peak_bytes}


def run_fresh(function: str, arg, timeout_s: float = 300, env: dict | None = None):
    """``function(arg)`` computed in a fresh Python process started with
    :data:`~remat_compiler.memory.RSS_ENV` (so :class:`~remat_compiler.memory.ResidentPeak` works there).

    Parameters
    ----------
    function : str
        ``"package.module:name"``, importable from the repository root.
    arg :
        JSON-serialisable; so must be what the function returns (printed as the last line of stdout).
    timeout_s : float
    env : dict, optional
        More environment variables for the process.

    Raises
    ------
    RuntimeError
        If the process fails (the message ends with the last lines of its stderr).
    subprocess.TimeoutExpired
        If it runs longer than ``timeout_s``.

    Example
    -------
    >>> run_fresh("benchmarks.rss_check:_child", "mlp")["case"]          # doctest: +SKIP
    'mlp'
    """
    module, name = function.split(":")
    env = {**os.environ, **RSS_ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    code = (f"import json, sys; from {module} import {name}; "
            f"print(json.dumps({name}(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout_s)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{function}({arg!r}) failed in its fresh process:\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_case(case: str, timeout_s: float = 300) -> dict:
    """Measure ``case`` in a fresh process started with :data:`~remat_compiler.memory.RSS_ENV`."""
    return run_fresh("benchmarks.rss_check:_child", case, timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = p.parse_args(argv)
    print(f"{'case':14} {'tracker (MiB)':>14} {'RSS (MiB)':>10} {'allocator (MiB)':>16} {'RSS / tracker':>14} "
          f"{'allocator / tracker':>20}")
    for case in args.cases.split(","):
        r = measure_case(case)
        tracked = r["tracker_bytes"]
        print(f"{case:14} {tracked / 2**20:14.2f} {r['rss_bytes'] / 2**20:10.2f} {r['allocator_bytes'] / 2**20:16.2f} "
              f"{r['rss_bytes'] / tracked:14.3f} {r['allocator_bytes'] / tracked:20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
