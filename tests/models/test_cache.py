"""Prefill plus one-token steps with the KV cache give the logits of a full forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models

CONFIGS = {
    "llama-gqa": models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                     num_kv_heads=2, head_dim=8, max_position_embeddings=32),
    "qwen3-tied": models.ModelConfig(architecture="qwen3", vocab_size=61, hidden_size=32, intermediate_size=48,
                                      num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8, qk_norm=True,
                                      tie_word_embeddings=True, max_position_embeddings=32),
    "mistral-window-3": models.ModelConfig(architecture="mistral", vocab_size=61, hidden_size=32,
                                            intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                            head_dim=8, sliding_windows=(3, 3), max_position_embeddings=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_match_full_forward(name):
    model, params = models.init(CONFIGS[name], jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt_len, steps = 5, 6
    tokens = jnp.asarray(rng.integers(0, 61, size=(3, prompt_len + steps)))
    prompt_mask = np.ones((3, prompt_len), bool)
    prompt_mask[1, :2] = False  # left padding of different lengths
    prompt_mask[2, :4] = False
    full_mask = jnp.concatenate([jnp.asarray(prompt_mask), jnp.ones((3, steps), bool)], axis=1)
    expected = models.forward(model, params, tokens, attention_mask=full_mask)  # [B, S + N, V]

    prefill = jax.jit(functools.partial(models.prefill, cache_size=prompt_len + steps))
    # A closure per test: jit caches are shared by every jax.jit of the same function.
    decode = jax.jit(lambda p, t, c: models.decode_step(model, p, t, c), donate_argnums=2)
    logits, cache = prefill(model, params, tokens[:, :prompt_len], jnp.asarray(prompt_mask))
    valid = np.asarray(prompt_mask)
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(expected[:, :prompt_len])[valid], atol=1e-5)
    last, _ = jax.jit(functools.partial(models.prefill, cache_size=prompt_len + steps, last_logits_only=True))(
        model, params, tokens[:, :prompt_len], jnp.asarray(prompt_mask)
    )
    np.testing.assert_allclose(last, expected[:, prompt_len - 1], atol=1e-5)  # [B, V]
    for t in range(prompt_len, prompt_len + steps):
        step_logits, cache = decode(params, tokens[:, t], cache)
        np.testing.assert_allclose(step_logits, expected[:, t], atol=1e-5, err_msg=f"step {t}")
    assert decode._cache_size() == 1  # one compilation for every step
    np.testing.assert_array_equal(cache.next_position, prompt_mask.sum(1) + steps)


def test_cache_limits_are_enforced():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"`cache_size` \(3\) must be >= the prompt length \(4\)"):
        models.prefill(model, params, tokens, cache_size=3)
    with pytest.raises(ValueError, match=r"cache_size 40 exceeds the model's max_position_embeddings \(32\)"):
        models.prefill(model, params, tokens, cache_size=40)


def test_decoding_into_a_full_cache_returns_nan_not_overwritten_slots():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    _, cache = models.prefill(model, params, jnp.ones((2, 4), jnp.int32), cache_size=5)
    logits, cache = models.decode_step(model, params, jnp.ones((2,), jnp.int32), cache)
    assert np.all(np.isfinite(logits))
    logits, _ = models.decode_step(model, params, jnp.ones((2,), jnp.int32), cache)
    assert np.all(np.isnan(logits))
