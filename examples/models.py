"""Built-in example models, each as a factory returning ``(model, example_inputs, loss_fn)``."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["LectureNet", "build_lecture", "MLPChain", "build_mlp", "reverse_mode_step"]


class LectureNet(nn.Module):
    """The seed lecture's 2-2-1 ReLU network, with its exact weights (shared/seeds/003_*)."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(2, 2)
        self.act = nn.ReLU()
        self.out = nn.Linear(2, 1)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.tensor([[0.5, -1.0], [-0.5, 1.0]]))
            self.hidden.bias.copy_(torch.tensor([2.0, 0.0]))
            self.out.weight.copy_(torch.tensor([[2.0, -1.0]]))
            self.out.bias.copy_(torch.tensor([0.5]))

    def forward(self, x, y=None):
        pred = self.out(self.act(self.hidden(x)))
        if y is None:
            return pred
        return 0.5 * ((pred - y) ** 2).sum()


def build_lecture():
    """The lecture network with x=(1,2), y=1; the model computes its own loss ½(ŷ−y)² = 0.5."""
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    y = torch.tensor([[1.0]])
    return LectureNet(), (x, y), None


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class MLPChain(nn.Module):
    """A chain of ``depth`` Linear+GELU blocks of one width, and a scalar head."""

    def __init__(self, width: int = 256, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_mlp(width: int = 256, depth: int = 8, batch: int = 128, seed: int = 0):
    """An MLP chain with a mean-squared-error loss on random data."""
    torch.manual_seed(seed)
    model = MLPChain(width, depth)
    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)
    return model, (x,), lambda out: nn.functional.mse_loss(out, y)


def reverse_mode_step(a, b, c, d):
    """The seed reverse-mode note: L = (a·b + c)·d."""
    return (a * b + c) * d
