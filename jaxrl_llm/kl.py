r"""KL divergence between a policy and a reference, per token.

The sample estimators follow J. Schulman, "Approximating KL Divergence" (2020). Given
tokens sampled from :math:`\pi_\theta` and the log-ratio
:math:`r = \log \pi_{\text{ref}}(a) - \log \pi_\theta(a)`, each estimates
:math:`D_{KL}(\pi_\theta \,\|\, \pi_{\text{ref}})` at that token:

====  ==================================  ======================================
name  estimator                           properties
====  ==================================  ======================================
k1    :math:`-r`                          unbiased, high variance, can be < 0
k2    :math:`r^2 / 2`                     biased (exact to 2nd order), >= 0
k3    :math:`e^{r} - r - 1`               unbiased, >= 0, low variance (GRPO)
abs   :math:`|r|`                         biased, >= 0 (verl's ``abs``)
====  ==================================  ======================================

:func:`estimate` can clamp an estimate to ``[-clamp, clamp]``: verl's ``low_var_kl`` is
k3 clamped to ``[-10, 10]`` (after the log-ratio's ``[-20, 20]``, which k3 always
applies). A clamped token has no gradient: past :math:`k_3 = 10` (:math:`r` below
about -11.0 or above about 2.61) it stops pulling towards the reference.

The estimators are differentiated as written, the way GRPO (DeepSeekMath) and TRL put
them in the loss; the reference log-probs are treated as constants. What the gradient
of each then optimises, in expectation over tokens sampled on-policy, is not the same
(and tests/test_kl.py checks it exactly over a vocabulary):

* k1: :math:`\mathbb{E}_\pi[\nabla k_1] = \mathbb{E}_\pi[\nabla\log\pi] = 0`. As a
  loss term it only adds noise; k1 belongs in the *reward* (PPO, REINFORCE++), where
  the policy gradient turns it into :math:`\nabla D_{KL}(\pi\|\pi_{ref})`.
* k2: :math:`\mathbb{E}_\pi[\nabla k_2] = \nabla D_{KL}(\pi \,\|\, \pi_{ref})`, the
  gradient of the KL it estimates.
* k3: :math:`\mathbb{E}_\pi[\nabla k_3] = \nabla D_{KL}(\pi_{ref} \,\|\, \pi)`, the
  *reverse* KL: still a penalty that pulls towards the reference (GRPO's choice), but
  not the gradient of the value it reports.

After the first update of a rollout batch (``mu > 1``) tokens come from
:math:`\pi_{old}`, not :math:`\pi_\theta`, and none of the three is importance-weighted.

:func:`categorical` is the exact KL between two full next-token distributions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks

LOG_RATIO_LIMIT = 20.0
"""k3's log-ratio is clamped to ``[-20, 20]`` before the exponential."""

KLEstimator = Literal["k1", "k2", "k3", "abs"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def _log_ratio(fn: str, logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """``log pi_ref - log pi`` in float32, the reference under stop_gradient."""
    logp = _checks.floating(fn, "logp", logp)
    ref_logp = _checks.floating(fn, "ref_logp", ref_logp)
    _checks.same_shape(fn, "ref_logp", ref_logp, "logp", logp)
    ref_logp = jax.lax.stop_gradient(ref_logp)
    return ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)


def k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    r"""Unbiased estimator :math:`\log \pi_\theta(a) - \log \pi_{\text{ref}}(a)`.

    Args:
      logp: ``[B, T]`` log-probs of sampled tokens under the policy.
      ref_logp: ``[B, T]`` log-probs of the same tokens under the reference.

    Returns:
      ``[B, T]`` float32 per-token estimates.
    """
    return -_log_ratio("k1", logp, ref_logp)


def k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    r"""Squared-log-ratio estimator :math:`\tfrac12 (\log \pi_\theta(a) - \log \pi_{\text{ref}}(a))^2`.

    Args:
      logp: ``[B, T]`` log-probs of sampled tokens under the policy.
      ref_logp: ``[B, T]`` log-probs of the same tokens under the reference.

    Returns:
      ``[B, T]`` float32 per-token estimates, each >= 0.
    """
    return 0.5 * jnp.square(_log_ratio("k2", logp, ref_logp))


def k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    r"""Low-variance unbiased estimator :math:`e^{r} - r - 1`,
    :math:`r = \log\frac{\pi_{\text{ref}}(a)}{\pi_\theta(a)}`.

    This is the KL term of GRPO (Shao et al., 2024, eq. 4). It is computed as
    ``expm1(r) - r``, which keeps full precision when the policies are close, with
    :math:`r` clamped to ``[-20, 20]`` so that it cannot overflow.

    Args:
      logp: ``[B, T]`` log-probs of sampled tokens under the policy.
      ref_logp: ``[B, T]`` log-probs of the same tokens under the reference.

    Returns:
      ``[B, T]`` float32 per-token estimates, each >= 0.
    """
    # Clamped like the objectives' ratios: e^r overflows float32 past r ~ 88.
    log_ratio = jnp.clip(_log_ratio("k3", logp, ref_logp), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return jnp.expm1(log_ratio) - log_ratio


def absolute(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    r"""Absolute log-ratio :math:`|\log \pi_\theta(a) - \log \pi_{\text{ref}}(a)|` (verl's ``abs``).

    Args:
      logp: ``[B, T]`` log-probs of sampled tokens under the policy.
      ref_logp: ``[B, T]`` log-probs of the same tokens under the reference.

    Returns:
      ``[B, T]`` float32 per-token estimates, each >= 0.
    """
    return jnp.abs(_log_ratio("abs", logp, ref_logp))


ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {"k1": k1, "k2": k2, "k3": k3, "abs": absolute}


def estimate(
    logp: jax.Array, ref_logp: jax.Array, *, estimator: KLEstimator = "k3", clamp: float | None = None
) -> jax.Array:
    """Per-token KL estimate by name: one of :data:`KL_ESTIMATORS`, clamped to
    ``[-clamp, clamp]`` when ``clamp`` is given (> 0; zero gradient where it binds).
    Shapes ``[B, T]``."""
    _checks.one_of("kl.estimate", "estimator", estimator, KL_ESTIMATORS)
    estimates = ESTIMATORS[estimator](logp, ref_logp)
    if clamp is None:
        return estimates
    _checks.positive("kl.estimate", "clamp", clamp)
    return jnp.clip(estimates, -clamp, clamp)


def categorical(logits_p: jax.Array, logits_q: jax.Array) -> jax.Array:
    r"""Exact :math:`D_{KL}(p \,\|\, q) = \sum_v p_v (\log p_v - \log q_v)` per position.

    Computed in float32 from logits. Vocabulary entries with :math:`p_v = 0` (logit
    ``-inf``) contribute zero. Differentiable with respect to both arguments.

    Args:
      logits_p: ``[B, T, V]`` logits of :math:`p`, ``V >= 1`` (e.g. :math:`\pi_{\text{old}}`
        for TRPO's constraint, or :math:`\pi_\theta` for a penalty to the reference).
      logits_q: ``[B, T, V]`` logits of :math:`q`.

    Returns:
      ``[B, T]`` float32 KL divergences, each >= 0.
    """
    fn = "kl.categorical"
    logits_p = _checks.floating(fn, "logits_p", logits_p)
    logits_q = _checks.floating(fn, "logits_q", logits_q)
    _checks.rank(fn, "logits_p", logits_p, 3, "[B, T, V]")
    _checks.nonempty(fn, "logits_p", logits_p, "a vocabulary of at least one token", axes=(-1,))
    _checks.same_shape(fn, "logits_q", logits_q, "logits_p", logits_p)
    log_p = jax.nn.log_softmax(logits_p.astype(jnp.float32), axis=-1)  # [B, T, V]
    log_q = jax.nn.log_softmax(logits_q.astype(jnp.float32), axis=-1)  # [B, T, V]
    p = jnp.exp(log_p)
    # Terms with p = 0 are 0. Zero both logs there *before* the product: a masked
    # 0 * -inf would still put NaN into the backward pass through `jnp.where`.
    support = p > 0
    log_p = jnp.where(support, log_p, 0.0)
    log_q = jnp.where(support, log_q, 0.0)
    return jnp.sum(p * (log_p - log_q), axis=-1)
