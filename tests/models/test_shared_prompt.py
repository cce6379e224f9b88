"""Completion states with each group's prompt run once equal those of the full forward pass."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models, ops
from jaxrl_llm.models.functional import group_completion_hidden_states
from tests.models.test_cache import CONFIGS

PROMPTS, GROUP, PROMPT_LEN, COMPLETION_LEN = 3, 3, 5, 4


def grouped_batch(vocab: int, *, completion_len: int = COMPLETION_LEN, seed: int = 0):
    """A rollout-shaped batch: ``P`` prompts with different left padding, each repeated
    ``G`` times, and completions that stop early (pad after EOS, masked)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, size=(PROMPTS, PROMPT_LEN))
    prompt_mask = np.ones((PROMPTS, PROMPT_LEN), bool)
    prompt_mask[1, :2] = False
    prompt_mask[2, :4] = False
    prompts[~prompt_mask] = 0
    batch = PROMPTS * GROUP
    completion = rng.integers(0, vocab, size=(batch, completion_len))
    lengths = rng.integers(1, completion_len + 1, size=batch)
    completion_mask = np.arange(completion_len)[None] < lengths[:, None]
    completion[~completion_mask] = 0
    tokens = np.concatenate([np.repeat(prompts, GROUP, axis=0), completion], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, GROUP, axis=0), completion_mask], axis=1)
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jnp.asarray(completion_mask)


@functools.partial(jax.jit, static_argnames=("model", "completion_len", "group_size"))
def hidden(model, params, tokens, mask, *, completion_len, group_size):
    return models.completion_hidden_states(model, params, tokens, mask, completion_len, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("model", "group_size"))
def weighted_logprob_grad(model, params, tokens, mask, completion_mask, weights, *, group_size):
    """Gradient of sum(w * log pi(completion token)) over the completion's real tokens."""

    def objective(p):
        logp = models.completion_logprobs(model, p, tokens, mask, COMPLETION_LEN, group_size=group_size)
        return jnp.sum(jnp.where(completion_mask, weights * logp, 0.0))

    return jax.grad(objective)(params)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shared_prompt_states_and_gradients_equal_the_full_pass(name):
    model, params = models.init(CONFIGS[name], jax.random.key(0))
    tokens, mask, completion_mask = grouped_batch(CONFIGS[name].vocab_size)
    expected = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=1)  # [B, N, E]
    shared = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=GROUP)
    assert shared.shape == expected.shape == (PROMPTS * GROUP, COMPLETION_LEN, CONFIGS[name].hidden_size)
    real = np.asarray(completion_mask)[..., None]  # after a stop a state is meaningless: the shared pass
    np.testing.assert_allclose(np.where(real, shared, 0), np.where(real, expected, 0), atol=2e-5)  # attends to it

    weights = jax.random.normal(jax.random.key(1), completion_mask.shape)
    full_grad = weighted_logprob_grad(model, params, tokens, mask, completion_mask, weights, group_size=1)
    shared_grad = weighted_logprob_grad(model, params, tokens, mask, completion_mask, weights, group_size=GROUP)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full_grad), jax.tree.leaves(shared_grad)):
        scale = float(jnp.max(jnp.abs(a)))
        assert scale > 0, path  # every parameter is reached, so the comparison means something
        np.testing.assert_allclose(b, a, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_shared_prompt_states_match_in_bfloat16():
    config = dataclasses.replace(CONFIGS["mistral-window-3"], dtype=jnp.bfloat16)
    model, params = models.init(config, jax.random.key(0))
    tokens, mask, completion_mask = grouped_batch(config.vocab_size)
    expected = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=1)
    shared = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=GROUP)
    assert shared.dtype == expected.dtype == jnp.bfloat16
    real = np.asarray(completion_mask)[..., None]
    np.testing.assert_allclose(
        np.where(real, np.asarray(shared, np.float32), 0),
        np.where(real, np.asarray(expected, np.float32), 0),
        atol=2e-2,
    )


def test_a_one_token_completion_needs_only_the_prompt_pass():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens, mask, _ = grouped_batch(61, completion_len=1)
    expected = hidden(model, params, tokens, mask, completion_len=1, group_size=1)
    np.testing.assert_allclose(
        hidden(model, params, tokens, mask, completion_len=1, group_size=GROUP), expected, atol=2e-5
    )


def test_a_row_whose_prompt_differs_from_its_group_gets_nan():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens, mask, completion_mask = grouped_batch(61)
    tokens = tokens.at[4, PROMPT_LEN - 1].set((tokens[4, PROMPT_LEN - 1] + 1) % 61)  # row 1 of group 1
    mask = mask.at[7, 3].set(True)  # row 1 of group 2: a padding slot made real
    states = np.asarray(hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=GROUP))
    bad = np.isnan(states).all(axis=(1, 2))
    np.testing.assert_array_equal(bad, np.isin(np.arange(PROMPTS * GROUP), [4, 7]))
    expected = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=1)
    real = np.asarray(completion_mask)[~bad][..., None]
    np.testing.assert_allclose(
        np.where(real, states[~bad], 0), np.where(real, np.asarray(expected)[~bad], 0), atol=2e-5
    )


def test_padding_tokens_may_differ_within_a_group():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens, mask, _ = grouped_batch(61)
    tokens = tokens.at[7, 0].set(9)  # group 2's prompt starts with 4 padding slots
    states = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=GROUP)
    assert bool(jnp.all(jnp.isfinite(states)))


def test_shared_prompt_arguments_are_checked():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    tokens, mask, _ = grouped_batch(61)
    with pytest.raises(ValueError, match=r"`group_size` \(2\) must divide the batch \(9 rows\)"):
        models.completion_hidden_states(model, params, tokens, mask, COMPLETION_LEN, group_size=2)
    with pytest.raises(ValueError, match=r"`completion_len` \(9\) must leave at least one prompt token"):
        models.completion_hidden_states(model, params, tokens, mask, 9, group_size=GROUP)
    with pytest.raises(ValueError, match="group_size"):
        models.completion_hidden_states(model, params, tokens, mask, COMPLETION_LEN, group_size=0)


def test_chunked_logprobs_with_shared_prompts_match_recomputed_rollout_logprobs():
    """End to end with the sampler's own layout: a rollout's log-probs, recomputed with
    the prompts shared, equal the sampler's (mu = 1's old log-probs)."""
    from jaxrl_llm import sampling

    model, params = models.init(CONFIGS["qwen3-tied"], jax.random.key(0))
    prompts, _, _ = grouped_batch(61)
    prompt_mask = jnp.ones((PROMPTS, PROMPT_LEN), bool).at[1, :2].set(False)
    rollout = sampling.sample(
        model,
        params,
        prompts[::GROUP, :PROMPT_LEN],
        prompt_mask,
        jax.random.key(2),
        num_samples=GROUP,
        max_new_tokens=6,
        eos_ids=(3,),
        pad_id=0,
        bucket=1,
    )
    states = models.completion_hidden_states(model, params, rollout.tokens, rollout.attention_mask, 6, group_size=GROUP)
    logp = ops.chunked_token_logprobs(states, models.output_kernel(model, params), rollout.completion_tokens)
    np.testing.assert_allclose(jnp.where(rollout.completion_mask, logp, 0.0), rollout.logprobs, atol=2e-5)


@functools.partial(jax.jit, static_argnames=("model", "share_prompts"))
def grouped_logprob_grad(model, params, prompts, prompt_mask, completion, completion_mask, weights, *, share_prompts):
    """``(states, gradient of sum(w * log pi))`` through ``group_completion_hidden_states``."""

    def objective(p):
        states = group_completion_hidden_states(model, p, prompts, prompt_mask, completion, share_prompts=share_prompts)
        logp = ops.chunked_token_logprobs(states, models.output_kernel(model, p), completion)
        return jnp.sum(jnp.where(completion_mask, weights * logp, 0.0)), states

    return jax.grad(objective, has_aux=True)(params)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompts_carried_once_give_the_states_and_gradients_of_full_rows(name):
    """``[P, S]`` prompts beside ``[B, N]`` completions, with or without running each
    prompt once, against the full forward pass over each row's prompt + completion
    (the reference), at the completion's real tokens."""
    model, params = models.init(CONFIGS[name], jax.random.key(0))
    tokens, mask, completion_mask = grouped_batch(CONFIGS[name].vocab_size)
    prompts, prompt_mask = tokens[::GROUP, :PROMPT_LEN], mask[::GROUP, :PROMPT_LEN]  # [P, S]
    completion = tokens[:, PROMPT_LEN:]  # [B, N]
    expected = hidden(model, params, tokens, mask, completion_len=COMPLETION_LEN, group_size=1)
    weights = jax.random.normal(jax.random.key(1), completion_mask.shape)
    expected_grad = weighted_logprob_grad(model, params, tokens, mask, completion_mask, weights, group_size=1)
    real = np.asarray(completion_mask)[..., None]  # tokens after a stop: no state that a loss reads
    for share in (True, False):
        grad, states = grouped_logprob_grad(
            model, params, prompts, prompt_mask, completion, completion_mask, weights, share_prompts=share
        )
        assert states.shape == expected.shape
        np.testing.assert_allclose(np.where(real, states, 0), np.where(real, expected, 0), atol=2e-5)
        for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(expected_grad)):
            np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-4)


def test_prompts_carried_once_refuse_a_batch_that_is_not_groups_of_them():
    model, params = models.init(CONFIGS["llama-gqa"], jax.random.key(0))
    prompts, prompt_mask = jnp.ones((3, 4), jnp.int32), jnp.ones((3, 4), bool)
    with pytest.raises(ValueError, match=r"the 8 completions must be a multiple of the 3 prompts"):
        group_completion_hidden_states(model, params, prompts, prompt_mask, jnp.ones((8, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"`completion_tokens` must hold token ids in \[0, 61\)"):
        group_completion_hidden_states(model, params, prompts, prompt_mask, jnp.full((6, 2), 61, jnp.int32))
