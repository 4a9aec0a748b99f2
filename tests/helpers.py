"""Stepping a model, measuring a step's peak and comparing a step with eager's: the one home of these for
the test files and the MoE workers they spawn (``from helpers import ...``, as ``tiny_models``).

- :func:`run_step`: one training step from fresh gradients, optionally measured; a :class:`Step`.
- :func:`planned_step`: a compiled module's first step (it traces and plans), then a measured one.
- :func:`eager_step`: the eager reference, on a copy of the model.
- :func:`token_step` / :func:`token_peaks`: the MoE stacks' step on a token batch, whose input gradient
  is part of the result.
- :func:`assert_same`: a step's loss and gradients against eager's, name by name, within a tolerance.
- :func:`stack_graph`: the cost graph of a small residual stack, for the solver tests.

The peak is :class:`remat_compiler.LiveStorageTracker`'s (and, for the Inductor backend, of the buffers
:func:`remat_compiler.inductor.watch` shows it). Nothing here is allocated inside the measured region but
what the step itself allocates: inputs are cloned before it, gradients collected after it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.memory import LiveStorageTracker

__all__ = ["SEED", "Step", "zero_grads", "grads_of", "run_step", "planned_step", "eager_step", "token_step",
           "token_peaks", "median", "assert_same", "stack_graph"]

SEED = 1234  # the seed the zoo's steps run under: the same dropout masks in eager and compiled steps


class Step(NamedTuple):
    """What one step gave: ``loss`` (what backward ran from, detached), every parameter's gradient by
    name (None where the step reached none), and the step's measured peak in bytes (None: not measured)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    peak: int | None = None


def _params(model) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by name; a compiled module's by its original model's names."""
    return dict(getattr(model, "original", model).named_parameters())


def zero_grads(model) -> None:
    """Fresh gradients: every parameter's ``.grad`` set to None."""
    for p in _params(model).values():
        p.grad = None


def grads_of(model) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's gradient, by name (None where there is none)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in _params(model).items()}


def run_step(model, call: Callable[[], Any], *, loss: Callable[[Any], torch.Tensor] | None = None,
             grad: torch.Tensor | Callable[[], torch.Tensor] | None = None, seed: int | None = None,
             hold_outputs: bool = False, measure: bool = False, inductor=None) -> Step:
    """One training step of ``model`` from fresh gradients: ``out = call()``, then backward from
    ``loss(out)`` (``out`` itself without ``loss``) with the tangent ``grad``.

    ``call`` runs the forward (of ``model`` or of a module compiled from it). ``hold_outputs``: the
    whole of ``out`` is held through the backward, as a caller that keeps the outputs holds them;
    otherwise only what backward runs from (``model(x).loss.backward()`` lets the logits go before
    the backward). ``grad`` may be a function that makes
    the tangent: it is then made inside the step (and measured with it). ``seed``: torch's seed,
    set just before ``call``. ``measure``: run the step under a :class:`LiveStorageTracker` and return
    its peak; ``inductor``: a module compiled with ``backend="inductor"`` whose buffers the tracker
    watches too (implies ``measure``).
    """
    zero_grads(model)
    measure = measure or inductor is not None
    tracker = LiveStorageTracker() if measure else None
    with contextlib.ExitStack() as stack:
        if measure:
            stack.enter_context(tracker)
        if inductor is not None:
            from remat_compiler.inductor import watch

            stack.enter_context(watch(tracker, inductor.planned.inductor))
        if seed is not None:
            torch.manual_seed(seed)
        out = call()
        value = out if loss is None else loss(out)
        if not hold_outputs:
            del out
        value.backward(grad() if callable(grad) else grad)
    return Step(value.detach(), grads_of(model), tracker.peak_bytes if measure else None)


def planned_step(model, call: Callable[[], Any], **options) -> Step:
    """A compiled module's step measured: one :func:`run_step` first (it traces and plans), then one
    measured (``options`` as :func:`run_step`'s, for both)."""
    run_step(model, call, **{k: v for k, v in options.items() if k not in ("measure", "inductor")})
    return run_step(model, call, measure=True, **options)


def eager_step(model, call_on: Callable[[torch.nn.Module], Any], *, steps: int = 2,
               **options) -> tuple[torch.nn.Module, Step]:
    """The eager reference: ``steps`` :func:`run_step` of a deep copy of ``model`` (``call_on(copy)``
    runs its forward), as many as the compiled module runs, so that buffers (BatchNorm's statistics)
    and generators move alike. Returns the copy and its last step."""
    ref = copy.deepcopy(model)
    for _ in range(steps):
        got = run_step(ref, lambda: call_on(ref), **options)
    return ref, got


def token_step(model, x: torch.Tensor, grad=None, *, measure: bool = False, inductor=None):
    """The MoE stacks' step on the tokens ``x`` (cloned, before the step, into a leaf that takes a
    gradient): ``model(x)``, backward from it with ``grad`` (``grad``, ``measure`` and ``inductor``
    as :func:`run_step`'s).

    Returns ``{"loss": ..., "x": dL/dx, name: gradient}`` (``"out"`` for ``"loss"`` where a tangent
    is given); measured: ``(that, peak)``."""
    x = x.detach().clone().requires_grad_(True)
    got = run_step(model, lambda: model(x), grad=grad, measure=measure, inductor=inductor)
    result = {"out" if grad is not None else "loss": got.loss, "x": x.grad, **got.grads}
    return (result, got.peak) if measure or inductor is not None else result


def token_peaks(model, x: torch.Tensor, steps: int, grad=None) -> list[int]:
    """The measured peaks of ``steps`` :func:`token_step`."""
    return [token_step(model, x, grad, measure=True)[1] for _ in range(steps)]


def median(values):
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def assert_same(got, want, label: Any = "", *, rtol: float, atol: float, none_ok: bool = False) -> None:
    """``got``'s tensors are ``want``'s, name by name (the same names), within ``rtol`` / ``atol``
    (:func:`torch.testing.assert_close`, which also checks shape and dtype; 0 and 0: equal).

    Either is a mapping of names to tensors or a :class:`Step` (its loss as ``"loss"``, and its
    gradients). ``none_ok``: a gradient may be None where the other one is None too (a parameter
    the step does not reach); otherwise every one must be there.
    """
    got, want = (_named(s) for s in (got, want))
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    for name, w in want.items():
        g = got[name]
        if none_ok and g is None and w is None:
            continue
        assert g is not None and w is not None, f"{label} {name}: no gradient"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{label} {name}: {m}")


def _named(step) -> Mapping[str, torch.Tensor | None]:
    return {"loss": step.loss, **step.grads} if isinstance(step, Step) else step


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def stack_graph():
    """The cost graph of four identical residual blocks (a ModuleList) and a head, as users write
    them (seeded; the loss inside)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(16) for _ in range(4))
    head = nn.Linear(16, 8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.head = blocks, head

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).square().mean()

    _, cg = rc.analyze(Net(), (torch.randn(512, 16),))  # activations, not weights, make the peak
    return cg


def count_captures(monkeypatch) -> list[int]:
    """``[n]``: how many times AOTAutograd captures a joint graph from now on (its first stage)."""
    from torch._functorch import aot_autograd
    from torch._functorch._aot_autograd import graph_compile

    count, real = [0], graph_compile.aot_stage1_graph_capture

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    for module in (graph_compile, aot_autograd):  # aot_function calls it by the name it imported
        monkeypatch.setattr(module, "aot_stage1_graph_capture", counted)
    return count
