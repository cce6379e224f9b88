r"""The two jitted halves of a train step: ``score`` and ``update``.

After the rollout and the host's rewards, a train step is

1. :func:`score` ``(state, fixed, batch) -> (scored, metrics)``: log-probs under the
   reference (when the method or a metric needs it) and, only when they can differ from the
   sampler's, under the old params; the critic's values; the advantages
   (:func:`jaxrl_llm.algorithms.compute_advantages`) and the running baseline after them;
2. :func:`update` ``(state, fixed, scored) -> (state, metrics)``: ``num_iterations`` passes
   over shuffled minibatches in one ``lax.scan`` of optax steps (:func:`optax_update`), or one
   TRPO natural-gradient step (:func:`jaxrl_llm.training.trpo_update.trpo_update`), plus the
   critic's steps for PPO.

``fixed`` (:class:`~jaxrl_llm.training.state.FixedParams`) holds what the steps read and
never change, the reference and LoRA's base: the caller's arrays, beside the state. Jit
``update`` donating the state alone (``donate_argnums=0``), as ``train`` does.

:func:`make_train_step` binds both to one (model, method, config); jit each once.

**Old log-probs.** With ``num_iterations = 1`` and one minibatch, the single gradient is
taken at the params that sampled the batch, so :math:`\log\pi_{old} = \operatorname{sg}
(\log\pi_\theta)`: the ratio is exactly 1 and no old-policy forward pass is paid for.
Otherwise ``score`` recomputes them at the snapshot (the same teacher-forced path as the
update, so the first minibatch's ratios are exactly 1 too).

**Shared prompts.** With ``TrainConfig.share_prompts``, every teacher-forced pass over
whole groups (``score``'s, the update's when its (micro-)batches hold whole groups,
TRPO's) runs each prompt once for its ``G`` completions
(:func:`jaxrl_llm.models.functional.group_completion_hidden_states`). Shuffled minibatches mix
groups: each of their rows runs its own prompt.

**Gradient accumulation.** With ``TrainConfig.micro_batch_size``, each optimizer step's
gradient is the sum of its micro-batches' gradients weighted by their share of the
loss's normaliser (:mod:`jaxrl_llm.training.accumulation`): the whole minibatch's
gradient, for a fraction of its activations' memory.

**Non-finite updates.** A minibatch whose loss, gradient or new parameters (policy's or
critic's) would not all be finite changes nothing: params and optimizer states keep their
values (:func:`jaxrl_llm.training.optim.apply_update_if`) and ``skipped_updates`` counts
it; TRPO keeps its params when no finite candidate passes the line search. So the state
only ever holds finite params. ``consecutive_skips`` counts the train steps in a row with
at least one skipped minibatch; the loop stops when that reaches
``TrainConfig.max_consecutive_skips``.

**Precision.** Optimizer moments, hyperparameters and updates are float32 whatever the
parameters' dtype, and low-precision params take their steps on float32 master copies
kept in the optimizer state (:func:`jaxrl_llm.training.optim.in_float32`).

**Exact KL.** With ``TrainConfig.exact_kl``, ``score`` reports ``kl_exact``,
:math:`D_{KL}(\pi_{old}\|\pi_{ref})` over the vocabulary (chunked), once per step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import algorithms, models, ops
from jaxrl_llm.objectives import Metrics
from jaxrl_llm.training import losses
from jaxrl_llm.training.accumulation import accumulate_gradients
from jaxrl_llm.training.batch import Batch, ScoredBatch, micro_batches, rows_with_own_prompts
from jaxrl_llm.training.config import TrainConfig
from jaxrl_llm.training.losses import TeacherForcing
from jaxrl_llm.training.optim import (
    RunOptimizers,
    apply_update_if,
    decay_steps_of_run,
    learning_rate_in,
    run_optimizers,
    update_is_finite,
)
from jaxrl_llm.training.state import FixedParams, TrainState, uses_reference
from jaxrl_llm.training.trpo_update import trpo_update

LORA_DROPOUT_STREAM = 0x4C6F5241
"""Folded into the update's key for LoRA dropout's masks (each minibatch folds in its index
too): a stream of its own, which leaves the run's key sequence as it is."""


def check_supported(algorithm: algorithms.Algorithm, config: TrainConfig) -> None:
    """Raises if the run's settings cannot work together."""
    name = algorithm.name
    if algorithm.update == "trpo" and config.num_minibatches != 1:
        raise ValueError(
            f"Algorithm {name!r} takes one natural-gradient step on the whole batch: set "
            f"TrainConfig.minibatch_size=None (got {config.minibatch_size} of B={config.batch_size})."
        )
    if algorithm.update == "trpo" and config.micro_batch_size is not None:
        raise ValueError(
            f"Algorithm {name!r}: TRPO's conjugate gradient and line search take the whole batch at "
            "once; gradient accumulation is not available: set TrainConfig.micro_batch_size=None."
        )
    if algorithm.update == "trpo" and algorithm.needs_critic:
        raise ValueError(
            f"Algorithm {name!r}: the TRPO update trains no critic, so GAE is not available with "
            "update='trpo'; use a critic-free advantage (rloo, grpo, ...)."
        )
    if config.group_size < 2 and algorithm.compares_within_groups:
        raise ValueError(
            f"Algorithm {name!r} compares each completion with the others sampled for its prompt (advantage="
            f"{algorithm.advantage!r}{', dynamic sampling' if algorithm.dynamic_sampling else ''}): with "
            "TrainConfig.group_size=1 every advantage is 0. Set group_size >= 2, or use a method without group "
            "baselines (pg, reinforce-baseline, ppo)."
        )
    batch_statistics = algorithm.advantage in ("batch_mean_baseline", "running_mean_baseline") or (
        algorithm.advantage == "grpo" and algorithm.group_scale == "batch"
    )
    if algorithm.dynamic_sampling and batch_statistics:
        raise ValueError(
            f"Algorithm {name!r}: dynamic sampling masks out groups without signal, but advantage="
            f"{algorithm.advantage!r} (group_scale={algorithm.group_scale!r}) takes statistics over every row of "
            "the batch, masked ones included; use a per-group estimator (rloo, or grpo with group_scale 'group' "
            "or 'none')."
        )


def _advantage_metrics(advantages: jax.Array, mask: jax.Array) -> Metrics:
    """Mean, std, min and max of the advantages ``[B]`` or ``[B, N]`` over the loss's tokens ``[B, N]``."""
    token_advantages = jnp.broadcast_to(advantages.reshape(advantages.shape[0], -1), mask.shape)  # [B, N]
    return dict(
        advantage_mean=ops.masked_mean(token_advantages, mask),
        advantage_std=jnp.sqrt(
            ops.masked_mean(jnp.square(token_advantages - ops.masked_mean(token_advantages, mask)), mask)
        ),
        advantage_min=ops.masked_min(token_advantages, mask),
        advantage_max=ops.masked_max(token_advantages, mask),
    )


def _check_fixed(fixed: FixedParams, policy: TeacherForcing, *, reference: bool) -> None:
    """Raises ValueError (while tracing) when ``fixed`` lacks what the step reads: the
    reference (when ``reference``: ``score`` of a run that uses one), or the base of a LoRA
    model's adapters."""
    if not isinstance(fixed, FixedParams):
        raise ValueError(f"`fixed` must be training.FixedParams (training.fixed_params); got {type(fixed).__name__}.")
    if reference and fixed.reference is None:
        raise ValueError(
            "the method's KL term (or a KL metric) reads a reference, and `fixed.reference` is None: "
            "build `fixed` with training.fixed_params(params, algorithm, config)."
        )
    model = getattr(policy, "model", None)  # another policy's TeacherForcing has no LoRA
    if model is not None and model.config.lora is not None and fixed.base is None:
        raise ValueError(
            "the model has LoRA adapters, and `fixed.base` is None: build `fixed` with "
            "training.fixed_params(adapters, algorithm, config, base=base_params)."
        )


def score(
    state: TrainState,
    fixed: FixedParams,
    batch: Batch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
) -> tuple[ScoredBatch, Metrics]:
    """The batch with its old and reference log-probs, values and advantages, and the
    metrics of scoring it (the advantages', ``kl_exact``)."""
    _check_fixed(fixed, policy, reference=uses_reference(algorithm, config))
    policy = losses.over_base(policy, fixed.base)
    mask = batch.completion_mask
    metrics = {}
    ref_logp = ref_states = policy_states = None
    if uses_reference(algorithm, config):
        ref_states = policy.states(fixed.reference, batch)  # [B, N, ...]
        ref_logp = policy.logprobs(ref_states, policy.head(fixed.reference), batch)
    if losses.is_on_policy(algorithm, config) or algorithm.update == "trpo" or not algorithm.needs_old_logp:
        old_logp = batch.sampling_logp  # TRPO recomputes its own in `update`
    else:
        policy_states = policy.states(state.params, batch)
        old_logp = policy.logprobs(policy_states, policy.head(state.params), batch)
    if config.exact_kl:
        if policy_states is None:
            policy_states = policy.states(state.params, batch)
        per_token = policy.categorical_kl(
            policy_states, policy.head(state.params), ref_states, policy.head(fixed.reference)
        )  # [B, N]
        metrics["kl_exact"] = ops.masked_mean(per_token, mask)
    old_values = policy.values(state.critic_params, batch) if algorithm.needs_critic else None
    advantages, returns, baseline = algorithms.compute_advantages(
        algorithm,
        batch.rewards,
        mask,
        group_size=config.group_size,
        logp=old_logp,
        ref_logp=ref_logp,
        values=old_values,
        baseline=state.baseline,
    )
    metrics.update(_advantage_metrics(advantages, mask))
    scored = ScoredBatch(
        prompt_tokens=batch.prompt_tokens,
        prompt_mask=batch.prompt_mask,
        completion_tokens=batch.completion_tokens,
        completion_mask=mask,
        old_logp=old_logp,
        ref_logp=ref_logp,
        advantages=advantages,
        returns=returns,
        old_values=old_values,
        baseline=baseline,
        prompts_drawn=batch.prompts_drawn,
    )
    return scored, metrics


def _value_and_grads(
    params,
    critic_params,
    rows: ScoredBatch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    on_policy: bool,
):
    """The policy's ``(loss, metrics, grads)`` on ``rows``, then the critic's if the method has one."""
    (loss, metrics), grads = jax.value_and_grad(losses.policy_loss, has_aux=True)(
        params, rows, policy=policy, algorithm=algorithm, on_policy=on_policy
    )
    if not algorithm.needs_critic:
        return ((loss, metrics, grads),)
    (value_loss, critic_metrics), critic_grads = jax.value_and_grad(losses.critic_loss, has_aux=True)(
        critic_params, rows, policy=policy, algorithm=algorithm
    )
    return (loss, metrics, grads), (value_loss, critic_metrics, critic_grads)


def minibatch_gradients(
    params,
    critic_params,
    rows: ScoredBatch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
):
    """``((loss, metrics, grads), critic)`` of one optimizer step's rows, ``critic`` the
    critic's ``(loss, metrics, grads)`` or None, over ``config.num_micro_batches`` passes
    (:func:`jaxrl_llm.training.accumulation.accumulate_gradients`; the value loss is a token mean)."""

    def value_and_grads(rows: ScoredBatch, micro_batch: jax.Array | None = None):
        return _value_and_grads(
            params,
            critic_params,
            rows,
            policy=policy if micro_batch is None else losses.fold_dropout_key(policy, micro_batch),
            algorithm=algorithm,
            on_policy=losses.is_on_policy(algorithm, config),
        )

    if config.num_micro_batches == 1:
        results = value_and_grads(rows)
    else:
        with_critic = algorithm.needs_critic
        results = accumulate_gradients(
            value_and_grads,
            micro_batches(rows, config.num_micro_batches),
            completion_mask=rows.completion_mask,
            modes=(algorithm.agg, "token-mean") if with_critic else (algorithm.agg,),
            params=(params, critic_params) if with_critic else (params,),
        )
    return results[0], (results[1] if algorithm.needs_critic else None)


class _Carry(NamedTuple):
    """What one minibatch's optimizer step changes."""

    params: models.Params
    opt_state: object
    critic_params: object
    critic_opt_state: object
    skipped: jax.Array  # [] int32: the state's skipped_updates so far


def _minibatch_step(
    carry: _Carry,
    minibatch: tuple[jax.Array, jax.Array],
    *,
    scored: ScoredBatch,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    optimizers: RunOptimizers,
) -> tuple[_Carry, Metrics]:
    """One optimizer step on ``minibatch``, ``(indices, number)``: the rows ``indices``
    ``[b]`` of ``scored`` (all of it, in order, with one minibatch), the ``number``-th step
    of the update (``[]`` int32, folded into LoRA dropout's key), policy and critic together,
    or none if not finite."""
    indices, number = minibatch
    policy = losses.fold_dropout_key(policy, number)
    params, opt_state, critic_params, critic_opt_state, skipped = carry
    rows = scored if config.num_minibatches == 1 else rows_with_own_prompts(scored, indices)
    (loss, metrics, grads), critic = minibatch_gradients(
        params, critic_params, rows, policy=policy, algorithm=algorithm, config=config
    )
    grad_norm = optax.tree.norm(grads)
    finite = (
        jnp.isfinite(loss) & jnp.isfinite(grad_norm) & update_is_finite(optimizers.policy, grads, opt_state, params)
    )
    # A minibatch of padding rows only (dynamic sampling) has a zero gradient, but an
    # AdamW step would still move the params by momentum: it takes no step.
    has_tokens = jnp.any(rows.completion_mask)
    if algorithm.needs_critic:
        value_loss, critic_metrics, critic_grads = critic
        metrics.update(critic_metrics)
        finite = (
            finite
            & jnp.isfinite(value_loss)
            & jnp.isfinite(optax.tree.norm(critic_grads))
            & (update_is_finite(optimizers.critic, critic_grads, critic_opt_state, critic_params))
        )
        # Policy and critic step together or not at all.
        critic_params, critic_opt_state = apply_update_if(
            finite & has_tokens, optimizers.critic, critic_grads, critic_opt_state, critic_params
        )
    params, opt_state = apply_update_if(finite & has_tokens, optimizers.policy, grads, opt_state, params)
    metrics.update(grad_norm=grad_norm, learning_rate=learning_rate_in(opt_state))
    skipped = skipped + (~finite).astype(jnp.int32)
    return _Carry(params, opt_state, critic_params, critic_opt_state, skipped), metrics


def _reduce(metrics: Metrics) -> Metrics:
    """Per-minibatch metrics ``[K]`` -> scalars: min of ``*_min``, max of ``*_max``, else mean."""

    def reduce(name, values):
        return (
            jnp.min(values) if name.endswith("_min") else jnp.max(values) if name.endswith("_max") else jnp.mean(values)
        )

    return {name: reduce(name, values) for name, values in metrics.items()}


def optax_update(
    state: TrainState,
    scored: ScoredBatch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    optimizers: RunOptimizers,
) -> tuple[TrainState, Metrics]:
    """``num_iterations`` passes over ``scored`` in shuffled minibatches (in order when there
    is one), one optimizer step each, in one ``lax.scan``; the metrics are their means
    (min of ``*_min``, max of ``*_max``)."""
    key, shuffle_key = jax.random.split(state.key)
    batch_size = scored.completion_tokens.shape[0]
    if config.num_minibatches == 1:  # the rows' order changes no full-batch loss: keep the groups intact
        order = jnp.broadcast_to(jnp.arange(batch_size), (algorithm.num_iterations, batch_size))  # [mu, B]
    else:
        keys = jax.random.split(shuffle_key, algorithm.num_iterations)
        permutations = jax.vmap(lambda k: jax.random.permutation(k, batch_size))(keys)  # [mu, B]
        order = permutations.reshape(algorithm.num_iterations * config.num_minibatches, -1)  # [mu * M, B / M]
    one_step = functools.partial(
        _minibatch_step, scored=scored, policy=policy, algorithm=algorithm, config=config, optimizers=optimizers
    )
    carry = _Carry(state.params, state.opt_state, state.critic_params, state.critic_opt_state, state.skipped_updates)
    carry, metrics = jax.lax.scan(one_step, carry, (order, jnp.arange(order.shape[0])))
    # A train step counts as skipped if any of its minibatch updates was.
    step_skipped = carry.skipped > state.skipped_updates
    state = state._replace(
        params=carry.params,
        opt_state=carry.opt_state,
        critic_params=carry.critic_params,
        critic_opt_state=carry.critic_opt_state,
        key=key,
        step=state.step + 1,
        skipped_updates=carry.skipped,
        consecutive_skips=jnp.where(step_skipped, state.consecutive_skips + 1, 0),
    )
    return state, _reduce(metrics)


def update(
    state: TrainState,
    fixed: FixedParams,
    scored: ScoredBatch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    optimizers: RunOptimizers,
) -> tuple[TrainState, Metrics]:
    """The state after training on ``scored``: past the rollout's key, with the batch's
    baseline and prompt count, then :func:`optax_update` or TRPO's step."""
    _check_fixed(fixed, policy, reference=False)  # the update never reads the reference
    key, _ = jax.random.split(state.key)  # the other half was the rollout's (rollout_key)
    policy = losses.over_base(policy, fixed.base, dropout_key=jax.random.fold_in(key, LORA_DROPOUT_STREAM))
    state = state._replace(key=key, baseline=scored.baseline, prompts_drawn=state.prompts_drawn + scored.prompts_drawn)
    if algorithm.update == "trpo":
        return trpo_update(state, scored, policy=policy, algorithm=algorithm)
    return optax_update(state, scored, policy=policy, algorithm=algorithm, config=config, optimizers=optimizers)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The pure halves of a train step for one (model, method, config); jit each once."""

    score: Callable[[TrainState, FixedParams, Batch], tuple[ScoredBatch, Metrics]]
    update: Callable[[TrainState, FixedParams, ScoredBatch], tuple[TrainState, Metrics]]


def make_train_step(
    model: models.Model | TeacherForcing,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    total_steps: int | None = None,
) -> TrainStep:
    """:func:`score` and :func:`update` bound to one (model, method, config).

    ``model``: the language model (:class:`jaxrl_llm.models.Model`), or any policy's
    :class:`~jaxrl_llm.training.losses.TeacherForcing` (the toy experiment's MLP).

    ``total_steps``: the run's train steps (rollout batches), counted from step 0 (a
    resumed run counts those before it). A decaying ``config.optimizer.lr_schedule`` with
    ``decay_steps=None`` ends its decay at the last optimizer step of the last of them,
    and raises ValueError without it.
    """
    check_supported(algorithm, config)
    optimizers = run_optimizers(algorithm, config, decay_steps=decay_steps_of_run(algorithm, config, total_steps))
    policy = losses.DecoderTeacherForcing(model, config) if isinstance(model, models.Model) else model
    run = dict(policy=policy, algorithm=algorithm, config=config)
    return TrainStep(
        score=functools.partial(score, **run), update=functools.partial(update, **run, optimizers=optimizers)
    )
