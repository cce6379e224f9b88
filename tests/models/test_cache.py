"""Prefill plus one-token steps with the KV cache give the logits of a full forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models

CONFIGS = {
    "llama-gqa": models.ModelConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    ),
    "qwen3-tied": models.ModelConfig(
        architecture="qwen3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=32,
    ),
    "mistral-window-3": models.ModelConfig(
        architecture="mistral",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        sliding_windows=(3, 3),
        max_position_embeddings=32,
    ),
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


def test_right_padded_prompts_are_refused_when_the_mask_is_concrete():
    """Decoding continues after the last slot: a right-padded prompt would be continued
    after its padding."""
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens = jnp.ones((3, 4), jnp.int32)
    right = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]], bool)
    for mask in (right, jnp.asarray(right), right.astype(np.int32)):
        with pytest.raises(
            ValueError,
            match=r"prefill: `attention_mask` row 1 has padding at position 2, after a "
            r"real token: prompts must be left-padded.*padding_side = \"left\"",
        ):
            models.prefill(model, params, tokens, mask, cache_size=6)
    left = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]], bool)
    models.prefill(model, params, tokens, left, cache_size=6)
    # Under jit the mask is traced and cannot be read: not checked.
    jax.jit(functools.partial(models.prefill, cache_size=6))(model, params, tokens, jnp.asarray(right))


def test_prefill_and_decode_refuse_out_of_range_ids_when_concrete():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    message = r"`tokens` must hold token ids in \[0, 61\) \(the vocabulary\); got \[-1, 61\]"
    with pytest.raises(ValueError, match="prefill: " + message):
        models.prefill(model, params, np.array([[1, -1, 61]]), cache_size=4)
    _, cache = models.prefill(model, params, jnp.ones((2, 3), jnp.int32), cache_size=4)
    with pytest.raises(ValueError, match="decode_step: " + message):
        models.decode_step(model, params, jnp.array([61, -1]), cache)
