r"""Trust Region Policy Optimization (Schulman et al., 2015) on any parameter pytree.

TRPO maximises the surrogate :math:`\mathbb{E}[\rho A]` subject to
:math:`\bar D_{KL}(\pi_{\text{old}} \,\|\, \pi_\theta) \le \delta`. With the loss
:math:`L(\theta) = -\mathbb{E}[\rho A]`, its gradient :math:`g` and the Fisher matrix
:math:`F` (the Hessian of the KL at :math:`\theta_{\text{old}}`):

1. solve :math:`F s = -g` with conjugate gradient, using only Fisher-vector products
   (a Hessian-vector product of the KL: ``jvp`` of ``grad``; no matrix is formed);
2. scale to the trust region: :math:`\Delta = \sqrt{2\delta / s^\top F s}\; s`;
3. backtrack :math:`\theta_k = \theta + \alpha^k \Delta` until the KL bound holds
   *and* the surrogate loss decreased; if no step qualifies, keep :math:`\theta`.

Everything is a pure function of pytrees and runs under ``jax.jit``; there is no
optimizer state. The surrogate and KL are closures the caller builds over its batch,
for example:

.. code-block:: python

    def surrogate_fn(p):  # loss to minimise
        return objectives.ppo_clip(logp_fn(p), old_logp, adv, mask, eps_low=jnp.inf)[0]

    def kl_fn(p):  # mean KL(pi_old || pi_p) over the batch's states
        return ops.masked_mean(kl.categorical(old_logits, logits_fn(p)), mask)

    params, info = trpo.natural_gradient_step(old_params, surrogate_fn=surrogate_fn, kl_fn=kl_fn)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax.tree_utils as otu

from jaxrl_llm import _checks
from jaxrl_llm.ops.trees import all_finite

PyTree = Any
MatVec = Callable[[PyTree], PyTree]


class CGState(NamedTuple):
    """Loop state of :func:`conjugate_gradient`; every leaf float32."""

    x: PyTree  # current solution
    r: PyTree  # residual b - A x
    p: PyTree  # search direction
    r_dot_r: jax.Array  # [] float32: squared residual norm
    iteration: jax.Array  # [] int32: iterations that updated x
    stalled: jax.Array  # [] bool: met a direction of non-positive curvature


def _step(params: PyTree, scale: jax.Array, direction: PyTree) -> PyTree:
    """``params + scale * direction``, keeping each leaf's dtype."""
    return jax.tree.map(lambda p, d: (p + scale * d).astype(p.dtype), params, direction)


def _conjugate_gradient(matvec: MatVec, b: PyTree, *, iters: int, tol: float) -> CGState:
    """Conjugate gradient in float32 (whatever ``b``'s dtypes), returning the final state."""
    b = otu.tree_cast(b, jnp.float32)

    def matvec_f32(v: PyTree) -> PyTree:
        return otu.tree_cast(matvec(v), jnp.float32)

    init = CGState(
        x=otu.tree_zeros_like(b),
        r=b,
        p=b,
        r_dot_r=otu.tree_vdot(b, b),
        iteration=jnp.zeros((), jnp.int32),
        stalled=jnp.zeros((), bool),
    )

    def keep_going(state: CGState) -> jax.Array:
        return (state.iteration < iters) & (state.r_dot_r > tol) & ~state.stalled

    def step(state: CGState) -> CGState:
        a_p = matvec_f32(state.p)
        p_a_p = otu.tree_vdot(state.p, a_p)
        # A zero (or, from round-off, negative) curvature direction ends the solve.
        stalled = ~(p_a_p > 0)
        alpha = jnp.where(stalled, 0.0, state.r_dot_r / jnp.where(stalled, 1.0, p_a_p))
        x = otu.tree_add_scale(state.x, alpha, state.p)
        r = otu.tree_add_scale(state.r, -alpha, a_p)
        r_dot_r = otu.tree_vdot(r, r)
        beta = r_dot_r / jnp.where(state.r_dot_r > 0, state.r_dot_r, 1.0)
        p = otu.tree_add_scale(r, beta, state.p)
        return CGState(x=x, r=r, p=p, r_dot_r=r_dot_r, iteration=state.iteration + (~stalled), stalled=stalled)

    return jax.lax.while_loop(keep_going, step, init)


def conjugate_gradient(matvec: MatVec, b: PyTree, *, iters: int = 10, tol: float = 1e-10) -> PyTree:
    r"""Solves :math:`A x = b` for symmetric positive-definite :math:`A` given as a matvec.

    The classic Hestenes-Stiefel iteration from :math:`x_0 = 0`, over arbitrary pytrees
    (parameter trees), as a ``lax.while_loop``. It stops after ``iters`` iterations or
    once :math:`\|r\|^2 \le` ``tol`` (TRPO's rule), whichever comes first.

    Args:
      matvec: ``v -> A v`` on pytrees with ``b``'s structure; linear, symmetric, PD.
      b: right-hand side pytree.
      iters: maximum number of iterations (``>= 1``).
      tol: stop when the squared residual norm falls to this (``>= 0``).

    The iteration runs in float32 whatever ``b``'s dtypes (a bfloat16 CG loses the
    conjugacy it depends on); ``matvec`` receives float32 vectors.

    Returns:
      The approximate solution :math:`x`, a pytree like ``b`` in float32.
    """
    _checks.positive_int("conjugate_gradient", "iters", iters)
    _checks.nonnegative("conjugate_gradient", "tol", tol)
    return _conjugate_gradient(matvec, b, iters=iters, tol=tol).x


def fisher_vector_product(kl_fn: Callable[[PyTree], jax.Array], params: PyTree, *, damping: float = 0.1) -> MatVec:
    r"""Returns :math:`v \mapsto (F + \lambda I) v` with :math:`F = \nabla^2_\theta\, \mathrm{kl\_fn}(\theta)`.

    At :math:`\theta = \theta_{\text{old}}`, the Hessian of
    :math:`D_{KL}(\pi_{\text{old}} \| \pi_\theta)` is the Fisher information matrix of
    the policy, so with ``kl_fn`` the mean KL over the batch's states and ``params`` the
    old parameters this is the Fisher-vector product TRPO needs. It is computed as a
    Hessian-vector product, forward-over-reverse: the gradient is linearised once
    (``jax.linearize``) and each product is one forward-mode pass of it, so conjugate
    gradient's repeated products do not repeat the forward pass.

    Args:
      kl_fn: ``params -> []`` scalar KL, twice differentiable.
      params: the point (pytree) at which to take the Hessian.
      damping: :math:`\lambda \ge 0`, added for conditioning (TRPO's ``cg_damping``).

    Returns:
      A function from a pytree shaped like ``params`` (any float dtype) to a pytree of
      the same shapes and dtypes as its argument.
    """
    _checks.nonnegative("fisher_vector_product", "damping", damping)
    _, hessian_vector_product = jax.linearize(jax.grad(kl_fn), params)

    def matvec(vector: PyTree) -> PyTree:
        # Tangents must have the parameters' dtypes; the product comes back in vector's.
        product = otu.tree_cast_like(hessian_vector_product(otu.tree_cast_like(vector, params)), vector)
        return otu.tree_add_scale(product, damping, vector)

    return matvec


def natural_gradient_step(
    params: PyTree,
    *,
    surrogate_fn: Callable[[PyTree], jax.Array],
    kl_fn: Callable[[PyTree], jax.Array],
    max_kl: float = 0.01,
    damping: float = 0.1,
    cg_iters: int = 10,
    backtrack_coef: float = 0.8,
    max_backtracks: int = 10,
) -> tuple[PyTree, dict[str, jax.Array]]:
    r"""One TRPO update from the old parameters: natural gradient plus KL line search.

    .. math::
        s = -(F + \lambda I)^{-1} g, \qquad
        \theta_k = \theta + \alpha^k \sqrt{\frac{2\delta}{s^\top (F+\lambda I) s}}\; s,
        \quad k = 0, 1, \dots, K

    The first :math:`\theta_k` with :math:`\mathrm{kl\_fn}(\theta_k) \le \delta` and
    :math:`\mathrm{surrogate\_fn}(\theta_k) < \mathrm{surrogate\_fn}(\theta)` (both
    finite, and every parameter of :math:`\theta_k` finite) is returned; if none of the
    :math:`K+1` candidates qualifies, ``params`` is returned unchanged.

    Args:
      params: :math:`\theta_{\text{old}}`, the parameters that sampled the batch.
      surrogate_fn: ``params -> []`` the surrogate *loss* to minimise, e.g.
        :math:`-\mathbb{E}[\rho A]` (like every objective in :mod:`jaxrl_llm.objectives`).
      kl_fn: ``params -> []`` mean :math:`D_{KL}(\pi_{\text{old}} \| \pi_{\text{params}})`
        over the batch's states; 0 at ``params``.
      max_kl: the trust-region radius :math:`\delta > 0`.
      damping: :math:`\lambda \ge 0` added to the Fisher matrix.
      cg_iters: conjugate-gradient iterations.
      backtrack_coef: :math:`\alpha \in (0, 1)`, the step shrink factor.
      max_backtracks: :math:`K \ge 0`, how many times the step may shrink.

    Returns:
      ``(new_params, info)``; ``info`` holds scalars: ``accepted`` (bool),
      ``backtracks`` (shrinks before acceptance; ``max_backtracks + 1`` if rejected),
      ``kl`` and ``improvement`` (surrogate decrease) at the returned params,
      ``expected_improvement`` (first-order prediction for the full step),
      ``step_size`` (the scale applied to :math:`s`, 0 if rejected), ``grad_norm``,
      ``cg_residual`` (:math:`\|r\|` at the end of CG), ``cg_iterations`` and
      ``cg_stalled`` (CG met non-positive curvature). The step is computed in float32 and
      each parameter keeps its dtype.
    """
    fn = "natural_gradient_step"
    _checks.positive(fn, "max_kl", max_kl)
    _checks.nonnegative(fn, "damping", damping)
    _checks.positive_int(fn, "cg_iters", cg_iters)
    _checks.in_range(fn, "backtrack_coef", backtrack_coef, 0.0, 1.0, closed="()")
    _checks.nonnegative_int(fn, "max_backtracks", max_backtracks)

    loss_old, grad = jax.value_and_grad(surrogate_fn)(params)
    fvp = fisher_vector_product(kl_fn, params, damping=damping)
    cg = _conjugate_gradient(fvp, otu.tree_scale(-1.0, grad), iters=cg_iters, tol=1e-10)
    direction = cg.x
    curvature = otu.tree_vdot(direction, fvp(direction))  # s^T (F + lambda I) s, float32
    full_scale = jnp.where(curvature > 0, jnp.sqrt(2.0 * max_kl / jnp.where(curvature > 0, curvature, 1.0)), 0.0)
    expected_improvement = -full_scale * otu.tree_vdot(grad, direction)

    def candidate(k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Step scale, KL, improvement and acceptance of the k-th candidate."""
        scale = full_scale * backtrack_coef ** k.astype(jnp.float32)
        new_params = _step(params, scale, direction)
        kl_value = kl_fn(new_params)
        improvement = loss_old - surrogate_fn(new_params)
        ok = (
            (kl_value <= max_kl)
            & (improvement > 0)
            & jnp.isfinite(kl_value)
            & jnp.isfinite(improvement)
            & (all_finite(new_params))
        )
        return scale, kl_value, improvement, ok & (full_scale > 0)

    # Carry (k, accepted, scale, kl, improvement): try k = 0, shrink while rejected.
    def rejected_and_budget_left(carry):
        k, accepted, *_ = carry
        return (~accepted) & (k < max_backtracks)

    def shrink(carry):
        k = carry[0] + 1
        scale, kl_value, improvement, accepted = candidate(k)
        return (k, accepted, scale, kl_value, improvement)

    first = jnp.zeros((), jnp.int32)
    scale, kl_value, improvement, accepted = candidate(first)
    k, accepted, scale, kl_value, improvement = jax.lax.while_loop(
        rejected_and_budget_left, shrink, (first, accepted, scale, kl_value, improvement)
    )
    new_params = jax.tree.map(lambda new, old: jnp.where(accepted, new, old), _step(params, scale, direction), params)
    info = {
        "accepted": accepted,
        "backtracks": jnp.where(accepted, k, max_backtracks + 1),
        "kl": jnp.where(accepted, kl_value, 0.0),
        "improvement": jnp.where(accepted, improvement, 0.0),
        "expected_improvement": expected_improvement,
        "step_size": jnp.where(accepted, scale, 0.0),
        "grad_norm": otu.tree_norm(grad),
        "cg_residual": jnp.sqrt(cg.r_dot_r),
        "cg_iterations": cg.iteration,
        "cg_stalled": cg.stalled,
    }
    return new_params, info
