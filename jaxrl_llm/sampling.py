r"""Rollouts: ``G`` completions per prompt from a jitted KV-cache sampler.

.. code-block:: python

    rollout = sampling.sample(model, params, prompt_tokens, prompt_mask, key,
                              num_samples=G, max_new_tokens=N, eos_ids=(eos,), pad_id=pad)
    rollout.tokens           # [P*G, S+N]  prompt (left-padded) + completion (pad after EOS)
    rollout.completion_mask  # [P*G, N]    completion tokens up to and including EOS
    rollout.logprobs         # [P*G, N]    log pi_T(a_t | s_t), what the trainer recomputes

Completions of prompt ``p`` are rows ``p*G ... p*G+G-1``.

**Settings.** :class:`SamplingConfig` holds what the sampler, the trainer
(``TrainConfig.sampling``) and the evaluation (:func:`jaxrl_llm.evaluation.evaluate`) share:
temperature, top-k, top-p, min-p, the completion budget and the prompts' length;
:class:`Sampler`, the rollout backend, takes it whole.

**Log-prob convention.** The policy being trained is :math:`\pi_T = \operatorname{softmax}(z/T)`,
the model's logits at the sampling temperature ``T`` (``T = 1`` by default), as in TRL and
verl. ``logprobs`` are :math:`\log\pi_T(a_t)` of the sampled tokens, without top-k /
top-p / min-p truncation, so a trainer that recomputes log-probs from ``logits / T`` gets
the same numbers (old log-probs are free when ``mu = 1``). ``sampling_logprobs`` are the
log-probs under the truncated distribution the tokens were actually drawn from (equal
to ``logprobs`` when none of top-k, top-p, min-p is set). Greedy decoding
(``temperature=0``) reports :math:`\log\pi_1` of the argmax token.

**Truncation order.** :func:`filter_logits` applies top-k, then top-p to the top-k
distribution, then min-p: the order of transformers' ``generate`` (and of vLLM's V0
sampler). Min-p's test :math:`p_v \ge p_{\min} \max_u p_u` compares two probabilities of one
distribution, so renormalising does not move it: it gives the same set before or after
top-k, and after top-p (the order here) it is the top-p set intersected with the min-p set
of :math:`\pi_T`. Only min-p *before* top-p (vLLM's V1 sampler) differs: there top-p
measures mass on the min-p-renormalised distribution and can keep fewer tokens.

**Stop strings** are applied after generation, on the host: :func:`stop_at_strings`
cuts each completion after the first token whose text completes a stop string. The
jitted loop has no detokenizer, so a row keeps decoding to its EOS or the budget and the
tokens after its stop string are wasted compute (they are masked out, never trained on).

**Compilation.** One jitted function per shape bucket, from the prompts to the
:class:`Rollout`: the prompt length is left-padded up to a multiple of ``bucket`` and the
completion buffer rounded up likewise; the completion budget itself is a traced loop
bound, so different ``max_new_tokens`` within a bucket share a compilation (a prompt
width or budget off the buckets adds a small jitted slice back to the caller's sizes).
The KV cache is created inside the compiled function and carried by the
``lax.while_loop``, whose state buffers XLA updates in place (one array per layer, or,
with ``config.scan_layers``, one stacked ``[L, ...]`` array the layer scan writes in
place). The prefill runs once per
distinct prompt (``P`` rows, last position's logits only) and its cache is copied to the
``G`` completions, not recomputed ``G`` times. Float32 weights with a bfloat16 compute
dtype are cast once per rollout (:func:`jaxrl_llm.models.in_compute_dtype`), so the loop
streams bfloat16 weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import _checks, distributed, models, sharding

PROMPT_TRUNCATION = ("error", "left")
"""What a prompt longer than ``max_prompt_length`` does: stop with an error, or lose its first tokens."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How completions are drawn, how long they may be and how prompts are fitted: one
    setting for a run's rollouts (``TrainConfig.sampling``), its held-out evaluations and
    :func:`jaxrl_llm.evaluation.evaluate`'s samples; :class:`Sampler` takes it whole. The
    defaults fit the digit task on a CPU."""

    max_new_tokens: int = 4
    """N: completion budget in tokens."""
    temperature: float = 1.0
    """Sampling temperature ``T >= 0`` (0: greedy); the policy a run trains is
    ``softmax(logits / T)`` (:mod:`jaxrl_llm.sampling`), so training needs ``T > 0``."""
    top_k: int | None = None
    """Sample among the ``k`` most likely tokens (``None``: all)."""
    top_p: float | None = None
    """Sample from the smallest set of tokens with mass ``>= top_p``, in ``(0, 1]`` (``None``: all)."""
    min_p: float | None = None
    """Sample among tokens at least ``min_p`` times as likely as the most likely one, in
    ``[0, 1]`` (``None``: all). With top-k, top-p or min-p, the old policy's log-probs are
    still those of ``softmax(logits / T)``."""
    max_prompt_length: int = 512
    """Longest prompt in tokens. Prompts are padded to one of a few widths up to this
    (``8, 16, 32, ...``), so the train step compiles a bounded number of times."""
    prompt_truncation: str = "error"
    """A longer prompt: ``"error"`` stops naming it; ``"left"`` drops its first tokens
    (counted in the ``truncated_prompts`` metric). One of :data:`PROMPT_TRUNCATION`."""

    def __post_init__(self):
        where = "SamplingConfig"
        for field in ("max_new_tokens", "max_prompt_length"):
            _checks.positive_int(where, field, getattr(self, field))
        _checks.finite_number(where, "temperature", self.temperature)
        _checks.nonnegative(where, "temperature", self.temperature)
        if self.top_k is not None:
            _checks.positive_int(where, "top_k", self.top_k)
        for field, closed in (("top_p", "(]"), ("min_p", "[]")):
            if getattr(self, field) is not None:
                _checks.finite_number(where, field, getattr(self, field))
                _checks.in_range(where, field, getattr(self, field), 0.0, 1.0, closed=closed)
        _checks.one_of(where, "prompt_truncation", self.prompt_truncation, PROMPT_TRUNCATION)


class Rollout(NamedTuple):
    """What RL needs from generation; a pytree. ``B = P * G``, groups adjacent."""

    tokens: jax.Array  # [B, S + N] int32: prompt (left-padded) then completion, pad after EOS
    attention_mask: jax.Array  # [B, S + N] bool: real prompt tokens and valid completion tokens
    completion_mask: jax.Array  # [B, N] bool: completion tokens up to and including the first EOS
    logprobs: jax.Array  # [B, N] float32: log softmax(z / T) of each sampled token, 0 where masked
    sampling_logprobs: jax.Array  # [B, N] float32: under the top-k/top-p/min-p distribution sampled from
    lengths: jax.Array  # [B] int32: valid completion tokens (EOS included)
    truncated: jax.Array  # [B] bool: hit max_new_tokens without EOS

    @property
    def completion_tokens(self) -> jax.Array:
        """``[B, N]`` the completion part of ``tokens``."""
        return self.tokens[:, -self.completion_mask.shape[1] :]


class RolloutBackend(Protocol):
    """Anything that turns prompts into a :class:`Rollout`: this module's :class:`Sampler`,
    or later an external inference server. Settings (temperature, EOS, ...) belong to
    the backend; a call gives the policy's params, the prompts and a key."""

    def __call__(
        self,
        params: models.Params,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        key: jax.Array,
        *,
        num_samples: int,
        max_new_tokens: int,
    ) -> Rollout: ...


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def _eos_tuple(fn: str, eos_ids: int | Iterable[int] | None) -> tuple[int, ...]:
    """``eos_ids`` as a non-empty tuple of ints. One int is one id: Hugging Face's
    ``generation_config.eos_token_id`` is an int or a list of them."""
    if isinstance(eos_ids, (np.ndarray, jax.Array)) and jnp.issubdtype(eos_ids.dtype, jnp.integer):
        eos_ids = np.asarray(eos_ids).tolist()  # an int, or a (nested) list of them

    def is_int(value: object) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if is_int(eos_ids):
        return (int(eos_ids),)
    ids = () if eos_ids is None else tuple(eos_ids) if isinstance(eos_ids, Iterable) else None
    if ids is None or isinstance(eos_ids, (str, bytes)) or not all(is_int(e) for e in ids):
        raise TypeError(f"{fn}: `eos_ids` must be a token id (an int) or a sequence of them; got {eos_ids!r}.")
    if not ids:
        raise ValueError(f"{fn}: `eos_ids` must name at least one end-of-sequence token id; got {eos_ids!r}.")
    return tuple(int(e) for e in ids)


def _probability(fn: str, name: str, value: object, *, closed: str) -> None:
    """Requires ``None`` or a number in the interval ``closed`` (``"[]"``, ``"(]"``, ...) of
    ``[0, 1]``. A traced value (``sample`` under an outer ``jit``) passes unchecked."""
    if value is None or isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.floating):
        value = float(value)  # a concrete scalar array
    if not _checks.is_number(value):
        raise TypeError(f"{fn}: `{name}` must be a number or None; got {value!r}.")
    _checks.in_range(fn, name, value, 0.0, 1.0, closed=closed)


def _check_settings(
    fn: str, *, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None
) -> None:
    """:func:`sample`'s sampling settings (traced ``top_p`` and ``min_p`` pass unchecked)."""
    _checks.nonnegative(fn, "temperature", temperature)
    if top_k is not None:
        _checks.positive_int(fn, "top_k", top_k)
    _probability(fn, "top_p", top_p, closed="(]")
    _probability(fn, "min_p", min_p, closed="[]")


def sample(
    model: models.Model,
    params: models.Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_ids: Sequence[int],
    pad_id: int,
    bucket: int = 16,
    mesh: jax.sharding.Mesh | None = None,
) -> Rollout:
    r"""Samples ``num_samples`` completions of each prompt.

    Args:
      model, params: from :func:`jaxrl_llm.models.from_pretrained` or ``init``.
      prompt_tokens: ``[P, S]`` left-padded prompt ids in ``[0, V)`` (padding included),
        ``P, S >= 1``.
      prompt_mask: ``[P, S]``, bool or 0/1, true for real tokens; every prompt needs at
        least one, and must be left-padded: padding first, then the prompt (with a Hugging
        Face tokenizer, ``tokenizer.padding_side = "left"``).
      key: a PRNG key; the same key gives the same samples.
      num_samples: ``G >= 1`` completions per prompt.
      max_new_tokens: ``N >= 1``, the completion budget.
      temperature: ``T >= 0``; 0 is greedy.
      top_k: sample among the ``k`` most likely tokens (``None``: all).
      top_p: sample from the smallest set of most likely tokens with mass ``>= p``
        (nucleus; ``None``: all).
      min_p: sample among the tokens at least ``min_p`` times as likely as the most
        likely one, :math:`\pi_T(v) \ge p_{\min} \max_u \pi_T(u)` (Nguyen et al. 2024,
        "min-p sampling"), in ``[0, 1]`` (``None``: all; 0 keeps all, 1 only the ties
        with the top token). Applied after top-k and top-p (see :func:`filter_logits`).
        Traced like ``top_p``: changing it does not recompile.
      eos_ids: one end-of-sequence id (an int) or a sequence of them; a completion ends
        at the first.
      pad_id: written after EOS and in unused completion slots.
      bucket: prompt and completion buffers are rounded up to multiples of this.
      mesh: decode data-parallel over the mesh's ``data`` and ``fsdp`` axes (``D x F``
        devices), with the params gathered whole on each device (see
        :mod:`jaxrl_llm.sharding`): each device takes ``P / (D F)`` prompts and their
        completions, or, when ``P`` does not split so, each of the ``F`` devices of a
        ``data`` shard prefills its ``P / D`` prompts and decodes a ``1 / F`` block of
        their ``G``-fold rows (where ``P G / (D F)`` is whole; else the ``fsdp`` devices
        decode the same rows). When ``P`` is not a multiple of ``D``, every device decodes
        every row. On a mesh with a ``tensor`` axis the params keep Megatron's
        tensor-parallel split (``sharding.TENSOR_PARALLEL``: heads, MLP columns,
        vocabulary; gathered over ``fsdp``), so a model too large for one device decodes
        too; the rows are split over ``fsdp`` there only when the prompts are. The samples
        are those of one device with the same key, up to float rounding.

    Returns:
      A :class:`Rollout` with ``B = P * G`` rows (with a ``mesh``, split over its devices
      as above, or whole on each when ``P`` does not split over ``data``).

    Raises:
      ValueError: on bad settings, and on prompts that would be misread: ids outside
        ``[0, V)``, a mask with values other than 0/1, a prompt without a real token, or
        one not left-padded. The prompts are checked on the host when they are concrete
        (NumPy, or eager arrays, read back once); called under ``jit`` they cannot be.
    """
    fn = "sample"
    given_tokens, given_mask = prompt_tokens, prompt_mask  # checked where they are (NumPy: on the host)
    prompt_tokens = _checks.integer(fn, "prompt_tokens", prompt_tokens)
    _checks.rank(fn, "prompt_tokens", prompt_tokens, 2, "[P, S]")
    _checks.nonempty(fn, "prompt_tokens", prompt_tokens, "at least one prompt of at least one token")
    prompt_mask = _checks.mask(fn, given_mask, "prompt_tokens", prompt_tokens, name="prompt_mask")
    _checks.positive_int(fn, "num_samples", num_samples)
    _checks.positive_int(fn, "max_new_tokens", max_new_tokens)
    _checks.positive_int(fn, "bucket", bucket)
    _check_settings(fn, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    eos_ids = _eos_tuple(fn, eos_ids)
    vocab = model.config.vocab_size
    if not isinstance(pad_id, numbers.Integral) or isinstance(pad_id, bool):
        raise TypeError(f"{fn}: `pad_id` must be an integer token id; got {pad_id!r}.")
    if any(not 0 <= e < vocab for e in (*eos_ids, pad_id)):
        raise ValueError(f"{fn}: `eos_ids` {eos_ids} and `pad_id` {pad_id} must be token ids in [0, {vocab}).")
    _checks.token_ids(fn, "prompt_tokens", given_tokens, vocab)
    host_mask = _checks.host_values(given_mask)  # None when traced: not checked
    if host_mask is not None:
        real = host_mask.astype(bool).any(axis=1)  # [P]
        if not real.all():
            raise ValueError(
                f"{fn}: every prompt needs at least one real token; prompt {int(np.argmin(real))} has none."
            )
        _checks.left_padded(fn, "prompt_mask", host_mask)
    length = prompt_tokens.shape[1]
    limit = model.config.max_position_embeddings
    if length + max_new_tokens > limit:
        raise ValueError(
            f"{fn}: prompt length {length} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_position_embeddings ({limit})."
        )

    split = None
    if mesh is not None:
        split = _row_split(mesh, num_prompts=prompt_tokens.shape[0], num_samples=num_samples)
        # `distributed.put`: over several processes each holds the same prompts, params and key.
        prompt_tokens, prompt_mask = distributed.put(
            (prompt_tokens, prompt_mask), jax.sharding.NamedSharding(mesh, split.prompts)
        )
        key = distributed.put(key, sharding.replicated(mesh))
        if mesh.shape.get(sharding.TENSOR, 1) > 1:  # tensor-parallel: heads, MLP and vocabulary stay split
            params = distributed.put(params, sharding.param_shardings(params, mesh, sharding.TENSOR_PARALLEL))
        else:
            params = distributed.put(params, sharding.replicated(mesh))

    # Shape buckets: extra left padding on the prompt, extra slots for the completion.
    padded_length = min(_round_up(length, bucket), limit - max_new_tokens)
    slots = min(_round_up(max_new_tokens, bucket), limit - padded_length)
    padding = ((0, 0), (padded_length - length, 0))
    traced, static = draw_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if padded_length > length:
        prompt_tokens = jnp.pad(prompt_tokens.astype(jnp.int32), padding, constant_values=pad_id)
        prompt_mask = jnp.pad(prompt_mask, padding)
    rollout = _generate(
        model,
        params,
        prompt_tokens,
        prompt_mask,
        key,
        jnp.asarray(max_new_tokens, jnp.int32),
        *traced,
        num_samples=num_samples,
        slots=slots,
        **static,
        eos_ids=eos_ids,
        pad_id=int(pad_id),
        mesh=mesh,
        split=split,
    )
    return (
        rollout
        if (length, max_new_tokens) == (padded_length, slots)
        else _trim(rollout, prompt_len=length, max_new_tokens=max_new_tokens)
    )


@functools.partial(jax.jit, static_argnames=("prompt_len", "max_new_tokens"))
def _trim(rollout: Rollout, *, prompt_len: int, max_new_tokens: int) -> Rollout:
    """A rollout of bucket-sized buffers cut to the caller's sizes: the last ``prompt_len``
    prompt columns (the bucket's left padding dropped) and the first ``max_new_tokens``
    completion columns."""
    slots = rollout.completion_mask.shape[1]
    prompt_start = rollout.tokens.shape[1] - slots - prompt_len
    keep = slice(prompt_start, rollout.tokens.shape[1] - slots + max_new_tokens)
    return rollout._replace(
        tokens=rollout.tokens[:, keep],
        attention_mask=rollout.attention_mask[:, keep],
        **{
            name: getattr(rollout, name)[:, :max_new_tokens]
            for name in ("completion_mask", "logprobs", "sampling_logprobs")
        },
    )


def filter_logits(
    logits: jax.Array,
    *,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
) -> jax.Array:
    r"""Sets logits outside the top-k, top-p and min-p sets to ``-inf``. ``[B, V] -> [B, V]``.

    Applied in this order, each to what the previous one kept (transformers' order; the
    module docstring says why the order matters only between top-p and min-p), with
    :math:`p = \operatorname{softmax}(z)` of the logits kept so far; ``None`` skips a step:

    - top-k: :math:`z_v \ge z_{(k)}`, the ``k``-th largest logit (ties with it all kept);
    - top-p (nucleus): the smallest set of most likely tokens whose probability reaches
      ``top_p``, :math:`\sum_{u:\, z_u > z_v} p_u < \text{top\_p}` (the token that crosses it
      included; ties at the boundary are all kept);
    - min-p (Nguyen et al. 2024): :math:`p_v \ge p_{\min} \max_u p_u`, i.e.
      :math:`z_v \ge \max_u z_u + \log p_{\min}`. A ratio of probabilities of one
      distribution, so the same for the kept logits as for the full row.

    The most likely token is always kept. ``top_p`` and ``min_p`` may be traced scalars.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        kept = mass_before < top_p  # the first token is always kept
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    if min_p is not None:
        floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)  # [B, 1]; -inf when min_p = 0
        logits = jnp.where(logits >= floor, logits, -jnp.inf)
    return logits


def cdf_block(vocab: int) -> int:
    """Block width of :func:`draw`'s two-level CDF: a power of two near ``sqrt(V)``, one
    that divides ``V`` where a large enough one does (then nothing is padded)."""
    width = 1 << max(0, math.ceil(math.log2(math.sqrt(vocab))))
    divides = vocab & -vocab  # the largest power of two dividing V
    return min(width, divides) if divides >= width // 4 else width


def draw(uniform: jax.Array, weights: jax.Array) -> jax.Array:
    r"""One token per row, with probability proportional to ``weights`` ``[B, V]`` (>= 0).

    Inverse-CDF sampling in two levels: with ``b`` = :func:`cdf_block` (about
    :math:`\sqrt V`), pick the block of ``b`` tokens whose cumulative mass first exceeds
    :math:`u \cdot \text{total}`, then the token within it. Exact like
    ``jax.random.categorical``, but it takes one uniform per row (``[B]`` in ``[0, 1)``)
    instead of a Gumbel variate per vocabulary entry, so a rollout's random numbers can be
    drawn up front, outside the decode loop; and it needs two cumulative sums of about
    :math:`\sqrt V` entries instead of one of ``V`` (XLA's CPU cumsum of a 150k vocabulary
    row costs more than a decode step). Entries of weight 0 are never drawn.
    """
    batch, vocab = weights.shape
    block = cdf_block(vocab)
    blocks = -(-vocab // block)
    if blocks * block != vocab:  # zero weight is never drawn
        weights = jnp.pad(weights, ((0, 0), (0, blocks * block - vocab)))
    grouped = weights.reshape(batch, blocks, block)
    block_cdf = jnp.cumsum(jnp.sum(grouped, axis=-1), axis=-1)  # [B, blocks]
    total = block_cdf[:, -1]
    # Strictly below the total, so some block's CDF exceeds the target; the first that
    # does has positive mass. (u * total can round up to the total.)
    target = jnp.minimum(uniform * total, jnp.nextafter(total, 0.0))  # [B]
    chosen = jnp.sum(block_cdf <= target[:, None], axis=-1)  # [B]
    before = jnp.take_along_axis(block_cdf, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0]
    before = jnp.where(chosen > 0, before, 0.0)  # mass of the blocks before the chosen one
    inner_cdf = jnp.cumsum(jnp.take_along_axis(grouped, chosen[:, None, None], axis=1)[:, 0], axis=-1)  # [B, b]
    # The inner sums may round below the block's total: stay under their own last entry.
    residual = jnp.minimum(target - before, jnp.nextafter(inner_cdf[:, -1], 0.0))
    return (chosen * block + jnp.sum(inner_cdf <= residual[:, None], axis=-1)).astype(jnp.int32)


def _logprob_of(scaled: jax.Array, top: jax.Array, log_total: jax.Array, token: jax.Array) -> jax.Array:
    r"""``[B]`` log-softmax of ``scaled`` ``[B, V]`` at ``token`` ``[B]``, given the row
    maximum ``top`` ``[B]`` and :math:`\log \sum_v e^{z_v - top}` ``log_total`` ``[B]``."""
    return jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0] - top - log_total


def draw_settings(
    *, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], dict]:
    """The sampling settings as a jitted decoder takes them: ``(temperature, top_p, min_p)``
    as float32 scalars, traced (a change does not recompile; 1, 1, 0 where unused), and the
    static ``top_k``, ``use_top_p``, ``use_min_p`` and ``greedy`` (``temperature = 0`` or
    ``top_k = 1``, which turns the others off)."""
    greedy = temperature == 0 or top_k == 1
    traced = (
        jnp.asarray(temperature if temperature > 0 else 1.0, jnp.float32),
        jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        jnp.asarray(0.0 if min_p is None else min_p, jnp.float32),
    )
    static = dict(
        top_k=None if greedy else top_k,
        use_top_p=top_p is not None and not greedy,
        use_min_p=min_p is not None and not greedy,
        greedy=greedy,
    )
    return traced, static


def next_token(
    logits: jax.Array,
    uniform: jax.Array,
    *,
    temperature: jax.Array | float,
    top_k: int | None = None,
    top_p: jax.Array | float | None = None,
    min_p: jax.Array | float | None = None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""One decoding step's draw: ``(token, logp, sampling_logp)``, each ``[B]``.

    ``token`` is drawn by :func:`draw` with ``uniform`` ``[B]`` from :math:`\pi_T =
    \operatorname{softmax}(z / T)` of ``logits`` ``[B, V]``, truncated by
    :func:`filter_logits` when any of ``top_k``, ``top_p``, ``min_p`` is set (``None``:
    off), or is the argmax when ``greedy`` (``uniform`` unused). ``logp`` is
    :math:`\log\pi_T` of the token (the module's log-prob convention), ``sampling_logp``
    its log-prob under the truncated distribution it was drawn from."""
    scaled = logits.astype(jnp.float32) / temperature  # [B, V]
    # One exponential pass serves both the draw and log pi_T of the drawn token.
    top = jnp.max(scaled, axis=-1)  # [B]
    weights = jnp.exp(scaled - top[:, None])  # [B, V], softmax up to its normaliser
    log_total = jnp.log(jnp.sum(weights, axis=-1))
    truncated = not greedy and (top_k is not None or top_p is not None or min_p is not None)
    if greedy:
        token = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    else:
        if truncated:
            filtered = filter_logits(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
            weights = jnp.exp(filtered - top[:, None])  # 0 outside the kept set; the top token is kept
        token = draw(uniform, weights)
    logp = _logprob_of(scaled, top, log_total, token)
    sampling_logp = logp
    if truncated:
        sampling_logp = _logprob_of(filtered, top, jnp.log(jnp.sum(weights, axis=-1)), token)
    return token, logp, sampling_logp


class Drawn(NamedTuple):
    """One decoding step's draw for the rows still writing (:func:`draw_live`), each ``[B]``."""

    token: jax.Array  # int32: the drawn id, ``pad_id`` in a row that is not live
    logp: jax.Array  # float32: log pi_T of it, 0 in a row that is not live
    sampling_logp: jax.Array  # float32: its log-prob under the truncated distribution, 0 likewise
    stopped: jax.Array  # bool: a live row drew one of the stop ids


def draw_live(
    logits: jax.Array,
    uniform: jax.Array,
    live: jax.Array,
    *,
    pad_id: int,
    stop_ids: Sequence[int],
    temperature: jax.Array | float,
    top_k: int | None,
    top_p: jax.Array | float | None,
    min_p: jax.Array | float | None,
    greedy: bool,
) -> Drawn:
    """:func:`next_token` of ``logits`` ``[B, V]`` with ``uniform`` ``[B]``, for the rows
    where ``live`` ``[B]``: what every decode loop records at its step (this module's
    rollouts, an episode's turns)."""
    token, logp, sampling_logp = next_token(
        logits, uniform, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy
    )
    token = jnp.where(live, token, pad_id)
    stops = jnp.asarray(stop_ids, jnp.int32)
    return Drawn(
        token=token,
        logp=jnp.where(live, logp, 0.0),
        sampling_logp=jnp.where(live, sampling_logp, 0.0),
        stopped=live & jnp.any(token[:, None] == stops[None, :], axis=-1),
    )


def record(buffer: jax.Array, values: jax.Array, step: jax.Array) -> jax.Array:
    """``buffer`` ``[B, W]`` with ``values`` ``[B]`` written at column ``step``."""
    return jax.lax.dynamic_update_slice(buffer, values[:, None], (0, step))


class _RowSplit(NamedTuple):
    """How a mesh shares a rollout: the specs of the prompts ``[P, S]`` and of the rows
    ``[B, ...]``, and ``row_blocks``, the ``fsdp`` blocks each device's prompts' rows are
    cut into (1: none, the prompts are split already)."""

    prompts: jax.sharding.PartitionSpec
    rows: jax.sharding.PartitionSpec
    row_blocks: int


def _row_split(mesh: jax.sharding.Mesh, *, num_prompts: int, num_samples: int) -> _RowSplit:
    """Rows split over ``data`` and ``fsdp``: the prompts over both when ``P`` allows,
    else the prompts over ``data`` and their ``G``-fold rows over ``fsdp`` (each device
    prefills its ``data`` shard's prompts and decodes its block of their rows), else the
    rows over ``data`` alone, the ``fsdp`` devices decoding the same rows; and when ``P``
    does not split over ``data``, every device decodes every row."""
    data = sharding.data_size(mesh)
    if num_prompts % data:
        return _RowSplit(sharding.WHOLE, sharding.WHOLE, 1)
    fsdp = mesh.shape.get(sharding.FSDP, 1)
    both = jax.sharding.PartitionSpec((sharding.DATA, sharding.FSDP))
    if fsdp == 1:
        return _RowSplit(sharding.ROWS, sharding.ROWS, 1)
    if num_prompts % (data * fsdp) == 0:
        return _RowSplit(both, both, 1)
    if num_prompts * num_samples % (data * fsdp) == 0 and mesh.shape.get(sharding.TENSOR, 1) == 1:
        return _RowSplit(sharding.ROWS, both, fsdp)
    return _RowSplit(sharding.ROWS, sharding.ROWS, 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_samples",
        "slots",
        "top_k",
        "use_top_p",
        "use_min_p",
        "greedy",
        "eos_ids",
        "pad_id",
        "mesh",
        "split",
    ),
)
def _generate(
    model, params, tokens, mask, key, max_new_tokens, temperature, top_p, min_p, *, mesh, split, **settings
) -> Rollout:
    """The whole rollout in bucket-sized buffers (``S'`` prompt columns, ``slots``
    completion columns); with a ``mesh``, each device runs :func:`_decode` on its rows
    (``shard_map``: its own loop and stopping test, no communication), or, when the mesh
    has a ``tensor`` axis, XLA partitions one program over the params' tensor-parallel
    layout and the rows' ``data`` (and ``fsdp``) split (all-reductions over ``tensor``
    in every layer). ``split``: :func:`_row_split`'s, with a mesh."""
    # Every random number of the rollout at once, for all B rows (the same numbers with or
    # without a mesh): inside the loop, the RNG's own rounds would cost more per step than
    # the sampling itself.
    uniforms = jax.random.uniform(key, (settings["slots"], tokens.shape[0] * settings["num_samples"]))  # [slots, B]
    # Float32 weights with bfloat16 compute are cast once here, not again at every decode step.
    params = models.in_compute_dtype(model, params)
    decode = functools.partial(_decode, model, **settings)
    if mesh is not None and mesh.shape.get(sharding.TENSOR, 1) == 1:
        whole = sharding.WHOLE
        by_row = jax.sharding.PartitionSpec(None, *split.rows)  # uniforms [slots, B]
        decode = jax.shard_map(
            functools.partial(decode, row_blocks=split.row_blocks),
            mesh=mesh,
            in_specs=(whole, split.prompts, split.prompts, by_row, whole, whole, whole, whole),
            out_specs=split.rows,
            check_vma=False,
        )  # no collectives inside
    return decode(params, tokens, mask, uniforms, max_new_tokens, temperature, top_p, min_p)


def _decode(
    model,
    params,
    tokens,
    mask,
    uniforms,
    max_new_tokens,
    temperature,
    top_p,
    min_p,
    *,
    num_samples,
    slots,
    top_k,
    use_top_p,
    use_min_p,
    greedy,
    eos_ids,
    pad_id,
    row_blocks: int = 1,
) -> Rollout:
    """The ``P`` distinct prompts ``[P, S']`` prefilled, the cache and next-token logits
    copied to the ``B = P * G`` rows, then a ``while_loop`` of sample -> record -> decode
    step, and the last token's sample -> record. ``uniforms`` ``[slots, B]`` drive the draws.

    ``row_blocks > 1`` (inside ``shard_map``): this device keeps block ``i`` of the ``P * G``
    rows, ``i`` its index along ``fsdp``, and ``uniforms`` are that block's ``[slots, B / row_blocks]``."""
    tokens, mask = tokens.astype(jnp.int32), mask.astype(bool)
    logits, cache = models.prefill(
        model, params, tokens, mask, cache_size=tokens.shape[1] + slots, last_logits_only=True
    )  # [P, V], cache of P rows
    batch = tokens.shape[0] * num_samples // row_blocks
    if row_blocks == 1:  # row b continues prompt b // G: a repeat, which keeps a split over rows split
        to_rows = functools.partial(jnp.repeat, repeats=num_samples, axis=0)
        cache = cache.repeat_rows(num_samples)
    else:  # this device's block of the rows: first, ..., first + B - 1 (a gather, local in shard_map)
        prompt_of_row = (jax.lax.axis_index(sharding.FSDP) * batch + jnp.arange(batch)) // num_samples  # [B]
        to_rows = functools.partial(jnp.take, indices=prompt_of_row, axis=0)
        cache = cache.take_rows(prompt_of_row)
    logits = to_rows(logits)  # [B, V]

    class State(NamedTuple):
        step: jax.Array  # [] int32
        logits: jax.Array  # [B, V] next-token logits
        cache: models.KVCache
        tokens: jax.Array  # [B, slots]
        logprobs: jax.Array  # [B, slots]
        sampling_logprobs: jax.Array  # [B, slots]
        lengths: jax.Array  # [B] int32
        finished: jax.Array  # [B] bool: emitted an EOS

    def keep_going(state: State) -> jax.Array:
        return (state.step < max_new_tokens - 1) & ~jnp.all(state.finished)

    def sample_and_record(state: State) -> tuple[State, jax.Array]:
        """Draws each row's next token from ``state.logits`` and writes it at column
        ``state.step`` (pad, and log-prob 0, for finished rows)."""
        uniform = jax.lax.dynamic_index_in_dim(uniforms, state.step, keepdims=False)  # [B]
        active = ~state.finished
        drawn = draw_live(
            state.logits,
            uniform,
            active,
            pad_id=pad_id,
            stop_ids=eos_ids,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            min_p=min_p if use_min_p else None,
            greedy=greedy,
        )
        return state._replace(
            step=state.step + 1,
            tokens=record(state.tokens, drawn.token, state.step),
            logprobs=record(state.logprobs, drawn.logp, state.step),
            sampling_logprobs=record(state.sampling_logprobs, drawn.sampling_logp, state.step),
            lengths=state.lengths + active.astype(jnp.int32),
            finished=state.finished | drawn.stopped,
        ), drawn.token

    def step(state: State) -> State:
        state, token = sample_and_record(state)
        logits, cache = models.decode_step(model, params, token, state.cache)
        return state._replace(logits=logits, cache=cache)

    init = State(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        cache=cache,
        tokens=jnp.full((batch, slots), pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, slots), jnp.float32),
        sampling_logprobs=jnp.zeros((batch, slots), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        finished=jnp.zeros((batch,), bool),
    )
    # The loop stops one token short: the last token is only drawn, it needs no decode step.
    # (If every row has finished, this draw records nothing.)
    final, _ = sample_and_record(jax.lax.while_loop(keep_going, step, init))
    completion_mask = jnp.arange(slots)[None, :] < final.lengths[:, None]  # [B, slots]
    return Rollout(
        tokens=jnp.concatenate([to_rows(tokens), final.tokens], axis=1),
        attention_mask=jnp.concatenate([to_rows(mask), completion_mask], axis=1),
        completion_mask=completion_mask,
        logprobs=final.logprobs,
        sampling_logprobs=final.sampling_logprobs,
        lengths=final.lengths,
        truncated=~final.finished,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampler:
    """This module's :class:`RolloutBackend`: :func:`sample` with its settings bound, the
    distribution's from ``sampling`` (temperature, top-k, top-p, min-p). The completion
    budget is each call's (``max_new_tokens``, as the protocol has it); the prompts come
    fitted (``sampling.max_prompt_length`` is the caller's, :mod:`jaxrl_llm.rollouts`)."""

    model: models.Model
    eos_ids: int | tuple[int, ...]  # one int is one id; stored as a tuple
    pad_id: int
    sampling: SamplingConfig = SamplingConfig()
    bucket: int = 16
    mesh: jax.sharding.Mesh | None = None

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", _eos_tuple("Sampler", self.eos_ids))  # frozen: set once, here
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"Sampler: `sampling` must be a SamplingConfig; got {self.sampling!r}.")

    def __call__(self, params, prompt_tokens, prompt_mask, key, *, num_samples, max_new_tokens) -> Rollout:
        sampling = self.sampling
        return sample(
            self.model,
            params,
            prompt_tokens,
            prompt_mask,
            key,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            bucket=self.bucket,
            mesh=self.mesh,
        )


def recompute_logprobs(
    model: models.Model, params: models.Params, rollout: Rollout, *, temperature: float = 1.0
) -> jax.Array:
    """``[B, N]`` log pi_T of the completion tokens by a teacher-forced pass, 0 where
    masked: the trainer's view of :attr:`Rollout.logprobs` (greedy rollouts: ``T = 1``)."""
    logp = models.completion_logprobs(
        model,
        params,
        rollout.tokens,
        rollout.attention_mask,
        rollout.completion_mask.shape[1],
        temperature=temperature or 1.0,
    )
    return jnp.where(rollout.completion_mask, logp, 0.0)


def _stop_tuple(fn: str, stop_strings: str | Sequence[str]) -> tuple[str, ...]:
    """``stop_strings`` as a non-empty tuple of non-empty strings; one string is one stop
    string (as with transformers' ``stop_strings``)."""
    if isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    if not isinstance(stop_strings, Iterable) or isinstance(stop_strings, bytes):
        raise TypeError(f"{fn}: `stop_strings` must be a string or a sequence of strings; got {stop_strings!r}.")
    stops = tuple(stop_strings)
    if not stops:
        raise ValueError(f"{fn}: `stop_strings` must name at least one stop string; got {stop_strings!r}.")
    if bad := [s for s in stops if not isinstance(s, str)]:
        raise TypeError(f"{fn}: `stop_strings` must hold strings; got {bad[0]!r} in {stops!r}.")
    if "" in stops:
        raise ValueError(
            f"{fn}: `stop_strings` must be non-empty strings (an empty one would stop every "
            f"completion at its first token); got {stops!r}."
        )
    return stops


def stop_at_strings(rollout: Rollout, *, tokenizer, stop_strings: str | Sequence[str], pad_id: int) -> Rollout:
    r"""Cuts each completion after the first token at which its text contains a stop string.

    For row ``b`` with valid completion ids :math:`a_{1..n}` (``n = lengths[b]``) and text
    :math:`d(a_{1..k})` = ``tokenizer.decode(ids[:k], skip_special_tokens=True)`` (the text
    the rewards see), the cut is

    .. math::  k^* = \min\{k \le n : \text{some } s \in \text{stop\_strings} \text{ occurs in } d(a_{1..k})\}.

    Tokens ``1..k*`` stay, the stop string included (as transformers' ``StopStringCriteria``
    leaves it in the output); the rest of the completion becomes ``pad_id``, with
    ``completion_mask`` and the completion part of ``attention_mask`` false, ``logprobs``
    and ``sampling_logprobs`` 0, ``lengths = k*`` and ``truncated`` false (the row stopped).
    Rows whose text has no stop string are left as they are, and so are ids beyond a row's
    ``lengths`` (after its EOS). Special tokens (EOS) are skipped in the text, so a stop
    string never matches their spelling.

    Generation is not shortened: :func:`sample` decodes each row to its EOS or the
    budget, since its jitted loop has no detokenizer, and this cut discards the tokens
    after the stop string. Cost: one batched decode of all rows, then, for a row whose
    text contains a stop string, a binary search over prefix lengths (:math:`\lceil\log_2
    n\rceil` decodes of at most ``n`` ids). It finds :math:`k^*` when a longer prefix's text
    keeps every stop string a shorter prefix's text has: true of byte-level BPE,
    SentencePiece and character tokenizers (an unfinished UTF-8 character decodes to
    U+FFFD until its last byte arrives). Only a stop string holding U+FFFD, or a tokenizer
    that rewrites spaces across tokens (``clean_up_tokenization_spaces``), can break it;
    then the cut is still a ``k`` whose text has a stop string and whose ``k - 1`` has not.

    Args:
      rollout: a :class:`Rollout`, best a host copy (``jax.device_get(rollout)``); device
        arrays are copied to the host.
      tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=)``;
        ``batch_decode`` is used when present).
      stop_strings: one non-empty string, or a non-empty sequence of them.
      pad_id: written into the cut completion slots.

    Returns:
      A new :class:`Rollout` of NumPy arrays (the input is not modified).

    Raises:
      TypeError, ValueError: on an empty stop string or none, a non-string, a tokenizer
        without ``decode``, a non-integer ``pad_id``, or a rollout whose shapes disagree.
    """
    fn = "stop_at_strings"
    stops = _stop_tuple(fn, stop_strings)
    if not isinstance(rollout, Rollout):
        raise TypeError(f"{fn}: `rollout` must be a sampling.Rollout; got {type(rollout).__name__}.")
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(
            f"{fn}: `tokenizer` must have a `decode(ids, skip_special_tokens=True)` method (a Hugging "
            f"Face tokenizer); got {type(tokenizer).__name__}."
        )
    if not isinstance(pad_id, numbers.Integral) or isinstance(pad_id, bool):
        raise TypeError(f"{fn}: `pad_id` must be an integer token id; got {pad_id!r}.")
    out = Rollout(*(np.array(x) for x in jax.device_get(tuple(rollout))))  # host copies, written below
    batch, slots = out.completion_mask.shape
    if out.tokens.ndim != 2 or out.tokens.shape[0] != batch or out.tokens.shape[1] < slots:
        raise ValueError(
            f"{fn}: `rollout.tokens` must have shape [B, S + N] = [{batch}, S + {slots}] to match "
            f"`completion_mask` [B, N]; got {list(out.tokens.shape)}."
        )
    if out.lengths.shape != (batch,) or ((out.lengths < 0) | (out.lengths > slots)).any():
        raise ValueError(
            f"{fn}: `rollout.lengths` must have shape [{batch}] with values in [0, {slots}]; got "
            f"shape {list(out.lengths.shape)}, values {_checks._listed(out.lengths)}."
        )

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def stopped(text: str) -> bool:
        return any(stop in text for stop in stops)

    start = out.tokens.shape[1] - slots  # the first completion column
    completion = out.tokens[:, start:]  # [B, N], a view: writes go to out.tokens
    ids = [row[:n].tolist() for row, n in zip(completion, out.lengths.tolist())]  # valid ids, EOS included
    batch_decode = getattr(tokenizer, "batch_decode", None)
    texts = batch_decode(ids, skip_special_tokens=True) if callable(batch_decode) else [decode(i) for i in ids]
    cut = out.lengths.astype(np.int64)  # [B] tokens kept
    hit = np.array([stopped(text) for text in texts], bool)  # [B]
    for row in np.flatnonzero(hit):
        low, high = 1, len(ids[row])  # the text of ids[:high] contains a stop string
        while low < high:  # invariant: the first stop is in (low - 1, high]
            middle = (low + high) // 2
            if stopped(decode(ids[row][:middle])):
                high = middle
            else:
                low = middle + 1
        cut[row] = high
    beyond = hit[:, None] & (np.arange(slots)[None, :] >= cut[:, None])  # [B, N] slots a stop cleared
    completion[beyond] = pad_id
    out.attention_mask[:, start:][beyond] = False
    out.completion_mask[beyond] = False
    out.logprobs[beyond] = 0.0
    out.sampling_logprobs[beyond] = 0.0
    out.lengths[hit] = cut[hit]
    out.truncated[hit] = False
    return out
