"""Tiny random transformers models saved to disk: the reference the decoder is tested against.

torch is imported unconditionally: a missing torch fails these tests, it never skips them.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def tiny_hf_model(family: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random float32 model with GQA (4 query heads, 2 kv heads). Every parameter,
    norms and biases included, is perturbed so that none sits at its trivial init."""
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def left_padded_batch(vocab: int, *, seed: int = 0):
    """Token ids ``[3, 7]`` with 0, 2 and 4 pad positions on the left, its mask and positions."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(3, 7))
    mask = np.ones((3, 7), np.int64)
    mask[1, :2] = 0
    mask[2, :4] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, mask, positions


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        )
    return out.logits.float().numpy()
