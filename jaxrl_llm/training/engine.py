r"""Training on the language model: rollout -> rewards -> advantages -> updates.

One training step, with the parts kept apart:

1. **rollout**: :func:`jaxrl_llm.sampling.sample` from the current params (the "old"
   policy: JAX arrays are immutable, so the snapshot is a reference, not a copy);
2. **rewards**: the task scores completions on the host;
3. **advantages**: :func:`jaxrl_llm.algorithms.sequence_advantages`;
4. **reference log-probs**: one jitted forward pass, only if the method has a KL term;
5. **updates**: ``num_iterations`` passes of one jitted, donated update step over the
   batch. With ``mu = 1`` the sampler's log-probs are the old log-probs: no extra
   forward pass is paid for them.

Log-probs are computed from hidden states in chunks (:func:`ops.chunked_token_logprobs`),
so ``[B, T, V]`` float32 logits never exist. A non-finite loss or gradient skips the
update (``optax.apply_if_finite``: params and optimizer state unchanged), counts it in
the metrics, and after ``max_consecutive_skips`` in a row the run stops with an error.

This module covers the critic-free presets; PPO's critic and TRPO's natural-gradient
step on the language model are not wired in yet and are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import _checks, advantages as adv_lib, algorithms, models, sampling
from jaxrl_llm.tasks import DigitSumTask

NEVER_GIVE_UP = 2**30  # apply_if_finite applies a non-finite update after this many skips


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of a training run (defaults: the digit task on a CPU)."""

    num_prompts: int = 8
    """P: prompts per rollout batch."""
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 4
    """N: completion budget in tokens."""
    learning_rate: float = 3e-3
    """Peak Adam learning rate (linear warm-up over ``warmup_steps``)."""
    warmup_steps: int = 5
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are of ``softmax(logits / T)``."""
    chunk_size: int = 256
    """Tokens per chunk of the log-prob computation."""
    max_consecutive_skips: int = 3
    """Stop the run after this many non-finite updates in a row."""
    seed: int = 0

    def __post_init__(self):
        for field in ("num_prompts", "group_size", "max_new_tokens", "chunk_size", "max_consecutive_skips"):
            _checks.positive_int("TrainConfig", field, getattr(self, field))
        _checks.positive("TrainConfig", "learning_rate", self.learning_rate)


class TrainState(NamedTuple):
    """Everything a run carries between steps; a pytree (checkpointable, shardable)."""

    params: models.Params
    opt_state: Any
    ref_params: models.Params
    baseline: adv_lib.RunningMeanState
    step: jax.Array  # [] int32: updates applied or skipped


class Batch(NamedTuple):
    """One rollout batch as the update step consumes it; ``B = P * G``."""

    tokens: jax.Array  # [B, S + N] int32
    attention_mask: jax.Array  # [B, S + N] bool
    completion_mask: jax.Array  # [B, N] bool
    old_logp: jax.Array  # [B, N] float32, log pi_old
    advantages: jax.Array  # [B] float32
    ref_logp: jax.Array | None  # [B, N] float32 or None


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clip, AdamW with a warm-up schedule, and skip any non-finite update."""
    # Warm-up from lr / warmup_steps (not 0: the first update would otherwise do nothing).
    warmup = max(config.warmup_steps, 1)
    schedule = optax.linear_schedule(config.learning_rate / warmup, config.learning_rate, warmup - 1)
    inner = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adamw(schedule, weight_decay=0.0))
    return optax.apply_if_finite(inner, max_consecutive_errors=NEVER_GIVE_UP)


def make_update_step(model: models.Model, algorithm: algorithms.Algorithm, optimizer: optax.GradientTransformation,
                     config: TrainConfig):
    """The pure update ``(state, batch) -> (state, metrics)``; jit it once per run."""
    completion_len = config.max_new_tokens

    def loss_fn(params, batch: Batch):
        logp = models.completion_logprobs(model, params, batch.tokens, batch.attention_mask, completion_len,
                                          chunk_size=config.chunk_size, temperature=config.temperature)
        return algorithms.policy_loss(algorithm, logp, batch.old_logp, batch.advantages, batch.completion_mask,
                                      ref_logp=batch.ref_logp, max_len=completion_len)

    def update(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        # A non-finite loss poisons the gradients so that apply_if_finite skips it too.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics.update(
            grad_norm=optax.tree.norm(grads),
            skipped_updates=opt_state.total_notfinite,
            consecutive_skips=opt_state.notfinite_count,
        )
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return update


def _supported(algorithm: algorithms.Algorithm) -> None:
    if algorithm.needs_critic or algorithm.update == "trpo" or algorithm.kl_reward_coef > 0:
        raise ValueError(
            f"Algorithm {algorithm.name!r} needs a critic, a natural-gradient step or a KL penalty in the reward, "
            "which the language-model trainer does not support yet; supported here: "
            "pg, reinforce-baseline, rloo, grpo, dr-grpo, dapo, gspo, cispo (and REINFORCE_PP with kl_reward_coef=0)."
        )


def init_state(model: models.Model, params: models.Params, optimizer: optax.GradientTransformation) -> TrainState:
    # The update step donates the state, so the state owns its buffers: the caller's
    # params stay valid, and the reference (the initial policy) is a separate copy.
    return TrainState(
        params=jax.tree.map(jnp.copy, params),
        opt_state=optimizer.init(params),
        ref_params=jax.tree.map(jnp.copy, params),
        baseline=adv_lib.running_mean_init(),
        step=jnp.zeros((), jnp.int32),
    )


def train(
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    steps: int,
    task: DigitSumTask | None = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Runs ``steps`` training steps of ``algorithm`` on ``task``; returns the final state
    and one dict of metrics per step (rewards, advantages, loss diagnostics, timings)."""
    _supported(algorithm)
    task = task or DigitSumTask()
    optimizer = make_optimizer(config)
    state = init_state(model, params, optimizer)
    update = jax.jit(make_update_step(model, algorithm, optimizer, config), donate_argnums=0)
    reference = jax.jit(lambda p, tokens, mask: models.completion_logprobs(
        model, p, tokens, mask, config.max_new_tokens, chunk_size=config.chunk_size, temperature=config.temperature))
    sampler = sampling.Sampler(model=model, eos_ids=(task.eos_id,), pad_id=task.pad_id,
                               temperature=config.temperature)
    rng = np.random.default_rng(config.seed)
    key = jax.random.key(config.seed)
    history = []
    for _ in range(steps):
        started = time.perf_counter()
        key, rollout_key = jax.random.split(key)
        prompt_ids, prompt_mask, answers = task.prompts(rng, config.num_prompts)
        rollout = sampler(state.params, prompt_ids, prompt_mask, rollout_key, num_samples=config.group_size,
                          max_new_tokens=config.max_new_tokens)
        completion = np.asarray(rollout.completion_tokens)
        lengths = np.asarray(rollout.lengths)
        rollout_s = time.perf_counter() - started

        rewards = task.rewards(completion, lengths, np.repeat(answers, config.group_size))  # [B]
        task_rewards = rewards
        # DAPO's soft overlong zone: at most a fifth of the budget (the paper's 4096 of
        # 20480); a budget under 5 tokens has no room for one, and gets no shaping.
        buffer = min(algorithm.overlong_buffer, config.max_new_tokens // 5)
        if buffer:
            rewards = rewards + np.asarray(algorithms.overlong_penalty(
                lengths, max_len=config.max_new_tokens, buffer=buffer, penalty=algorithm.overlong_penalty))
        grouped = rewards.reshape(config.num_prompts, config.group_size)
        advantages, baseline = algorithms.sequence_advantages(algorithm, jnp.asarray(grouped), state.baseline)
        completion_mask = rollout.completion_mask
        if algorithm.dynamic_sampling:  # groups with identical rewards carry no signal
            informative = np.repeat(grouped.max(1) > grouped.min(1), config.group_size)
            completion_mask = completion_mask & jnp.asarray(informative)[:, None]
        state = state._replace(baseline=baseline)

        ref_logp = reference(state.ref_params, rollout.tokens, rollout.attention_mask) if algorithm.needs_reference \
            else None
        batch = Batch(tokens=rollout.tokens, attention_mask=rollout.attention_mask, completion_mask=completion_mask,
                      old_logp=rollout.logprobs, advantages=advantages, ref_logp=ref_logp)
        update_started = time.perf_counter()
        for _ in range(algorithm.num_iterations):
            state, metrics = update(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if metrics["consecutive_skips"] >= config.max_consecutive_skips:
            raise FloatingPointError(
                f"Stopping: {int(metrics['consecutive_skips'])} consecutive updates had a non-finite loss or "
                f"gradient (max_consecutive_skips={config.max_consecutive_skips}); params are those of the last "
                "finite update."
            )
        now = time.perf_counter()
        metrics.update(
            reward=float(task_rewards.mean()), reward_std=float(task_rewards.std()),
            advantage_mean=float(np.mean(advantages)), advantage_std=float(np.std(advantages)),
            completion_length=float(lengths.mean()), truncated_fraction=float(np.mean(rollout.truncated)),
            identical_reward_groups=float(np.mean(grouped.max(1) == grouped.min(1))),
            rollout_seconds=rollout_s, update_seconds=now - update_started, step_seconds=now - started,
        )
        history.append(metrics)
    assert update._cache_size() == 1, "the update step must trace once per run"
    return state, history
