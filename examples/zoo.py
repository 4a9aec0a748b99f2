"""HuggingFace model families built the way users build them: each family's default config with only
its size fields shrunk (width, depth, heads, vocabulary, positions, image size). Behaviour fields
(``use_cache``, dropout, attention implementation, BatchNorm) keep their defaults; the few
exceptions are fields whose default the eager model itself cannot run with, each named below.

``build(name)`` returns ``(model, inputs, loss_fn)`` like every example factory: the model computes
its own loss from ``labels`` and ``loss_fn`` reads it, so the whole step is planned.
"""
from __future__ import annotations

import torch

__all__ = ["FAMILIES", "MOE_FAMILIES", "build", "LossOf"]

# size fields only: width, depth, heads, vocabulary, positions
_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, max_position_embeddings=32)


class LossOf(torch.nn.Module):
    """``model(**inputs).loss``: a HuggingFace model computing its own loss, as Trainer calls it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).loss


def _causal(config_cls, model_cls, **sizes):
    import transformers as T

    cfg = getattr(T, config_cls)(**{**_TEXT, **sizes})
    return getattr(T, model_cls)(cfg), "text"


def _configs():
    return {
        "gpt2": lambda: _gpt2(),
        "llama": lambda: _causal("LlamaConfig", "LlamaForCausalLM", head_dim=16),
        "mistral": lambda: _causal("MistralConfig", "MistralForCausalLM", num_key_value_heads=1,
                                   head_dim=16),
        "qwen2": lambda: _causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
        "qwen3": lambda: _causal("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=16),
        # Phi3's default pad token (32000) lies outside a small vocabulary: eager cannot embed it
        "phi3": lambda: _causal("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2,
                                pad_token_id=127, eos_token_id=127, bos_token_id=1),
        "gemma2": lambda: _causal("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=1,
                                  head_dim=16),
        "gpt_neox": lambda: _causal("GPTNeoXConfig", "GPTNeoXForCausalLM"),
        "opt": lambda: _opt(),
        "falcon": lambda: _falcon(),
        "mixtral": lambda: _causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=1,
                                   head_dim=16, num_local_experts=4),
        "deepseek_v3": lambda: _deepseek_v3(),
        # OLMoE's experts are intermediate_size wide (the default equals hidden_size); its default
        # eos_token_id (50279) lies outside a small vocabulary, which transformers warns about and a
        # loss step never reads, so it stays
        "olmoe": lambda: _causal("OlmoeConfig", "OlmoeForCausalLM", intermediate_size=16,
                                 num_key_value_heads=2, num_experts=16),
        # Qwen2-MoE: top-4 routed experts beside one shared expert MLP scaled by a sigmoid gate (its
        # default width is the dense intermediate_size, four times the routed experts'); 8 of the
        # default 60 experts, so that the experts' weights do not dwarf the activations at 32 tokens
        "qwen2_moe": lambda: _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2,
                                     moe_intermediate_size=16, shared_expert_intermediate_size=64,
                                     num_experts=8),
        "qwen3_moe": lambda: _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=1,
                                     head_dim=16, moe_intermediate_size=16, num_experts=16),
        "t5": lambda: _t5(),
        "bert": lambda: _bert(),
        "vit": lambda: _vit(),
        "resnet": lambda: _resnet(),
    }


def _gpt2():
    import transformers as T

    cfg = T.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    return T.GPT2LMHeadModel(cfg), "text"


def _deepseek_v3():
    """DeepSeek-V3: multi-head latent attention, then per layer a dense MLP (the first
    ``first_k_dense_replace``) or the MoE (a shared expert beside routed experts picked by the
    group-limited, bias-corrected sigmoid router). The router keeps its defaults (8 groups, the best 4
    groups, top-8, scaling 2.5), which need at least 16 experts (two per group: a group's score is its
    best two). ``first_k_dense_replace`` shrinks with the depth (default 3 of 61 layers; 3 of 2 would
    leave no MoE layer): one dense layer, then one MoE layer."""
    return _causal("DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=2,
                   moe_intermediate_size=16, n_routed_experts=16, first_k_dense_replace=1,
                   q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=16)


def _opt():
    import transformers as T

    cfg = T.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32)
    return T.OPTForCausalLM(cfg), "text"


def _falcon():
    import transformers as T

    cfg = T.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    return T.FalconForCausalLM(cfg), "text"


def _t5():
    import transformers as T

    cfg = T.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
    if getattr(cfg, "decoder_start_token_id", None) is None:
        # transformers 5's default T5Config has none, and the eager forward cannot shift labels
        cfg.decoder_start_token_id = cfg.pad_token_id
    return T.T5ForConditionalGeneration(cfg), "seq2seq"


def _bert():
    import transformers as T

    cfg = T.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=32)
    return T.BertForMaskedLM(cfg), "masked"


def _vit():
    import transformers as T

    cfg = T.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=16, patch_size=4, num_labels=3)
    return T.ViTForImageClassification(cfg), "image"


def _resnet():
    import transformers as T

    cfg = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return T.ResNetForImageClassification(cfg), "image32"


FAMILIES = tuple(_configs())
# the families whose MoE blocks passes.moe recognises (moe_origin / moe_fast apply to them)
MOE_FAMILIES = ("mixtral", "deepseek_v3", "olmoe", "qwen2_moe", "qwen3_moe")


def _inputs(kind: str, batch: int, seq: int, gen: torch.Generator) -> dict:
    ids = torch.randint(0, 128, (batch, seq), generator=gen)
    if kind == "text":
        return {"input_ids": ids, "labels": ids}
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(0, 128, (batch, seq // 2), generator=gen)}
    if kind == "masked":
        labels = torch.where(torch.rand(batch, seq, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "labels": labels}
    size = 16 if kind == "image" else 32
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=gen),
            "labels": torch.randint(0, 3, (batch,), generator=gen)}


def build(name: str = "llama", batch: int = 2, seq: int = 16, seed: int = 0):
    """One family's default-config model (sizes shrunk), its inputs, and ``loss_fn`` (the identity:
    the wrapped model returns its loss).

    >>> model, inputs, loss_fn = build("gpt2")   # doctest: +SKIP
    >>> loss_fn(model(**inputs)).backward()        # doctest: +SKIP
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    model, kind = _configs()[name]()
    inputs = _inputs(kind, batch, seq, torch.Generator().manual_seed(seed))
    return LossOf(model).train(), inputs, lambda loss: loss
