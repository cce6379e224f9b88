r"""Policy and value objectives, as losses to minimise.

Every objective has the same shape of contract:

* inputs are per-token ``[B, T]`` arrays: ``logp`` (log-probs of the sampled tokens under
  the policy being optimised, differentiable), ``old_logp`` (under the policy that
  sampled them) and ``mask``; ``advantages`` are ``[B]`` (one per response, broadcast
  over its tokens) or ``[B, T]``;
* ``old_logp``, ``ref_logp`` and ``advantages`` enter under ``stop_gradient``;
* per-token terms are reduced once, by :func:`jaxrl_llm.ops.aggregate` with the ``agg``
  mode (and ``max_len`` for ``seq-mean-token-sum-norm``);
* the return value is ``(loss, metrics)``: a scalar and a dict of scalar diagnostics
  computed over valid tokens (token-mean, whatever ``agg`` is).

There is one clipped surrogate, :func:`ppo_clip`: PPO, TRPO's surrogate, GRPO, Dr. GRPO,
DAPO, GSPO and REINFORCE++ differ in its settings (ratio level, clip range, dual clip) and
in the aggregation, not in the function. A KL-to-reference term is :func:`kl_penalty`,
added to any objective's loss (:func:`jaxrl_llm.algorithms.policy_loss` composes them).

Ratios are :math:`\rho_{i,t} = \exp(\log\pi_\theta - \log\pi_{\text{old}})`, with the
log-ratio clamped to :data:`LOG_RATIO_LIMIT` (±20, as verl's token-level loss) before the
exponential: past that a token's ratio saturates instead of overflowing to ``inf`` and
turning the whole gradient into NaN through a ``0 * inf`` (:func:`ppo_clip`'s
``log_ratio_cap`` can lower the upper end). Metrics common to the ratio-based objectives:

* ``policy_loss``: the clipped surrogate term alone (without KL);
* ``clip_fraction``: fraction of tokens whose gradient the clip removed,
  split into ``clip_fraction_low`` (:math:`\rho < 1-\epsilon_{low}`, :math:`A<0`) and
  ``clip_fraction_high`` (:math:`\rho > 1+\epsilon_{high}`, :math:`A>0`);
* ``ratio_min`` / ``ratio_mean`` / ``ratio_max``;
* ``approx_kl``: :math:`\mathbb{E}[(\rho - 1) - \log\rho]`, the k3 estimate of
  :math:`D_{KL}(\pi_{\text{old}}\,\|\,\pi_\theta)` on the sampled tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm import kl as kl_lib
from jaxrl_llm.ops import aggregation
from jaxrl_llm.ops.aggregation import AggregationMode

LOG_RATIO_LIMIT = kl_lib.LOG_RATIO_LIMIT
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (e^20 ~ 5e8: far past any clip)."""

RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)

Metrics = dict[str, jax.Array]
"""An objective's diagnostics: name -> scalar."""


class _LossInputs:
    """Validated, float32 views of an objective's per-token inputs.

    Masked entries are replaced by 0 here, once: whatever padding holds (a -inf log-prob,
    a NaN), it can then reach neither the loss nor, through a 0 * inf, the gradient.
    """

    def __init__(self, fn: str, logp, advantages, mask, old_logp=None):
        logp = _checks.floating(fn, "logp", logp)
        _checks.rank(fn, "logp", logp, 2, "[B, T]")
        valid = _checks.mask(fn, mask, "logp", logp)  # [B, T] bool
        self.mask = valid.astype(jnp.float32)  # [B, T]
        self.logp = jnp.where(valid, logp.astype(jnp.float32), 0.0)  # [B, T]
        advantages = _checks.per_sequence_or_token(fn, "advantages", advantages, "logp", logp)
        self.advantages = jax.lax.stop_gradient(jnp.where(valid, advantages.astype(jnp.float32), 0.0))  # [B, T]
        if old_logp is not None:
            old_logp = _checks.floating(fn, "old_logp", old_logp)
            _checks.same_shape(fn, "old_logp", old_logp, "logp", logp)
            self.old_logp = jax.lax.stop_gradient(jnp.where(valid, old_logp.astype(jnp.float32), 0.0))  # [B, T]

    def mean(self, values: jax.Array) -> jax.Array:
        return aggregation.masked_mean(values, self.mask)


def _check_agg(fn: str, agg: str, max_len: int | None) -> None:
    _checks.one_of(fn, "agg", agg, aggregation.AGGREGATION_MODES)
    if max_len is not None:
        _checks.positive_int(fn, "max_len", max_len)


def _clip_bounds(fn: str, eps_low: float | None, eps_high: float | None) -> tuple[float | None, float | None]:
    """``(1 - eps_low, 1 + eps_high)``; ``None`` leaves that side unbounded."""
    _checks.nonnegative(fn, "eps_low", eps_low)
    _checks.nonnegative(fn, "eps_high", eps_high)
    return (None if eps_low is None else 1.0 - eps_low), (None if eps_high is None else 1.0 + eps_high)


def _ratio(log_ratio: jax.Array, cap: float = LOG_RATIO_LIMIT) -> jax.Array:
    """``exp`` of the log-ratio clamped to ``[-LOG_RATIO_LIMIT, cap]`` (see :data:`LOG_RATIO_LIMIT`)."""
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_LIMIT, cap))


def _ratio_metrics(inputs: _LossInputs, ratio: jax.Array) -> Metrics:
    """Stats of the ratio the objective used, and the k3 KL(old || new) of token ratios."""
    token_log_ratio = jnp.clip(inputs.logp - inputs.old_logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return {
        "ratio_min": aggregation.masked_min(ratio, inputs.mask),
        "ratio_mean": inputs.mean(ratio),
        "ratio_max": aggregation.masked_max(ratio, inputs.mask),
        "approx_kl": inputs.mean(jnp.expm1(token_log_ratio) - token_log_ratio),
    }


def policy_gradient(
    logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    agg: AggregationMode = "seq-mean-token-sum",
    max_len: int | None = None,
    old_logp: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""REINFORCE (Williams, 1992): :math:`L = -A_i \sum_t \log \pi_\theta(a_{i,t} \mid s_{i,t})`.

    With ``A = R`` this is plain policy gradient, with ``A = R - b`` REINFORCE with a
    baseline, with leave-one-out advantages RLOO (Ahmadian et al., 2024:
    :math:`-\frac1G \sum_i A_i \sum_t \log\pi_\theta`, i.e. the default
    ``agg="seq-mean-token-sum"``).

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under :math:`\pi_\theta`.
      advantages: ``[B]`` or ``[B, T]`` advantages (held constant).
      mask: ``[B, T]`` validity mask.
      agg: aggregation mode, see :func:`jaxrl_llm.ops.aggregate`.
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.
      old_logp: ``[B, T]`` log-probs under the sampling policy, for diagnostics only: the
        loss does not read them.

    Returns:
      ``(loss, metrics)``; metrics: ``policy_loss``, ``logp_mean``, and with ``old_logp``
      the ratio metrics of the ratio-based objectives (how far the policy has moved
      from the samples' policy) and ``clip_fraction`` 0, as nothing is clipped.
    """
    fn = "policy_gradient"
    _check_agg(fn, agg, max_len)
    inputs = _LossInputs(fn, logp, advantages, mask, old_logp)
    loss = aggregation.aggregate(-inputs.advantages * inputs.logp, inputs.mask, mode=agg, max_len=max_len)
    metrics = {"policy_loss": loss, "logp_mean": inputs.mean(jax.lax.stop_gradient(inputs.logp))}
    if old_logp is not None:
        metrics.update(
            _ratio_metrics(inputs, _ratio(jax.lax.stop_gradient(inputs.logp - inputs.old_logp))),
            clip_fraction=jnp.zeros((), jnp.float32),
        )
    return loss, metrics


def _sequence_log_ratio(inputs: _LossInputs) -> jax.Array:
    r"""GSPO's per-token log-ratio whose value is the sequence's and whose gradient is the token's.

    .. math::
        \log s_{i,t} = \operatorname{sg}\Big[\frac{1}{|o_i|}\sum_{t'} \log\rho_{i,t'}\Big]
            + \log\pi_\theta(a_{i,t}) - \operatorname{sg}[\log\pi_\theta(a_{i,t})]
    """
    token_log_ratio = (inputs.logp - inputs.old_logp) * inputs.mask  # [B, T]
    lengths = jnp.maximum(jnp.sum(inputs.mask, axis=-1, keepdims=True), 1.0)  # [B, 1]
    seq_log_ratio = jnp.sum(token_log_ratio, axis=-1, keepdims=True) / lengths  # [B, 1]
    seq_log_ratio = jnp.broadcast_to(seq_log_ratio, inputs.logp.shape)  # [B, T]
    return jax.lax.stop_gradient(seq_log_ratio) + inputs.logp - jax.lax.stop_gradient(inputs.logp)


def ppo_clip(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float | None = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
    log_ratio_cap: float = LOG_RATIO_LIMIT,
    agg: AggregationMode = "token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""The clipped surrogate of PPO (Schulman et al., 2017, eq. 7), which GRPO and its variants share.

    .. math::
        \ell_{i,t} = -\min\!\big(\rho_{i,t} A_{i,t},\;
            \operatorname{clip}(\rho_{i,t}, 1-\epsilon_{low}, 1+\epsilon_{high}) A_{i,t}\big)

    aggregated by ``agg``. The methods are settings of this one function:

    * PPO: symmetric ``eps_low = eps_high``, ``agg="token-mean"``; REINFORCE++ (Hu, 2025) is
      the same surrogate on its own advantages.
    * TRPO (Schulman et al., 2015): ``eps_low=None`` (and ``eps_high=None``) removes the
      clip, leaving the importance-sampled surrogate :math:`-\rho A` TRPO maximises.
    * GRPO (Shao et al., 2024, eq. 3): per-response advantages and
      ``agg="seq-mean-token-mean"``, :math:`-\frac1G\sum_i \frac{1}{|o_i|}\sum_t \min(\cdot)`;
      its :math:`\beta` KL term is :func:`kl_penalty`, added to this loss.
    * DAPO (Yu et al., 2025): clip-higher, ``eps_high > eps_low``, with ``agg="token-mean"``.
    * Dr. GRPO (Liu et al., 2025): ``agg="seq-mean-token-sum-norm"`` with ``max_len`` (and
      advantages without the std division, ``advantages.grpo(..., scale="none")``).
    * GSPO (Zheng et al., 2025): ``ratio_level="sequence"``, the length-normalised sequence
      ratio :math:`s_i = \exp(\frac{1}{|o_i|}\sum_t \log\rho_{i,t})` in place of
      :math:`\rho_{i,t}`, in GSPO-token form: value :math:`s_i` at every token, gradient
      through each token's log-prob, which equals GSPO's sequence objective for
      per-sequence advantages. GSPO's clip range is far smaller than PPO's (the paper:
      3e-4 / 4e-4).

    ``dual_clip=c`` (``c > 1``; dual-clip PPO, Ye et al., 2020) also bounds the loss of a
    negative-advantage token by :math:`-cA`:

    .. math::
        \ell_{i,t} = \min(\ell_{i,t}, -c A_{i,t}) \quad \text{for } A_{i,t} < 0,

    so a token whose ratio grew past :math:`c` while its advantage is negative gets no
    gradient. With ``ratio_level="sequence"`` the bound is on the sequence ratio: a
    response with :math:`A_i < 0` and :math:`s_i > c` gets no gradient. verl applies it
    (``clip_ratio_c = 3``) to its token-level loss, not to its GSPO loss.

    ``log_ratio_cap`` is the upper end of the clamp of the log-ratio before the
    exponential, so the ratio is at most :math:`e^{\text{cap}}`; the lower end stays at
    ``-LOG_RATIO_LIMIT`` (-20). verl caps GSPO's sequence log-ratio at 10
    (``compute_policy_loss_gspo``: ``clamp(log_ratio, max=10)``, no lower bound; below
    :math:`-20` the ratio is under 2e-9 and the two differ by less than that).

    Args:
      logp: ``[B, T]`` log-probs under :math:`\pi_\theta`.
      old_logp: ``[B, T]`` log-probs under :math:`\pi_{\text{old}}` (constant).
      advantages: ``[B]`` or ``[B, T]`` (constant).
      mask: ``[B, T]`` validity mask.
      eps_low: lower clip range :math:`\epsilon_{low} \ge 0`, or ``None`` for no bound.
      eps_high: upper clip range; defaults to ``eps_low``.
      dual_clip: the dual-clip constant :math:`c > 1`, or ``None``.
      ratio_level: ``"token"`` (:math:`\rho_{i,t}`) or ``"sequence"`` (GSPO's :math:`s_i`).
      log_ratio_cap: upper clamp of the log-ratio, in ``(0, LOG_RATIO_LIMIT]``.
      agg: aggregation mode.
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``; metrics as in the module docstring (plus
      ``dual_clip_fraction`` with ``dual_clip``); the ratio metrics are of the ratio used,
      :math:`s_i` at the sequence level.
    """
    fn = "ppo_clip"
    _check_agg(fn, agg, max_len)
    _checks.one_of(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    _checks.in_range(fn, "log_ratio_cap", log_ratio_cap, 0.0, LOG_RATIO_LIMIT, closed="(]")
    low, high = _clip_bounds(fn, eps_low, eps_low if eps_high is None else eps_high)
    if dual_clip is not None:
        _checks.in_range(fn, "dual_clip", dual_clip, 1.0, float("inf"), closed="()")
    inputs = _LossInputs(fn, logp, advantages, mask, old_logp)
    log_ratio = inputs.logp - inputs.old_logp if ratio_level == "token" else _sequence_log_ratio(inputs)  # [B, T]
    adv = inputs.advantages
    ratio = _ratio(log_ratio, log_ratio_cap)  # [B, T]
    clipped_ratio = jnp.clip(ratio, low, high)
    surrogate = jnp.minimum(ratio * adv, clipped_ratio * adv)  # [B, T]
    # The clip removes a token's gradient when the clipped branch is strictly smaller.
    clipped_low = (ratio < low) & (adv < 0) if low is not None else jnp.zeros_like(adv, bool)
    clipped_high = (ratio > high) & (adv > 0) if high is not None else jnp.zeros_like(adv, bool)
    metrics = {
        "clip_fraction_low": inputs.mean(clipped_low.astype(jnp.float32)),
        "clip_fraction_high": inputs.mean(clipped_high.astype(jnp.float32)),
    }
    metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
    if dual_clip is not None:
        dual_clipped = (adv < 0) & (surrogate < dual_clip * adv)
        surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, dual_clip * adv), surrogate)
        metrics["dual_clip_fraction"] = inputs.mean(dual_clipped.astype(jnp.float32))
        metrics["clip_fraction"] = metrics["clip_fraction"] + metrics["dual_clip_fraction"]
    metrics.update(_ratio_metrics(inputs, ratio))
    loss = aggregation.aggregate(-surrogate, inputs.mask, mode=agg, max_len=max_len)
    metrics["policy_loss"] = loss
    return loss, metrics


def cispo(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float | None,
    eps_high: float | None,
    agg: AggregationMode = "token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""CISPO (MiniMax-M1, 2025): clip the importance weight, not the update.

    .. math::
        \ell_{i,t} = -\operatorname{sg}\!\big[\operatorname{clip}(\rho_{i,t}, 1-\epsilon_{low},
            1+\epsilon_{high})\big]\, A_{i,t} \log\pi_\theta(a_{i,t} \mid s_{i,t})

    Unlike PPO, every token keeps a gradient; the clip only bounds its weight. MiniMax-M1
    leaves the lower side effectively unbounded: pass ``eps_low=None`` for that.

    Args:
      logp: ``[B, T]`` log-probs under :math:`\pi_\theta`.
      old_logp: ``[B, T]`` log-probs under :math:`\pi_{\text{old}}` (constant).
      advantages: ``[B]`` or ``[B, T]`` (constant).
      mask: ``[B, T]`` validity mask.
      eps_low: lower clip range, or ``None`` for no lower bound.
      eps_high: upper clip range, or ``None`` for no upper bound.
      agg: aggregation mode.
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``; ``clip_fraction*`` count tokens whose weight was clipped.
    """
    fn = "cispo"
    _check_agg(fn, agg, max_len)
    low, high = _clip_bounds(fn, eps_low, eps_high)
    inputs = _LossInputs(fn, logp, advantages, mask, old_logp)
    ratio = _ratio(inputs.logp - inputs.old_logp)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))  # [B, T]
    per_token = -weight * inputs.advantages * inputs.logp
    loss = aggregation.aggregate(per_token, inputs.mask, mode=agg, max_len=max_len)
    below = ratio < low if low is not None else jnp.zeros_like(ratio, bool)
    above = ratio > high if high is not None else jnp.zeros_like(ratio, bool)
    metrics = {
        "policy_loss": loss,
        "clip_fraction_low": inputs.mean(below.astype(jnp.float32)),
        "clip_fraction_high": inputs.mean(above.astype(jnp.float32)),
        **_ratio_metrics(inputs, ratio),
    }
    metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
    return loss, metrics


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip: float | None = None,
    agg: AggregationMode = "token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""PPO's critic loss, optionally clipped around the values at rollout time.

    .. math::
        \ell_t = \tfrac12 \max\!\big((V_t - \hat R_t)^2,\;
            (\operatorname{clip}(V_t, V^{old}_t - c, V^{old}_t + c) - \hat R_t)^2\big)

    (without ``clip``: :math:`\tfrac12 (V_t - \hat R_t)^2`).

    Args:
      values: ``[B, T]`` current critic values (differentiable).
      old_values: ``[B, T]`` critic values when the batch was collected (constant).
      returns: ``[B, T]`` return targets :math:`\hat R_t`, e.g. from :func:`gae` (constant).
      mask: ``[B, T]`` validity mask.
      clip: the value clip range :math:`c > 0`, or ``None``.
      agg: aggregation mode.
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``; metrics: ``value_loss``, ``value_clip_fraction`` (tokens where
      the clipped error was the larger), ``value_mean``, ``explained_variance``.
    """
    fn = "value_loss"
    _check_agg(fn, agg, max_len)
    if clip is not None:
        _checks.positive(fn, "clip", clip)
    values = _checks.floating(fn, "values", values)
    _checks.rank(fn, "values", values, 2, "[B, T]")
    old_values = _checks.floating(fn, "old_values", old_values)
    returns = _checks.floating(fn, "returns", returns)
    _checks.same_shape(fn, "old_values", old_values, "values", values)
    _checks.same_shape(fn, "returns", returns, "values", values)
    mask = _checks.mask(fn, mask, "values", values).astype(jnp.float32)
    valid = mask > 0
    values = jnp.where(valid, values.astype(jnp.float32), 0.0)
    old_values = jax.lax.stop_gradient(jnp.where(valid, old_values.astype(jnp.float32), 0.0))
    returns = jax.lax.stop_gradient(jnp.where(valid, returns.astype(jnp.float32), 0.0))

    error = jnp.square(values - returns)  # [B, T]
    if clip is None:
        per_token = 0.5 * error
        clipped = jnp.zeros_like(error)
    else:
        # Clip the value itself: old + clip(values - old, -c, c) can land an ulp off `values`
        # inside the band, and would count as clipped.
        clipped_values = jnp.clip(values, old_values - clip, old_values + clip)
        clipped_error = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(error, clipped_error)
        clipped = (clipped_error > error).astype(jnp.float32)
    loss = aggregation.aggregate(per_token, mask, mode=agg, max_len=max_len)

    def variance(x: jax.Array) -> jax.Array:
        return aggregation.masked_mean(jnp.square(x - aggregation.masked_mean(x, mask)), mask)

    residual_var = variance(returns - values)
    returns_var = variance(returns)
    metrics = {
        "value_loss": loss,
        "value_clip_fraction": aggregation.masked_mean(clipped, mask),
        "value_mean": aggregation.masked_mean(jax.lax.stop_gradient(values), mask),
        # 1 - Var[R - V] / Var[R] over valid tokens; 0 when Var[R] = 0.
        "explained_variance": jax.lax.stop_gradient(
            jnp.where(returns_var > 0, 1.0 - residual_var / jnp.where(returns_var > 0, returns_var, 1.0), 0.0)
        ),
    }
    return loss, metrics


def kl_penalty(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    coef: float,
    estimator: kl_lib.KLEstimator = "k3",
    clamp: float | None = None,
    agg: AggregationMode = "seq-mean-token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""A KL-to-reference penalty to add to any objective's loss (GRPO's :math:`\beta` term):

    .. math::
        L = \beta\, \operatorname{agg}_{i,t}\big[\widehat{D}_{KL}[\pi_\theta \| \pi_{\text{ref}}]_{i,t}\big]

    with :math:`\widehat{D}_{KL}` the per-token estimator (:mod:`jaxrl_llm.kl`),
    differentiated as written, the reference constant. Aggregated like the objective
    (pass its ``agg``), :math:`\operatorname{agg}(\ell) + \beta\operatorname{agg}(\hat D)
    = \operatorname{agg}(\ell + \beta \hat D)`: DeepSeekMath's per-token sum.

    Args:
      logp: ``[B, T]`` log-probs under :math:`\pi_\theta` (differentiable).
      ref_logp: ``[B, T]`` log-probs under :math:`\pi_{\text{ref}}` (constant).
      mask: ``[B, T]`` validity mask.
      coef: :math:`\beta \ge 0`; at 0 the KL is only reported.
      estimator: one of :data:`jaxrl_llm.kl.KL_ESTIMATORS`.
      clamp: clamp each estimate to ``[-clamp, clamp]`` (> 0), as verl's ``low_var_kl``
        (k3, clamp 10); ``None``: no clamp.
      agg: aggregation mode (the objective's, to keep the weights consistent).
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``; metrics: ``kl_<estimator>`` (e.g. ``kl_k3``), the token mean
      of the estimates before any clamp (the clamp shapes the loss, not the measurement).
    """
    fn = "kl_penalty"
    _check_agg(fn, agg, max_len)
    _checks.nonnegative(fn, "coef", coef)
    _checks.one_of(fn, "estimator", estimator, kl_lib.KL_ESTIMATORS)
    if clamp is not None:
        _checks.positive(fn, "clamp", clamp)
    logp = _checks.floating(fn, "logp", logp)
    _checks.rank(fn, "logp", logp, 2, "[B, T]")
    ref_logp = _checks.floating(fn, "ref_logp", ref_logp)
    _checks.same_shape(fn, "ref_logp", ref_logp, "logp", logp)
    mask = _checks.mask(fn, mask, "logp", logp).astype(jnp.float32)
    # Padding positions may hold anything (even -inf): they are zeroed before the estimator.
    valid = mask > 0
    logp = jnp.where(valid, logp.astype(jnp.float32), 0.0)
    ref_logp = jnp.where(valid, ref_logp.astype(jnp.float32), 0.0)
    per_token = kl_lib.estimate(logp, ref_logp, estimator=estimator)  # [B, T]
    if _checks.is_number(coef) and coef == 0:  # reported only: no gradient through it (a NaN there stays out)
        loss = jnp.zeros((), jnp.float32)
    else:
        penalised = per_token if clamp is None else jnp.clip(per_token, -clamp, clamp)
        loss = coef * aggregation.aggregate(penalised, mask, mode=agg, max_len=max_len)
    return loss, {f"kl_{estimator}": aggregation.masked_mean(jax.lax.stop_gradient(per_token), mask)}


def entropy_bonus(
    entropy: jax.Array,
    mask: jax.Array,
    *,
    coef: float,
    agg: AggregationMode = "token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, Metrics]:
    r"""An entropy bonus to add to any objective's loss: :math:`L = -c\,\operatorname{agg}(H)`.

    Args:
      entropy: ``[B, T]`` per-token entropies, e.g. :func:`jaxrl_llm.ops.entropy` of the
        policy's logits (differentiable).
      mask: ``[B, T]`` validity mask.
      coef: bonus coefficient :math:`c \ge 0`.
      agg: aggregation mode (use the policy objective's to keep the weights consistent).
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``; metrics: ``entropy`` (token mean).

    Example::

        pg_loss, metrics = objectives.ppo_clip(logp, old_logp, adv, mask)
        ent_loss, ent_metrics = objectives.entropy_bonus(ops.entropy(logits), mask, coef=1e-3)
        loss = pg_loss + ent_loss
    """
    fn = "entropy_bonus"
    _check_agg(fn, agg, max_len)
    _checks.nonnegative(fn, "coef", coef)
    entropy = _checks.floating(fn, "entropy", entropy)
    _checks.rank(fn, "entropy", entropy, 2, "[B, T]")
    mask = _checks.mask(fn, mask, "entropy", entropy).astype(jnp.float32)
    entropy = jnp.where(mask > 0, entropy.astype(jnp.float32), 0.0)
    loss = -coef * aggregation.aggregate(entropy, mask, mode=agg, max_len=max_len)
    return loss, {"entropy": aggregation.masked_mean(jax.lax.stop_gradient(entropy), mask)}
