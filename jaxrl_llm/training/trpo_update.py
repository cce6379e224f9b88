r"""TRPO's update of the train state: one natural-gradient step on the whole batch.

The surrogate is the method's loss at the batch's old log-probs, recomputed at the params
before the step; the constraint is the exact mean KL over the vocabulary,
:math:`\bar D_{KL}(\pi_{old}\|\pi_\theta) \le \delta`, at the batch's completion states.
The step itself (conjugate gradient on Fisher-vector products, then a backtracking line
search on the KL and the surrogate) is :func:`jaxrl_llm.trpo.natural_gradient_step`
(Schulman et al. 2015, "Trust Region Policy Optimization", Appendix C).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import algorithms, ops, trpo
from jaxrl_llm.objectives import Metrics
from jaxrl_llm.training.batch import ScoredBatch
from jaxrl_llm.training.losses import TeacherForcing, policy_loss
from jaxrl_llm.training.state import TrainState


def trpo_update(
    state: TrainState, scored: ScoredBatch, *, policy: TeacherForcing, algorithm: algorithms.Algorithm
) -> tuple[TrainState, Metrics]:
    """The state after one natural-gradient step on ``scored``, and the step's metrics
    (the loss's after the step, ``trpo_*`` from the solver, ``grad_norm``, and the step
    size as ``learning_rate``). A non-finite gradient counts as a skipped update; a
    candidate with a non-finite parameter, KL or surrogate is rejected by the line search
    and the params stay."""
    old_params = state.params
    old_states = jax.lax.stop_gradient(policy.states(old_params, scored))
    old_head = jax.lax.stop_gradient(policy.head(old_params))
    old_logp = policy.logprobs(old_states, old_head, scored)

    def surrogate(params):
        return policy_loss(params, scored, policy=policy, algorithm=algorithm, on_policy=False, old_logp=old_logp)[0]

    def kl_from_old(params):  # exact mean KL(pi_old || pi_params) over the batch's completion states
        per_token = policy.categorical_kl(old_states, old_head, policy.states(params, scored), policy.head(params))
        return ops.masked_mean(per_token, scored.completion_mask)

    params, info = trpo.natural_gradient_step(
        old_params,
        surrogate_fn=surrogate,
        kl_fn=kl_from_old,
        max_kl=algorithm.max_kl,
        damping=algorithm.cg_damping,
        cg_iters=algorithm.cg_iters,
        backtrack_coef=algorithm.backtrack_coef,
        max_backtracks=algorithm.max_backtracks,
    )
    _, metrics = policy_loss(
        params, scored, policy=policy, algorithm=algorithm, on_policy=False, old_logp=old_logp
    )  # diagnostics after the step
    metrics.update({f"trpo_{name}": value.astype(jnp.float32) for name, value in info.items()})
    finite = jnp.isfinite(info["grad_norm"])
    # theta' = theta + step_size * s, s the natural-gradient direction: its learning rate.
    metrics.update(grad_norm=info["grad_norm"], learning_rate=metrics["trpo_step_size"])
    state = state._replace(
        params=params,
        step=state.step + 1,
        skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
        consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1),
    )
    return state, metrics
