"""Shared fixtures: the seed workloads and helpers to run and measure a training step."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def run_step(model, call, loss_fn=None):
    """Run forward+backward once; return (loss, {param name: grad}, {input index: grad})."""
    for p in model.parameters():
        p.grad = None
    out = call()
    loss = loss_fn(out) if loss_fn else (out.loss if hasattr(out, "loss") else out)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield
