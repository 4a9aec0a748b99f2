"""GPT-2 from HuggingFace transformers, built from a small random config (nothing is downloaded).

CLI: ``remat-compiler plan examples/gpt2.py:build --budget 0.5``. Python: ``python examples/gpt2.py``.
"""
from __future__ import annotations

import torch

__all__ = ["build", "make_gpt2"]


def make_gpt2(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, vocab_size: int = 1024,
              n_positions: int = 256, dropout: float = 0.0, seed: int = 0):
    """A GPT2LMHeadModel with random weights from a small config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=n_positions, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, use_cache=False,  # token ids inside the small vocabulary:
                        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the default loss, named so that transformers does not warn
    return model


def build(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, vocab_size: int = 1024, batch: int = 2,
          seq: int = 128, dropout: float = 0.0, seed: int = 0):
    """GPT-2 with labels, so the model computes its own loss: returns ``(model, (), kwargs-style inputs)``.

    Returns ``(model, example_inputs, loss_fn)`` where ``example_inputs`` is a dict of keyword
    arguments and ``loss_fn`` takes the model's output and returns ``output.loss``.
    """
    model = make_gpt2(n_layer, n_embd, n_head, vocab_size, max(seq, 128), dropout, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


if __name__ == "__main__":
    import remat_compiler

    model, inputs, loss_fn = build()
    compiled = remat_compiler.compile(model, memory_budget=0.5)
    loss_fn(compiled(**inputs)).backward()
    print(compiled.plan.explain())
