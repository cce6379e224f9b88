r"""One train step's rollouts: a batch of ``P`` groups of ``G`` scored completions from the
task's train stream, with DAPO's dynamic sampling.

Each round of prompts goes through the run's :class:`jaxrl_llm.rollouts.RolloutStrategy`, the
path from prompts to rewards that the evaluator takes too: single-turn completions
(prompt widths, stop strings, decoding, reward functions: see :mod:`jaxrl_llm.rollouts`),
or multi-turn episodes in runs with tools or environments.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxrl_llm import algorithms, models, rewards, sampling, tasks
from jaxrl_llm.rollouts import Completions, Rollouts, RolloutStrategy, ScoredRound
from jaxrl_llm.training.config import TrainConfig


@dataclasses.dataclass
class CollectedBatch:
    """What :func:`collect_batch` returns."""

    rollouts: Rollouts
    """The batch to train on: ``P`` groups (groups without signal masked out, with dynamic sampling)."""
    first_round: ScoredRound
    """The first rollout round, unfiltered: the policy's own statistics."""
    refill_rounds: int
    """Extra rounds drawn by dynamic sampling."""
    prompts_drawn: int
    """Prompts taken from the task's stream over all rounds."""
    sampled_tokens: int
    """Completion tokens generated over all rounds."""
    reward_seconds: float
    """Host time spent decoding and in reward functions."""
    truncated_prompts: int
    """Prompts that lost their first tokens, over all rounds."""
    reward_errors: int
    """Completions scored 0 because a reward function raised (``on_reward_error="zero"``)."""


def collect_batch(
    backend: sampling.RolloutBackend,
    params: models.Params,
    task: tasks.Task,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    key: jax.Array,
    position: int,
    prompt_bucket: int = 8,
    strategy: RolloutStrategy | None = None,
    trainer_state: rewards.TrainerState | None = None,
) -> CollectedBatch:
    """Rollouts and rewards for one train step, from the task's train stream at ``position``
    (``trainer_state``: what the reward functions are told of the run).

    Without dynamic sampling: one round of ``P`` prompts times ``G`` completions. With it
    (DAPO): groups whose task rewards are all equal (all right or all wrong; the overlong
    shaping does not count, as in DAPO's and verl's accuracy filter) are dropped and rounds of
    ``P`` new prompts are drawn until ``P`` groups with signal are collected or ``config.max_refill_rounds``
    extra rounds are spent; the batch is the first ``P`` groups with signal, then groups
    without it with an all-zero completion mask (padding rows: they change no loss).
    DAPO's soft overlong punishment (:func:`jaxrl_llm.rewards.soft_overlong_punishment`)
    is added to the rewards the advantages see. ``strategy`` makes the rollouts: single-turn
    completions (:class:`jaxrl_llm.rollouts.Completions`) when ``None``, multi-turn episodes
    with :class:`jaxrl_llm.episodes.scoring.Episodic`.
    """
    settings = config.sampling
    strategy = Completions() if strategy is None else strategy
    algorithm = fit_overlong_buffer(algorithm, settings.max_new_tokens)
    shaping = None
    if algorithm.overlong_buffer:
        shaping = functools.partial(
            rewards.soft_overlong_punishment,
            max_completion_length=settings.max_new_tokens,
            buffer=algorithm.overlong_buffer,
            penalty=algorithm.overlong_penalty,
        )
    num_prompts, group = config.num_prompts, config.group_size
    rounds: list[ScoredRound] = []
    informative = np.zeros(0, bool)  # [groups so far]
    max_rounds = 1 + (config.max_refill_rounds if algorithm.dynamic_sampling else 0)
    for round_index in range(max_rounds):
        batch = tasks.base.draw(
            task, "train", seed=config.seed, start=position + round_index * num_prompts, count=num_prompts
        )
        scored = strategy.score(
            backend,
            params,
            task,
            batch,
            jax.random.fold_in(key, round_index),
            num_samples=group,
            sampling_config=settings,
            prompt_bucket=prompt_bucket,
            on_reward_error=config.on_reward_error,
            shaping=shaping,
            trainer_state=trainer_state,
        )
        rounds.append(scored)
        grouped = scored.result.total.reshape(num_prompts, group)  # the task's rewards: shaping is no signal
        informative = np.concatenate([informative, grouped.max(1) > grouped.min(1)])
        if not algorithm.dynamic_sampling or informative.sum() >= num_prompts:
            break
    rollouts = rounds[0].rollouts
    if algorithm.dynamic_sampling:
        rollouts = Rollouts.concatenate([r.rollouts for r in rounds], task.pad_id)
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:num_prompts]
        rollouts = rollouts.take_groups(order)
        rollouts.completion_mask = rollouts.completion_mask & np.repeat(informative[order], group)[:, None]
    return CollectedBatch(
        rollouts=rollouts,
        first_round=rounds[0],
        refill_rounds=len(rounds) - 1,
        prompts_drawn=len(rounds) * num_prompts,
        sampled_tokens=int(sum(r.rollouts.lengths.sum() for r in rounds)),
        reward_seconds=sum(r.reward_seconds for r in rounds),
        truncated_prompts=sum(r.truncated_prompts for r in rounds),
        reward_errors=sum(sum(r.result.errors.values()) for r in rounds),
    )


def fit_overlong_buffer(algorithm: algorithms.Algorithm, max_new_tokens: int) -> algorithms.Algorithm:
    """DAPO's soft overlong zone for a budget of ``max_new_tokens``: a buffer within the
    budget is kept as set; a longer one (the preset's 4096, the paper's fifth of 20480
    tokens) becomes a fifth of the budget, none under 5 tokens."""
    if algorithm.overlong_buffer <= max_new_tokens:
        return algorithm
    return dataclasses.replace(algorithm, overlong_buffer=max_new_tokens // 5)
