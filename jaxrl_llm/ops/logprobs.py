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


def chunked_token_logprobs(
    hidden: jax.Array,
    output_kernel: jax.Array,
    tokens: jax.Array,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Log-probs (and entropies) of ``tokens`` from hidden states, ``chunk_size`` tokens at a time.

    Equal to ``token_logprobs(hidden @ output_kernel / temperature, tokens)`` but never
    holds more than ``[B, chunk_size, V]`` float32 logits: the chunks run in a
    ``lax.scan`` whose body is rematerialised (``jax.checkpoint``) in the backward pass,
    so neither direction stores ``[B, T, V]``. At ``V = 150k`` and ``T = 4k`` that is the
    difference between 2.4 GB per sequence and 150 MB per chunk.

    Args:
      hidden: ``[B, T, E]`` final-norm hidden states (e.g. ``models.hidden_states``).
      output_kernel: ``[E, V]`` output projection (the tied embedding transposed, or the
        LM head).
      tokens: ``[B, T]`` the tokens whose log-probs to return.
      chunk_size: tokens per chunk; ``T`` is padded up to a multiple.
      temperature: logits are divided by it (the sampling temperature; see
        :mod:`jaxrl_llm.sampling`).
      with_entropy: also return the per-token entropies of the same distributions.

    Returns:
      ``[B, T]`` float32 log-probs, and ``[B, T]`` entropies if ``with_entropy``.
    """
    fn = "chunked_token_logprobs"
    hidden = _checks.floating(fn, "hidden", hidden)
    _checks.rank(fn, "hidden", hidden, 3, "[B, T, E]")
    output_kernel = _checks.floating(fn, "output_kernel", output_kernel)
    _checks.rank(fn, "output_kernel", output_kernel, 2, "[E, V]")
    if output_kernel.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"{fn}: `output_kernel` must have shape [E, V] with E = {hidden.shape[-1]} (the hidden width); "
            f"got {list(output_kernel.shape)}."
        )
    tokens = _checks.integer(fn, "tokens", tokens)
    if tokens.shape != hidden.shape[:2]:
        raise ValueError(f"{fn}: `tokens` must have shape [B, T] = {list(hidden.shape[:2])}; got {list(tokens.shape)}.")
    _checks.positive_int(fn, "chunk_size", chunk_size)
    _checks.positive(fn, "temperature", temperature)

    batch, length, width = hidden.shape
    chunk = min(chunk_size, length)
    num_chunks = -(-length // chunk)
    padded = num_chunks * chunk
    # [B, T, E] -> [num_chunks, B, chunk, E] (padding gets token 0; sliced off below).
    hidden_chunks = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
    hidden_chunks = hidden_chunks.reshape(batch, num_chunks, chunk, width).swapaxes(0, 1)
    token_chunks = jnp.pad(tokens, ((0, 0), (0, padded - length))).reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.matmul(h, output_kernel.astype(h.dtype), preferred_element_type=jnp.float32) / temperature
        logp = token_logprobs(logits, t)  # [B, chunk]
        return logp, (entropy(logits) if with_entropy else jnp.zeros_like(logp))

    _, (logp, ent) = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (hidden_chunks, token_chunks))
    logp = logp.swapaxes(0, 1).reshape(batch, padded)[:, :length]  # [num_chunks, B, chunk] -> [B, T]
    if not with_entropy:
        return logp
    return logp, ent.swapaxes(0, 1).reshape(batch, padded)[:, :length]
