r"""Masked reductions: the one place where per-token values become a scalar.

Every loss in the library is a ``[B, T]`` array of per-token terms reduced by
:func:`aggregate` with an explicit mode, because the choice of normaliser *is* a choice
of algorithm (it decides how a response's length weighs on its gradient):

=========================== =================================================== =====================
mode                        loss                                                used by
=========================== =================================================== =====================
``token-mean``              :math:`\sum_{i,t} m x / \sum_{i,t} m`               PPO, DAPO, CISPO
``seq-mean-token-mean``     :math:`\frac1B \sum_i \frac{1}{|o_i|}\sum_t m x`    GRPO (spec), GSPO
``seq-mean-token-sum``      :math:`\frac1B \sum_i \sum_t m x`                   PG, RLOO (spec)
``seq-mean-token-sum-norm`` :math:`\frac{1}{B\,L} \sum_{i,t} m x`               Dr. GRPO
=========================== =================================================== =====================

Convention (ours, where the papers are silent): a row whose mask is all zero is padding,
not a response. It adds nothing to any numerator and is not counted in ``B``, so padding
a batch with empty rows never changes the loss. An *empty* batch (``B = 0`` or ``T = 0``)
is refused with a ``ValueError``: it is a bug upstream, not a batch of padding.

Masks are bool, or numbers that are all 0 or 1 (checked when the mask is concrete; any
other value raises ``ValueError``). Under ``jit`` a numeric mask cannot be read and is
taken as ``mask != 0``: a mask never weights tokens, it only selects them.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)


def _prepare(fn: str, values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Validated ``[B, T]`` values and their mask as 0/1 in ``values``' dtype."""
    values = _checks.floating(fn, "values", values)
    _checks.rank(fn, "values", values, 2, "[B, T]")
    _checks.nonempty(fn, "values", values, "at least one sequence and one token")
    mask = _checks.mask(fn, mask, "values", values)
    return values, mask.astype(values.dtype)


def aggregate(
    values: jax.Array,
    mask: jax.Array,
    *,
    mode: AggregationMode,
    max_len: int | None = None,
) -> jax.Array:
    r"""Reduces per-token values to a scalar with an explicit normalisation.

    With :math:`m_{i,t} \in \{0,1\}`, :math:`|o_i| = \sum_t m_{i,t}` and :math:`B` the
    number of rows with :math:`|o_i| > 0`:

    .. math::
        \text{token-mean} &= \frac{\sum_{i,t} m_{i,t} x_{i,t}}{\sum_{i,t} m_{i,t}} \\
        \text{seq-mean-token-mean} &= \frac{1}{B}\sum_i \frac{1}{|o_i|}\sum_t m_{i,t} x_{i,t} \\
        \text{seq-mean-token-sum} &= \frac{1}{B}\sum_i \sum_t m_{i,t} x_{i,t} \\
        \text{seq-mean-token-sum-norm} &= \frac{1}{B \cdot L}\sum_{i,t} m_{i,t} x_{i,t}

    ``seq-mean-token-mean`` is the spec's GRPO normaliser, ``seq-mean-token-sum`` the
    spec's PG / RLOO, ``token-mean`` DAPO's token-level loss and ``seq-mean-token-sum-norm``
    Dr. GRPO's constant normaliser (Liu et al., 2025, "Understanding R1-Zero-Like
    Training"), where :math:`L` is the generation budget ``max_len``.

    Args:
      values: ``[B, T]`` per-token values, ``B, T >= 1``.
      mask: ``[B, T]`` validity mask: bool, or 0/1 numbers (any other value raises when
        the mask is concrete; under ``jit`` it is read as ``mask != 0``).
      mode: one of :data:`AGGREGATION_MODES`.
      max_len: :math:`L` for ``seq-mean-token-sum-norm``; defaults to ``T``. Ignored by
        the other modes.

    Returns:
      A scalar in ``values``' dtype. Zero when no token is valid (never NaN).
    """
    return _aggregate("aggregate", values, mask, mode=mode, max_len=max_len)


def _aggregate(fn: str, values: jax.Array, mask: jax.Array, *, mode: str, max_len: int | None) -> jax.Array:
    """:func:`aggregate`, its errors naming ``fn``."""
    _checks.one_of(fn, "mode", mode, AGGREGATION_MODES)
    values, mask = _prepare(fn, values, mask)
    if max_len is not None:
        _checks.positive_int(fn, "max_len", max_len)
    masked = jnp.where(mask > 0, values, 0.0) * mask  # selects, so NaN padding stays out
    if mode == "token-mean":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0)

    tokens_per_seq = jnp.sum(mask, axis=-1)  # [B]
    num_seqs = jnp.maximum(jnp.sum(tokens_per_seq > 0), 1).astype(values.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(masked, axis=-1) / jnp.maximum(tokens_per_seq, 1.0)  # [B]
        return jnp.sum(per_seq) / num_seqs
    if mode == "seq-mean-token-sum":
        return jnp.sum(masked) / num_seqs
    # seq-mean-token-sum-norm
    length = values.shape[-1] if max_len is None else max_len
    return jnp.sum(masked) / (num_seqs * length)


def aggregation_count(mask: jax.Array, *, mode: AggregationMode) -> jax.Array:
    r"""``[]`` float32: what :func:`aggregate` counts in its denominator: the valid tokens
    (``token-mean``) or the non-empty rows :math:`B` (the ``seq-mean-*`` modes).

    A batch split into parts :math:`k` with counts :math:`c_k` (any mode) has

    .. math::  \operatorname{agg}(x, m) = \frac{\sum_k c_k \operatorname{agg}(x_k, m_k)}{\sum_k c_k},

    so gradient accumulation over micro-batches weights each by :math:`c_k / \sum c`.
    """
    _checks.one_of("aggregation_count", "mode", mode, AGGREGATION_MODES)
    mask = jnp.asarray(mask).astype(bool)
    if mode == "token-mean":
        return jnp.sum(mask).astype(jnp.float32)
    return jnp.sum(jnp.any(mask, axis=-1)).astype(jnp.float32)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over valid entries (``token-mean``); 0 when none are valid. Shapes ``[B, T]``,
    masks as in :func:`aggregate`."""
    return _aggregate("masked_mean", values, mask, mode="token-mean", max_len=None)


def masked_min(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Minimum over valid entries of ``[B, T]`` values; 0 when none are valid. Masks as
    in :func:`aggregate`."""
    values, mask = _prepare("masked_min", values, mask)
    valid = mask > 0
    smallest = jnp.min(jnp.where(valid, values, jnp.inf))
    return jnp.where(jnp.any(valid), smallest, 0.0).astype(values.dtype)


def masked_max(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Maximum over valid entries of ``[B, T]`` values; 0 when none are valid. Masks as
    in :func:`aggregate`."""
    values, mask = _prepare("masked_max", values, mask)
    valid = mask > 0
    largest = jnp.max(jnp.where(valid, values, -jnp.inf))
    return jnp.where(jnp.any(valid), largest, 0.0).astype(values.dtype)


def whiten(
    values: jax.Array,
    mask: jax.Array | None = None,
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> jax.Array:
    r"""Normalises values to zero mean and unit variance over the valid entries.

    .. math::
        \hat x = \frac{x - \bar x}{\sqrt{\operatorname{Var}[x]} + \epsilon}

    with the population variance over entries where ``mask`` is set (all entries when
    ``mask`` is ``None``). With ``shift_mean=False`` the mean is added back,
    :math:`\hat x + \bar x` (TRL's and OpenRLHF's convention). Invalid entries come back
    as 0, and equal valid values as exactly 0.

    Args:
      values: any shape ``[...]`` with at least one entry.
      mask: same shape as ``values`` or ``None``; bool or 0/1 numbers as in :func:`aggregate`.
      eps: added to the standard deviation; keeps a constant input finite (it maps to 0).
      shift_mean: subtract the mean (True) or only rescale (False).

    Returns:
      Whitened values, same shape and dtype as ``values``.
    """
    fn = "whiten"
    values = _checks.floating(fn, "values", values)
    _checks.nonempty(fn, "values", values, "at least one value")
    _checks.nonnegative(fn, "eps", eps)
    weights = jnp.ones_like(values) if mask is None else _checks.mask(fn, mask, "values", values).astype(values.dtype)
    valid = weights > 0
    values = jnp.where(valid, values, 0.0)  # padding (even NaN) never reaches the statistics
    count = jnp.maximum(jnp.sum(weights), 1.0)
    mean = jnp.sum(values * weights) / count
    # Equal valid values map to exactly 0 (their float32 mean can be an ulp off).
    spread = jnp.max(jnp.where(valid, values, -jnp.inf)) - jnp.min(jnp.where(valid, values, jnp.inf))
    centered = jnp.where(spread == 0, 0.0, values - mean)  # a NaN propagates
    var = jnp.sum(jnp.square(centered) * weights) / count
    scale = jnp.sqrt(var) + eps
    whitened = jnp.where(scale == 0, 0.0, centered / jnp.where(scale == 0, 1.0, scale))
    if not shift_mean:
        whitened = whitened + mean
    return whitened * weights
