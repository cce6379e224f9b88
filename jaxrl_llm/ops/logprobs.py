"""Per-token log-probabilities and entropies of next-token distributions.

Both compute in float32 whatever the logits' dtype: a bfloat16 log-softmax loses the
precision that importance ratios ``exp(logp - old_logp)`` depend on.

Token ids must be in ``[0, V)``. Concrete ids (NumPy, eager ``jax.Array``) are checked and
an id outside raises ``ValueError``; traced ids (under ``jit``) cannot be, and an
out-of-range one gets a NaN log-prob: loudly wrong, never a plausible number (a masked
NaN never reaches a loss, since :func:`jaxrl_llm.ops.aggregate` selects).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm import kl as kl_lib


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
    transposed_kernel: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""Log-probs (and entropies) of ``tokens`` from hidden states, ``chunk_size`` tokens at a time.

    Equal to ``token_logprobs(hidden @ output_kernel / temperature, tokens)`` but never
    holds more than ``chunk_size`` tokens' float32 logits ``[B, C, V]``, ``B * C`` about
    ``chunk_size``: the chunks run in a ``lax.scan`` whose body is rematerialised
    (``jax.checkpoint``) in the backward pass, so neither direction stores
    ``[B, T, V]``. At ``V = 150k`` and ``T = 4k`` that is the difference between 2.4 GB
    per sequence and 150 MB per chunk of 256 tokens, however many rows there are.

    Args:
      hidden: ``[B, T, E]`` final-norm hidden states (e.g. ``models.hidden_states``).
      output_kernel: ``[E, V]`` output projection (the LM head, or the tied embedding
        transposed); ``[V, E]`` with ``transposed_kernel``.
      tokens: ``[B, T]`` the tokens whose log-probs to return, ids in ``[0, V)``: checked
        when concrete (``ValueError``); under ``jit`` an id outside gets a NaN log-prob.
        ``B, T >= 1``.
      chunk_size: tokens per chunk over all rows: each chunk takes
        ``C = max(1, chunk_size // B)`` positions of every row (``T`` is padded up to a
        multiple of ``C``).
      temperature: logits are divided by it (the sampling temperature; see
        :mod:`jaxrl_llm.sampling`).
      with_entropy: also return the per-token entropies of the same distributions.
      transposed_kernel: ``output_kernel`` is ``[V, E]``, a tied embedding as stored
        (:func:`jaxrl_llm.models.output_kernel` with ``as_stored=True``). The logits
        contract its last axis: passing ``embedding.T`` instead makes XLA copy the
        transpose (``V x E``, 545 MB at Qwen2.5-0.5B's shape) once for the chunks' loop,
        and once more for its gradient.

    Returns:
      ``[B, T]`` float32 log-probs, and ``[B, T]`` entropies if ``with_entropy``.
    """
    fn = "chunked_token_logprobs"
    vocab = _check_hidden_and_kernel(fn, hidden, output_kernel, transposed=transposed_kernel)
    ids = _checks.integer(fn, "tokens", tokens)
    if ids.shape != hidden.shape[:2]:
        raise ValueError(f"{fn}: `tokens` must have shape [B, T] = {list(hidden.shape[:2])}; got {list(ids.shape)}.")
    _checks.token_ids(fn, "tokens", tokens, vocab)
    _checks.positive_int(fn, "chunk_size", chunk_size)
    _checks.positive(fn, "temperature", temperature)

    chunks = _Chunks(hidden.shape[:2], chunk_size)

    @jax.checkpoint
    def one_chunk(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = _logits(h, output_kernel, temperature, transposed_kernel)  # [B, chunk, V]
        logp = _token_logprobs(logits, t)  # [B, chunk]
        return logp, (entropy(logits) if with_entropy else jnp.zeros_like(logp))

    _, (logp, ent) = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (chunks.split(hidden), chunks.split(ids)))
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
    transposed_kernels: bool = False,
) -> jax.Array:
    r"""Exact per-token :math:`D_{KL}(p\,\|\,q)` over the vocabulary, from two models' hidden states.

    .. math::
        p = \operatorname{softmax}(h_p W_p / T), \quad q = \operatorname{softmax}(h_q W_q / T),
        \quad D_{KL}(p\|q) = \sum_v p_v (\log p_v - \log q_v)

    Equal to ``kl.categorical(h_p @ W_p / T, h_q @ W_q / T)``, chunked over tokens like
    :func:`chunked_token_logprobs` (a rematerialised ``lax.scan``), so neither direction
    holds more than two chunks' ``[B, C, V]`` float32 logits, ``B * C`` about ``chunk_size``. Differentiable in both
    models: TRPO's constraint :math:`D_{KL}(\pi_{old}\|\pi_\theta)` and its Fisher-vector
    products go through it, and so does the exact KL-to-reference metric.

    Args:
      hidden_p, hidden_q: ``[B, T, E_p]`` and ``[B, T, E_q]`` final-norm hidden states,
        ``B, T >= 1``.
      output_kernel_p, output_kernel_q: ``[E_p, V]`` and ``[E_q, V]`` output projections;
        ``[V, E_p]`` and ``[V, E_q]`` with ``transposed_kernels``.
      chunk_size: tokens per chunk over all rows, as in :func:`chunked_token_logprobs`.
      temperature: both models' logits are divided by it.
      transposed_kernels: both kernels are tied embeddings as stored, as
        ``transposed_kernel`` in :func:`chunked_token_logprobs`.

    Returns:
      ``[B, T]`` float32 KL divergences, each >= 0.
    """
    fn = "chunked_categorical_kl"
    _checks.positive_int(fn, "chunk_size", chunk_size)
    _checks.positive(fn, "temperature", temperature)
    vocab_p = _check_hidden_and_kernel(fn, hidden_p, output_kernel_p, suffix="_p", transposed=transposed_kernels)
    vocab_q = _check_hidden_and_kernel(fn, hidden_q, output_kernel_q, suffix="_q", transposed=transposed_kernels)
    if hidden_p.shape[:2] != hidden_q.shape[:2] or vocab_p != vocab_q:
        raise ValueError(
            f"{fn}: both models need the same [B, T] and vocabulary; got hidden_p {list(hidden_p.shape)}, "
            f"hidden_q {list(hidden_q.shape)}, output_kernel_p {list(output_kernel_p.shape)}, "
            f"output_kernel_q {list(output_kernel_q.shape)}."
        )
    chunks = _Chunks(hidden_p.shape[:2], chunk_size)

    @jax.checkpoint
    def one_chunk(h_p: jax.Array, h_q: jax.Array) -> jax.Array:
        return kl_lib.categorical(
            _logits(h_p, output_kernel_p, temperature, transposed_kernels),
            _logits(h_q, output_kernel_q, temperature, transposed_kernels),
        )  # [B, chunk]

    _, kl = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (chunks.split(hidden_p), chunks.split(hidden_q)))
    return chunks.join(kl)


def _check_hidden_and_kernel(
    fn: str, hidden: jax.Array, kernel: jax.Array, *, suffix: str = "", transposed: bool = False
) -> int:
    """Checks ``hidden`` ``[B, T, E]`` against ``kernel`` ``[E, V]`` (``[V, E]`` if
    ``transposed``); returns ``V``."""
    layout = "[V, E]" if transposed else "[E, V]"
    width_axis, vocab_axis = (1, 0) if transposed else (0, 1)
    _checks.rank(fn, f"hidden{suffix}", _checks.floating(fn, f"hidden{suffix}", hidden), 3, "[B, T, E]")
    _checks.rank(fn, f"output_kernel{suffix}", _checks.floating(fn, f"output_kernel{suffix}", kernel), 2, layout)
    _checks.nonempty(fn, f"hidden{suffix}", hidden, "at least one sequence and one token", axes=(0, 1))
    _checks.nonempty(fn, f"output_kernel{suffix}", kernel, "a vocabulary of at least one token", axes=(vocab_axis,))
    if kernel.shape[width_axis] != hidden.shape[-1]:
        raise ValueError(
            f"{fn}: `output_kernel{suffix}` must have shape {layout} with E = {hidden.shape[-1]} (the hidden width); "
            f"got {list(kernel.shape)}."
        )
    return kernel.shape[vocab_axis]


def _logits(hidden: jax.Array, output_kernel: jax.Array, temperature: float, transposed: bool = False) -> jax.Array:
    """``[B, C, E] @ [E, V] / T`` (``[V, E]`` contracted on ``E`` if ``transposed``), accumulated in float32."""
    return _project(hidden, output_kernel.astype(hidden.dtype), transposed) / temperature


def _project_forward(hidden: jax.Array, kernel: jax.Array, transposed: bool) -> jax.Array:
    contract = ((hidden.ndim - 1,), (1 if transposed else 0,))
    return jax.lax.dot_general(hidden, kernel, (contract, ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project(hidden: jax.Array, kernel: jax.Array, transposed: bool) -> jax.Array:
    r"""Float32 logits ``[B, C, V]`` of ``hidden`` ``[B, C, E]`` and ``kernel`` ``[E, V]``
    (``[V, E]`` if ``transposed``), both in the compute dtype, with a backward pass in that
    dtype too: the logits' float32 cotangent :math:`g` is rounded to it, then

    .. math::
        \partial h = g W^\top, \qquad \partial W = h^\top g

    accumulate in float32, as the decoder's own matmuls do. Differentiated by JAX, the
    float32 :math:`g` would meet a bfloat16 kernel and XLA would upcast the whole ``[E, V]``
    kernel to float32 for two float32 matmuls (a copy of 4 bytes a weight, 3.1 GB at a
    14B model's 152k x 5120 output layer). In float32 nothing is rounded: the same
    numbers as JAX's own derivative."""
    return _project_forward(hidden, kernel, transposed)


def _project_vjp_forward(hidden, kernel, transposed):
    # Not `_project(...)`: TRPO's Fisher-vector products differentiate this rule in forward mode.
    return _project_forward(hidden, kernel, transposed), (hidden, kernel)


def _project_vjp_backward(transposed, residuals, cotangent):
    hidden, kernel = residuals
    g = cotangent.astype(hidden.dtype)  # [B, C, V]
    f32 = jnp.float32
    d_hidden = jax.lax.dot_general(g, kernel, (((2,), (0 if transposed else 1,)), ((), ())), preferred_element_type=f32)
    batch_axes = ((0, 1), (0, 1))
    if transposed:  # [V, E]
        d_kernel = jax.lax.dot_general(g, hidden, (batch_axes, ((), ())), preferred_element_type=f32)
    else:  # [E, V]
        d_kernel = jax.lax.dot_general(hidden, g, (batch_axes, ((), ())), preferred_element_type=f32)
    return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype)


_project.defvjp(_project_vjp_forward, _project_vjp_backward)


class _Chunks:
    """Splits ``[B, T, ...]`` into ``[num_chunks, B, C, ...]``, ``C = max(1, chunk_size // B)``
    positions of every row (zero-padding ``T`` up to a multiple of ``C``), and joins
    per-token results back into ``[B, T]``. Chunking positions, not flattened tokens,
    keeps rows whole: rows split over devices stay split, chunk by chunk."""

    def __init__(self, shape: tuple[int, int], chunk_size: int):
        rows, self.length = shape
        self.chunk = min(max(1, chunk_size // rows), self.length)
        self.num_chunks = -(-self.length // self.chunk)

    def split(self, x: jax.Array) -> jax.Array:
        pad = self.num_chunks * self.chunk - self.length
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(x.shape[0], self.num_chunks, self.chunk, *x.shape[2:]).swapaxes(0, 1)

    def join(self, x: jax.Array) -> jax.Array:
        """``[num_chunks, B, chunk] -> [B, T]``."""
        return x.swapaxes(0, 1).reshape(x.shape[1], -1)[:, : self.length]
