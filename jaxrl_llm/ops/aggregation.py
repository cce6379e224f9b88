r"""Masked reductions: the one place where per-token values become a scalar.

Every loss in the library is a ``[B, T]`` array of per-token terms reduced by
:func:`aggregate` with an explicit mode, because the choice of normaliser *is* a choice
of algorithm (it decides how a response's length weighs on its gradient):

=========================== =================================================== =====================
mode                        loss                                                used by
=========================== =================================================== =====================
``token-mean``              :math:`\sum_{i,t} m x / \sum_{i,t} m`               PPO, DAPO, CISPO
``seq-mean-token-mean``     :math:`\frac1B \sum_i \frac{1}{|o_i|}\sum_t m x`    GRPO, GSPO
``seq-mean-token-sum``      :math:`\frac1B \sum_i \sum_t m x`                   PG, RLOO
``seq-mean-token-sum-norm`` :math:`\frac{1}{B\,L} \sum_{i,t} m x`               Dr. GRPO, TRL
``token-sum-norm``          :math:`\frac{1}{L} \sum_{i,t} m x`                  verl's "seq-mean-token-sum-norm"
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

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum-norm"
]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
EpsPlacement = Literal["std", "variance", "variance_floor"]
EPS_PLACEMENTS: tuple[str, ...] = get_args(EpsPlacement)


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
        \text{seq-mean-token-sum-norm} &= \frac{1}{B \cdot L}\sum_{i,t} m_{i,t} x_{i,t} \\
        \text{token-sum-norm} &= \frac{1}{L}\sum_{i,t} m_{i,t} x_{i,t}

    ``seq-mean-token-mean`` is GRPO's normaliser (Shao et al., 2024, "DeepSeekMath", eq. 3),
    ``seq-mean-token-sum`` REINFORCE's and RLOO's sum over a response's tokens (Williams,
    1992; Ahmadian et al., 2024, "Back to Basics"), ``token-mean`` DAPO's token-level loss
    (Yu et al., 2025, eq. 8) and ``seq-mean-token-sum-norm``
    Dr. GRPO's constant normaliser (Liu et al., 2025, "Understanding R1-Zero-Like
    Training"; TRL's ``loss_type="dr_grpo"``), where :math:`L` is the generation budget
    ``max_len``. ``token-sum-norm`` is what verl computes for its
    ``"seq-mean-token-sum-norm"``: the sum divided by its ``loss_scale_factor``
    (:math:`L`, by default the padded length), with no division by :math:`B`.

    Args:
      values: ``[B, T]`` per-token values, ``B, T >= 1``.
      mask: ``[B, T]`` validity mask: bool, or 0/1 numbers (any other value raises when
        the mask is concrete; under ``jit`` it is read as ``mask != 0``).
      mode: one of :data:`AGGREGATION_MODES`.
      max_len: :math:`L` for ``seq-mean-token-sum-norm`` and ``token-sum-norm``; defaults
        to ``T``. Ignored by the other modes.

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

    length = values.shape[-1] if max_len is None else max_len
    if mode == "token-sum-norm":
        return jnp.sum(masked) / length
    tokens_per_seq = jnp.sum(mask, axis=-1)  # [B]
    num_seqs = jnp.maximum(jnp.sum(tokens_per_seq > 0), 1).astype(values.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(masked, axis=-1) / jnp.maximum(tokens_per_seq, 1.0)  # [B]
        return jnp.sum(per_seq) / num_seqs
    if mode == "seq-mean-token-sum":
        return jnp.sum(masked) / num_seqs
    return jnp.sum(masked) / (num_seqs * length)  # seq-mean-token-sum-norm


def aggregation_count(mask: jax.Array, *, mode: AggregationMode) -> jax.Array:
    r"""``[]`` float32: what :func:`aggregate` counts in its denominator: the valid tokens
    (``token-mean``), the non-empty rows :math:`B` (the ``seq-mean-*`` modes), or 1
    (``token-sum-norm``, whose denominator is a constant: parts add up).

    A batch split into parts :math:`k` with counts :math:`c_k`, and :math:`c` the whole
    batch's count, has (any mode)

    .. math::  \operatorname{agg}(x, m) = \sum_k \frac{c_k}{c} \operatorname{agg}(x_k, m_k),

    with :math:`c = \sum_k c_k` for the counting modes and :math:`c_k = c = 1` for
    ``token-sum-norm``, so gradient accumulation over micro-batches weights each by
    :math:`c_k / c`.
    """
    _checks.one_of("aggregation_count", "mode", mode, AGGREGATION_MODES)
    mask = jnp.asarray(mask).astype(bool)
    if mode == "token-mean":
        return jnp.sum(mask).astype(jnp.float32)
    if mode == "token-sum-norm":
        return jnp.ones((), jnp.float32)
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
    ddof: int = 0,
    eps_placement: EpsPlacement = "std",
) -> jax.Array:
    r"""Normalises values to zero mean and unit variance over the valid entries.

    .. math::
        \hat x = \frac{x - \bar x}{s}, \qquad s = \sqrt{\operatorname{Var}[x]} + \epsilon
        \;(\texttt{"std"}), \quad \sqrt{\operatorname{Var}[x] + \epsilon}\;(\texttt{"variance"}),
        \quad \sqrt{\max(\operatorname{Var}[x], \epsilon)}\;(\texttt{"variance\_floor"})

    with :math:`\operatorname{Var}[x] = \frac{1}{n - \delta}\sum (x - \bar x)^2` over the
    :math:`n` entries where ``mask`` is set (all entries when ``mask`` is ``None``),
    :math:`\delta` = ``ddof``: 0 is the population variance (the default), 1 the sample
    variance. verl's ``masked_whiten`` is ``ddof=1, eps_placement="variance"``,
    OpenRLHF's advantage normalisation ``ddof=0, eps_placement="variance_floor"``, both
    with ``eps=1e-8``. With :math:`n \le \delta` the variance is taken as 0 (one valid
    entry whitens to 0). With ``shift_mean=False`` the mean is added back,
    :math:`\hat x + \bar x` (TRL's and OpenRLHF's convention). Invalid entries come back
    as 0, and equal valid values as exactly 0.

    Args:
      values: any shape ``[...]`` with at least one entry.
      mask: same shape as ``values`` or ``None``; bool or 0/1 numbers as in :func:`aggregate`.
      eps: keeps a constant input finite (it maps to 0); where it enters is
        ``eps_placement``.
      shift_mean: subtract the mean (True) or only rescale (False).
      ddof: delta degrees of freedom of the variance, an integer >= 0.
      eps_placement: one of :data:`EPS_PLACEMENTS`: added to the standard deviation,
        added to the variance, or a floor under the variance.

    Returns:
      Whitened values, same shape and dtype as ``values``.
    """
    fn = "whiten"
    values = _checks.floating(fn, "values", values)
    _checks.nonempty(fn, "values", values, "at least one value")
    _checks.nonnegative(fn, "eps", eps)
    _checks.nonnegative_int(fn, "ddof", ddof)
    _checks.one_of(fn, "eps_placement", eps_placement, EPS_PLACEMENTS)
    weights = jnp.ones_like(values) if mask is None else _checks.mask(fn, mask, "values", values).astype(values.dtype)
    valid = weights > 0
    values = jnp.where(valid, values, 0.0)  # padding (even NaN) never reaches the statistics
    total = jnp.sum(weights)
    count = jnp.maximum(total, 1.0)
    mean = jnp.sum(values * weights) / count
    # Equal valid values map to exactly 0 (their float32 mean can be an ulp off).
    spread = jnp.max(jnp.where(valid, values, -jnp.inf)) - jnp.min(jnp.where(valid, values, jnp.inf))
    centered = jnp.where(spread == 0, 0.0, values - mean)  # a NaN propagates
    degrees = total - ddof
    var = jnp.where(degrees > 0, jnp.sum(jnp.square(centered) * weights) / jnp.where(degrees > 0, degrees, 1.0), 0.0)
    if eps_placement == "std":
        scale = jnp.sqrt(var) + eps
    elif eps_placement == "variance":
        scale = jnp.sqrt(var + eps)
    else:  # variance_floor
        scale = jnp.sqrt(jnp.maximum(var, eps))
    whitened = jnp.where(scale == 0, 0.0, centered / jnp.where(scale == 0, 1.0, scale))
    if not shift_mean:
        whitened = whitened + mean
    return whitened * weights
