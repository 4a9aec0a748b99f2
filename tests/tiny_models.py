"""Tiny seeded models shared by several test files."""
from __future__ import annotations

import pytest
import torch


def tiny_mixtral(num_local_experts: int = 8):
    """A 2-layer HuggingFace Mixtral (hidden 32, vocab 64, top-2) with random weights, in train mode: the
    library's default config with only sizes shrunk (``use_cache``, attention implementation, router
    jitter and dropout as they come)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=num_local_experts, num_experts_per_tok=2,
        max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config).train()
