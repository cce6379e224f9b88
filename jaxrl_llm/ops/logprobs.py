"""Per-token log-probabilities and entropies of next-token distributions.

Both compute in float32 whatever the logits' dtype: a bfloat16 log-softmax loses the
precision that importance ratios ``exp(logp - old_logp)`` depend on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    r"""Log-probability of each chosen token, in float32.

    .. math::
        \log \pi(a_t \mid s_t) = z_{t, a_t} - \log \sum_v \exp z_{t, v}

    computed as a gather minus a logsumexp (no full log-softmax). The float32 upcast
    makes one ``[B, T, V]`` float32 temporary: fine for logits that already exist, but
    at real vocabulary sizes a trainer should compute log-probs from the last hidden
    states in chunks over tokens instead of materialising logits at all.

    Args:
      logits: ``[B, T, V]`` next-token logits (any float dtype; upcast to float32).
      tokens: ``[B, T]`` integer token ids ``a_t`` in ``[0, V)``. Ids are not checked
        (they are traced values): an id outside the range gives a meaningless value, so
        padding positions should hold a real id (e.g. the pad id) and be masked.

    Returns:
      ``[B, T]`` float32 log-probabilities.
    """
    fn = "token_logprobs"
    logits = _checks.floating(fn, "logits", logits)
    tokens = _checks.integer(fn, "tokens", tokens)
    _checks.rank(fn, "logits", logits, 3, "[B, T, V]")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"{fn}: `tokens` must have shape [B, T] = {list(logits.shape[:2])} to match "
            f"`logits` {list(logits.shape)}; got {list(tokens.shape)}."
        )
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]  # [B, T]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def entropy(logits: jax.Array) -> jax.Array:
    r"""Entropy of each next-token distribution, in float32.

    .. math::
        H_t = -\sum_v \pi_v \log \pi_v = \log \sum_v e^{z_v} - \sum_v \pi_v z_v

    Entries with logit ``-inf`` (masked out of the vocabulary) contribute zero.

    Args:
      logits: ``[B, T, V]`` next-token logits.

    Returns:
      ``[B, T]`` float32 entropies, each in ``[0, log V]``.
    """
    fn = "entropy"
    logits = _checks.floating(fn, "logits", logits)
    _checks.rank(fn, "logits", logits, 3, "[B, T, V]")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, T, V]
    # 0 * -inf is NaN: zero-probability entries are replaced before the product.
    finite_logits = jnp.where(probs > 0, logits, 0.0)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * finite_logits, axis=-1)
