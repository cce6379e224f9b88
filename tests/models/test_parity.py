"""Logits against transformers' PyTorch implementations, on left-padded GQA batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from tests.models.hf_fixtures import hf_logits, left_padded_batch, tiny_hf_model

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mistral-window-3": ("mistral", {"sliding_window": 3}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf_model = tiny_hf_model(family, **overrides)
    hf_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path)
    assert model.config.architecture == family
    assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert ("lm_head" in params) != model.config.tie_word_embeddings

    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    ours = jax.jit(models.forward)(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    expected = hf_logits(hf_model, tokens, mask, positions)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(ours)[valid] - expected[valid]).max() <= 1e-4
    assert np.all(np.isfinite(np.asarray(ours)))  # padding positions are finite too


def test_default_positions_start_at_the_first_real_token(tmp_path):
    hf_model = tiny_hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path)
    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    implicit = models.forward(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    explicit = models.forward(
        model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask), positions=jnp.asarray(positions)
    )
    np.testing.assert_array_equal(implicit, explicit)


def test_hidden_states_times_output_projection_are_the_logits(tmp_path):
    hf_model = tiny_hf_model("qwen3", tie_word_embeddings=True)
    hf_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path)
    tokens, mask, _ = left_padded_batch(model.config.vocab_size)
    hidden = models.hidden_states(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    assert hidden.shape == (3, 7, model.config.hidden_size)
    np.testing.assert_allclose(
        models.logits_from_hidden(model, params, hidden),
        models.forward(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_frequencies_match_transformers_and_hold_at_large_positions(rope_parameters, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxrl_llm.models.decoder import inverse_frequencies

    hf_model = tiny_hf_model(
        "llama",
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=64,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    init = (
        ROPE_INIT_FUNCTIONS.get(rope_parameters["rope_type"])
        or hf_model.model.rotary_emb.compute_default_rope_parameters
    )
    hf_inv_freq, _ = init(hf_model.config)
    hf_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path)
    # Within an ulp: torch's float32 pow is not correctly rounded on every entry either.
    np.testing.assert_allclose(inverse_frequencies(model.config.rope, 128), hf_inv_freq.numpy(), rtol=1.2e-7, atol=0)
    tokens = np.arange(6)[None] % model.config.vocab_size
    positions = 120_000 + np.arange(6)[None]
    ours = models.forward(model, params, jnp.asarray(tokens), positions=jnp.asarray(positions))
    expected = hf_logits(hf_model, tokens, np.ones_like(tokens), positions)
    assert np.abs(np.asarray(ours) - expected).max() <= 1e-4
