"""Tokens fed into an existing KV cache (a tool's result between turns) give the next-token
logits of a from-scratch pass over each row's whole conversation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import decoder
from tests.models.test_cache import CONFIGS

BASE = dataclasses.replace(CONFIGS["llama-gqa"], max_position_embeddings=64)
FAMILIES = {
    "llama": BASE,
    "mistral": dataclasses.replace(BASE, architecture="mistral", sliding_windows=(64, 64)),
    "qwen2": dataclasses.replace(BASE, architecture="qwen2", attention_bias=True),
    "qwen3": dataclasses.replace(BASE, architecture="qwen3", qk_norm=True, tie_word_embeddings=True),
    "llama-scanned": dataclasses.replace(BASE, scan_layers=True),
}
PROMPTS, GROUP, PROMPT_LEN, CACHE = 2, 3, 6, 40


def conversations(vocab: int, seed: int = 0):
    """Each row's conversation as segments: ``("decode", active [B])`` one token per active
    row, or ``("extend", tokens [B, E], counts [B])`` each row's first ``counts`` tokens."""
    rng = np.random.default_rng(seed)
    batch = PROMPTS * GROUP
    segments = []
    for kind, width in (("decode", 3), ("extend", 5), ("decode", 2), ("extend", 4), ("decode", 2)):
        if kind == "decode":
            for _ in range(width):
                segments.append(("decode", rng.integers(0, vocab, batch), rng.random(batch) < 0.7))
        else:
            counts = rng.integers(0, width + 1, batch)
            counts[0] = width  # one row fills the width, one feeds nothing
            counts[1] = 0
            segments.append(("extend", rng.integers(0, vocab, (batch, width)), counts))
    return segments


@pytest.mark.parametrize("family", list(FAMILIES))
def test_extending_the_cache_gives_the_logits_of_the_whole_conversation(family):
    config = FAMILIES[family]
    model, params = models.init(config, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, config.vocab_size, (PROMPTS, PROMPT_LEN))
    prompt_mask = np.ones((PROMPTS, PROMPT_LEN), bool)
    prompt_mask[1, :3] = False  # left padding
    logits, cache = jax.jit(
        functools.partial(models.prefill, cache_size=CACHE, last_logits_only=True), static_argnums=0
    )(model, params, jnp.asarray(prompts), jnp.asarray(prompt_mask))
    cache = cache.repeat_rows(GROUP)  # shared prompts: the G rows of a prompt continue its one prefill
    rows = [list(prompts[b // GROUP][prompt_mask[b // GROUP]]) for b in range(PROMPTS * GROUP)]
    extend = jax.jit(lambda p, t, m, c: models.extend(model, p, t, m, c, last_logits_only=True))
    checks = []  # (row, tokens so far, the logits extend gave after them)
    for segment in conversations(config.vocab_size):
        if segment[0] == "decode":
            _, tokens, active = segment
            step_logits, cache = extend(params, jnp.asarray(tokens[:, None]), jnp.asarray(active[:, None]), cache)
            fed = active
            for b in np.flatnonzero(active):
                rows[b].append(int(tokens[b]))
        else:
            _, tokens, counts = segment
            mask = np.arange(tokens.shape[1])[None] < counts[:, None]
            step_logits, cache = extend(params, jnp.asarray(tokens), jnp.asarray(mask), cache)
            fed = counts > 0
            for b in range(len(rows)):
                rows[b].extend(int(t) for t in tokens[b, : counts[b]])
        # Rows fed nothing keep their previous next-token logits (the caller's to keep).
        checks += [(b, len(rows[b]), np.asarray(step_logits[b])) for b in np.flatnonzero(fed)]
    # The reference: one from-scratch pass over every row's whole conversation, left-padded,
    # by the unrolled layers (the stacked layout's weights unstacked); position i's logits
    # are the next-token logits after the first i + 1 tokens.
    width = max(map(len, rows))
    padded = np.array([[0] * (width - len(r)) + r for r in rows])
    mask = np.array([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    unrolled, unrolled_params = models.with_scan_layers(model, params, False)
    expected = np.asarray(
        models.forward(unrolled, unrolled_params, jnp.asarray(padded), attention_mask=jnp.asarray(mask))
    )
    assert len(checks) > 20
    for b, length, got in checks:
        want = expected[b, width - len(rows[b]) + length - 1]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"row {b} after {length} tokens")
    np.testing.assert_array_equal(cache.next_position, [len(r) for r in rows])
    assert cache.stacked == config.scan_layers
    assert {decoder.is_stacked(path) for path, _ in nnx.to_flat_state(params) if path[0] == "layers"} == {
        config.scan_layers
    }


def test_extend_refuses_what_does_not_fit_and_matches_decode_step():
    config = FAMILIES["llama"]
    model, params = models.init(config, jax.random.key(0))
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 10]])
    logits, cache = models.prefill(model, params, tokens, cache_size=5, last_logits_only=True)
    one, _ = models.extend(model, params, jnp.asarray([[3], [4]]), jnp.ones((2, 1), bool), cache, last_logits_only=True)
    step, _ = models.decode_step(model, params, jnp.asarray([3, 4]), cache)
    np.testing.assert_allclose(one, step, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit the cache: 2 of its 5 slots are free"):
        models.extend(model, params, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), cache)
    with pytest.raises(ValueError, match="mask"):
        models.extend(model, params, jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 3), bool), cache)
    overrun = jax.jit(lambda c: models.extend(model, params, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), c))
    assert np.isnan(np.asarray(overrun(cache)[0])).all()  # under jit: loudly wrong, never a clamped write


def test_gradient_free_of_masked_tokens():
    """Ids under ``mask = 0`` are never read by a real token."""
    config = FAMILIES["qwen3"]
    model, params = models.init(config, jax.random.key(0))
    _, cache = models.prefill(model, params, jnp.asarray([[5, 6, 7]]), cache_size=8)
    mask = jnp.asarray([[True, True, False, False]])
    first, _ = models.extend(model, params, jnp.asarray([[1, 2, 3, 4]]), mask, cache, last_logits_only=True)
    second, _ = models.extend(model, params, jnp.asarray([[1, 2, 50, 9]]), mask, cache, last_logits_only=True)
    np.testing.assert_array_equal(first, second)
