"""Per-token log-probabilities and entropies of next-token distributions.

Both compute in float32 whatever the logits' dtype: a bfloat16 log-softmax loses the
precision that importance ratios ``exp(logp - old_logp)`` depend on.

Token ids must be in ``[0, V)``. Concrete ids (NumPy, eager ``jax.Array``) are checked and
an id outside raises ``ValueError``; traced ids (under ``jit``) cannot be, and an
out-of-range one gets a NaN log-prob: loudly wrong, never a plausible number (a masked
NaN never reaches a loss, since :func:`jaxrl_llm.ops.aggregate` selects).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks, kl as kl_lib


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
      tokens: ``[B, T]`` integer token ids ``a_t`` in ``[0, V)``, padding positions
        included (give them a real id, e.g. the pad id, and mask them). Concrete ids
        outside the range raise ``ValueError``; under ``jit`` their log-prob is NaN.

    Returns:
      ``[B, T]`` float32 log-probabilities.
    """
    fn = "token_logprobs"
    logits = _checks.floating(fn, "logits", logits)
    ids = _checks.integer(fn, "tokens", tokens)
    _checks.rank(fn, "logits", logits, 3, "[B, T, V]")
    _checks.nonempty(fn, "logits", logits, "a vocabulary of at least one token", axes=(-1,))
    if ids.shape != logits.shape[:2]:
        raise ValueError(
            f"{fn}: `tokens` must have shape [B, T] = {list(logits.shape[:2])} to match "
            f"`logits` {list(logits.shape)}; got {list(ids.shape)}."
        )
    _checks.token_ids(fn, "tokens", tokens, logits.shape[-1])
    return _token_logprobs(logits, ids)


def _token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """:func:`token_logprobs` of validated ``[B, T, V]`` logits and ``[B, T]`` ids; NaN
    where an id is outside ``[0, V)``."""
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    in_range = (tokens >= 0) & (tokens < vocab)  # [B, T]
    chosen = jnp.take_along_axis(logits, jnp.clip(tokens, 0, vocab - 1)[..., None], axis=-1)[..., 0]  # [B, T]
    return jnp.where(in_range, chosen - jax.nn.logsumexp(logits, axis=-1), jnp.nan)


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
    _checks.nonempty(fn, "logits", logits, "a vocabulary of at least one token", axes=(-1,))
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
      tokens: ``[B, T]`` the tokens whose log-probs to return, ids in ``[0, V)``: checked
        when concrete (``ValueError``); under ``jit`` an id outside gets a NaN log-prob.
        ``B, T >= 1``.
      chunk_size: tokens per chunk; ``T`` is padded up to a multiple.
      temperature: logits are divided by it (the sampling temperature; see
        :mod:`jaxrl_llm.sampling`).
      with_entropy: also return the per-token entropies of the same distributions.

    Returns:
      ``[B, T]`` float32 log-probs, and ``[B, T]`` entropies if ``with_entropy``.
    """
    fn = "chunked_token_logprobs"
    _check_hidden_and_kernel(fn, hidden, output_kernel)
    ids = _checks.integer(fn, "tokens", tokens)
    if ids.shape != hidden.shape[:2]:
        raise ValueError(f"{fn}: `tokens` must have shape [B, T] = {list(hidden.shape[:2])}; got {list(ids.shape)}.")
    _checks.token_ids(fn, "tokens", tokens, output_kernel.shape[1])
    _checks.positive_int(fn, "chunk_size", chunk_size)
    _checks.positive(fn, "temperature", temperature)

    chunks = _Chunks(hidden.shape[1], chunk_size)

    @jax.checkpoint
    def one_chunk(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = _logits(h, output_kernel, temperature)  # [B, chunk, V]
        logp = _token_logprobs(logits, t)  # [B, chunk]
        return logp, (entropy(logits) if with_entropy else jnp.zeros_like(logp))

    _, (logp, ent) = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None,
                                  (chunks.split(hidden), chunks.split(ids)))
    if not with_entropy:
        return chunks.join(logp)
    return chunks.join(logp), chunks.join(ent)


def chunked_categorical_kl(
    hidden_p: jax.Array,
    output_kernel_p: jax.Array,
    hidden_q: jax.Array,
    output_kernel_q: jax.Array,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> jax.Array:
    r"""Exact per-token :math:`D_{KL}(p\,\|\,q)` over the vocabulary, from two models' hidden states.

    .. math::
        p = \operatorname{softmax}(h_p W_p / T), \quad q = \operatorname{softmax}(h_q W_q / T),
        \quad D_{KL}(p\|q) = \sum_v p_v (\log p_v - \log q_v)

    Equal to ``kl.categorical(h_p @ W_p / T, h_q @ W_q / T)``, chunked over tokens like
    :func:`chunked_token_logprobs` (a rematerialised ``lax.scan``), so neither direction
    holds more than two ``[B, chunk_size, V]`` float32 logits. Differentiable in both
    models: TRPO's constraint :math:`D_{KL}(\pi_{old}\|\pi_\theta)` and its Fisher-vector
    products go through it, and so does the exact KL-to-reference metric.

    Args:
      hidden_p, hidden_q: ``[B, T, E_p]`` and ``[B, T, E_q]`` final-norm hidden states,
        ``B, T >= 1``.
      output_kernel_p, output_kernel_q: ``[E_p, V]`` and ``[E_q, V]`` output projections.
      chunk_size: tokens per chunk.
      temperature: both models' logits are divided by it.

    Returns:
      ``[B, T]`` float32 KL divergences, each >= 0.
    """
    fn = "chunked_categorical_kl"
    _checks.positive_int(fn, "chunk_size", chunk_size)
    _checks.positive(fn, "temperature", temperature)
    _check_hidden_and_kernel(fn, hidden_p, output_kernel_p, suffix="_p")
    _check_hidden_and_kernel(fn, hidden_q, output_kernel_q, suffix="_q")
    if hidden_p.shape[:2] != hidden_q.shape[:2] or output_kernel_p.shape[1] != output_kernel_q.shape[1]:
        raise ValueError(
            f"{fn}: both models need the same [B, T] and vocabulary; got hidden_p {list(hidden_p.shape)}, "
            f"hidden_q {list(hidden_q.shape)}, output_kernel_p {list(output_kernel_p.shape)}, "
            f"output_kernel_q {list(output_kernel_q.shape)}."
        )
    chunks = _Chunks(hidden_p.shape[1], chunk_size)

    @jax.checkpoint
    def one_chunk(h_p: jax.Array, h_q: jax.Array) -> jax.Array:
        return kl_lib.categorical(_logits(h_p, output_kernel_p, temperature),
                                  _logits(h_q, output_kernel_q, temperature))  # [B, chunk]

    _, kl = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (chunks.split(hidden_p), chunks.split(hidden_q)))
    return chunks.join(kl)


def _check_hidden_and_kernel(fn: str, hidden: jax.Array, kernel: jax.Array, *, suffix: str = "") -> None:
    _checks.rank(fn, f"hidden{suffix}", _checks.floating(fn, f"hidden{suffix}", hidden), 3, "[B, T, E]")
    _checks.rank(fn, f"output_kernel{suffix}", _checks.floating(fn, f"output_kernel{suffix}", kernel), 2, "[E, V]")
    _checks.nonempty(fn, f"hidden{suffix}", hidden, "at least one sequence and one token", axes=(0, 1))
    _checks.nonempty(fn, f"output_kernel{suffix}", kernel, "a vocabulary of at least one token", axes=(1,))
    if kernel.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"{fn}: `output_kernel{suffix}` must have shape [E, V] with E = {hidden.shape[-1]} (the hidden width); "
            f"got {list(kernel.shape)}."
        )


def _logits(hidden: jax.Array, output_kernel: jax.Array, temperature: float) -> jax.Array:
    """``[B, C, E] @ [E, V] / T``, accumulated in float32."""
    return jnp.matmul(hidden, output_kernel.astype(hidden.dtype), preferred_element_type=jnp.float32) / temperature


class _Chunks:
    """Splits ``[B, T, ...]`` into ``[num_chunks, B, chunk, ...]`` (zero-padding ``T`` up to
    a multiple of the chunk) and joins per-token results back into ``[B, T]``."""

    def __init__(self, length: int, chunk_size: int):
        self.length = length
        self.chunk = min(chunk_size, length)
        self.num_chunks = -(-length // self.chunk)

    def split(self, x: jax.Array) -> jax.Array:
        pad = self.num_chunks * self.chunk - self.length
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(x.shape[0], self.num_chunks, self.chunk, *x.shape[2:]).swapaxes(0, 1)

    def join(self, x: jax.Array) -> jax.Array:
        """``[num_chunks, B, chunk] -> [B, T]``."""
        return x.swapaxes(0, 1).reshape(x.shape[1], -1)[:, :self.length]
