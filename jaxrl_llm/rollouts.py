r"""From a task's prompts to scored rollouts: fit the prompts, sample, stop, decode, reward.

:func:`rollout_and_score` is the one path from a :class:`~jaxrl_llm.tasks.PromptBatch` to
rewards; the trainer (:func:`jaxrl_llm.training.collect.collect_batch`, with DAPO's
dynamic sampling) and the evaluator (:func:`jaxrl_llm.evaluation.evaluate`) both call it.
It sits below both: it knows tasks, rewards and the rollout backend, not the trainer.

**Prompt widths.** Prompts are left-padded to a width from a small, bounded set, so the
jitted halves of the train step trace once per width, not once per step: the smallest
``bucket * 2^k`` that holds the batch's longest prompt, capped at ``max_length``. With
``bucket = 8`` and ``max_length = 512`` that is at most 7 widths (8, 16, ..., 512) for a
whole run. A prompt longer than ``max_length`` is an error, or with
``truncation="left"`` loses its first tokens (counted in the ``truncated_prompts`` metric).

**Completions** are decoded once per batch: the valid tokens (up to and including the
first stop id) without a final stop id, with the tokenizer's ``skip_special_tokens=True``
(TRL's convention). ``completion_ids`` keep the stop id, as TRL's do. When the prompts
are conversations (lists of messages), the completions are too, as TRL passes them:
``[{"role": "assistant", "content": text}]``. Each row gets its own copy of its prompt
and columns, so a reward function that mutates them changes no other row.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxrl_llm import distributed, models, rewards, sampling, tasks
from jaxrl_llm.sampling import PROMPT_TRUNCATION


def prompt_width(length: int, *, bucket: int, max_length: int) -> int:
    """The padded width of prompts whose longest has ``length`` tokens (see the module doc)."""
    width = bucket
    while width < length:
        width *= 2
    return min(width, max(max_length, length))


def fit_prompts(
    batch: tasks.PromptBatch, *, max_length: int, truncation: str = "error", bucket: int = 8, pad_id: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``batch``'s prompts left-padded (or left-truncated) to their bucket's width.

    Returns:
      ``tokens`` ``[P, W]`` int32, ``mask`` ``[P, W]`` bool and the number of prompts
      truncated.

    Raises:
      ValueError: a prompt is longer than ``max_length`` and ``truncation="error"``.
    """
    if truncation not in PROMPT_TRUNCATION:
        raise ValueError(f"`prompt_truncation` must be one of {PROMPT_TRUNCATION}; got {truncation!r}.")
    lengths = batch.mask.sum(axis=1)  # [P]
    too_long = lengths > max_length
    tokens, mask = batch.tokens, batch.mask
    if too_long.any():
        if truncation == "error":
            row = int(np.argmax(lengths))
            raise ValueError(
                f"Prompt of example {int(batch.indices[row])} has {int(lengths[row])} tokens, more than "
                f"max_prompt_length={max_length} ({int(too_long.sum())} of {len(batch)} prompts in this batch are). "
                f"Raise max_prompt_length, shorten the prompts, or set prompt_truncation='left' to drop their "
                f"first tokens."
            )
        tokens, mask = tokens[:, -max_length:], mask[:, -max_length:]  # left-padded: the ends are the prompts'
    width = prompt_width(int(mask.sum(axis=1).max()), bucket=bucket, max_length=max_length)
    extra = width - tokens.shape[1]
    if extra > 0:
        tokens = np.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
        mask = np.pad(mask, ((0, 0), (extra, 0)))
    elif extra < 0:  # the task padded wider than its longest prompt
        tokens, mask = tokens[:, -width:], mask[:, -width:]
    return tokens.astype(np.int32), mask.astype(bool), int(too_long.sum())


def decode_completions(
    tokenizer, completion_tokens: np.ndarray, lengths: np.ndarray, *, eos_ids: Sequence[int]
) -> tuple[list[str], list[list[int]]]:
    """``(completions, completion_ids)``: each row's text without its final stop id, and
    its valid ids (the stop id kept). ``completion_tokens`` ``[B, N]``, ``lengths`` ``[B]``."""
    ids = [row[:length].tolist() for row, length in zip(completion_tokens, lengths, strict=True)]
    stops = set(int(e) for e in eos_ids)
    text_ids = [row[:-1] if row and row[-1] in stops else row for row in ids]
    return tokenizer.batch_decode(text_ids, skip_special_tokens=True), ids


@dataclasses.dataclass
class Rollouts:
    """Host copies of rollouts with their rewards: ``P`` prompts, each once, and their
    ``R = P * G`` completions (prompt ``p``'s rows ``p G ... p G + G - 1``)."""

    prompt_tokens: np.ndarray  # [P, S] int32, left-padded
    prompt_mask: np.ndarray  # [P, S] bool
    completion_tokens: np.ndarray  # [R, N] int32
    completion_mask: np.ndarray  # [R, N] bool: the tokens that enter the loss
    logprobs: np.ndarray  # [R, N] float32
    lengths: np.ndarray  # [R] int32
    truncated: np.ndarray  # [R] bool: hit the budget without a stop
    rewards: np.ndarray  # [R] float32: what the advantages see (the task's, plus shaping)

    _ROW_FIELDS = ("completion_tokens", "completion_mask", "logprobs", "lengths", "truncated", "rewards")

    def take_groups(self, groups: np.ndarray) -> Rollouts:
        """Prompts ``groups`` ``[g]`` with their completions, in that order."""
        group = len(self.rewards) // len(self.prompt_tokens)
        rows = (np.asarray(groups)[:, None] * group + np.arange(group)).reshape(-1)
        return Rollouts(
            prompt_tokens=self.prompt_tokens[groups],
            prompt_mask=self.prompt_mask[groups],
            **{name: getattr(self, name)[rows] for name in self._ROW_FIELDS},
        )

    @staticmethod
    def concatenate(parts: list[Rollouts], pad_id: int) -> Rollouts:
        width = max(p.prompt_tokens.shape[1] for p in parts)  # prompt widths can differ between rounds

        def left_pad(x, value):
            return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)

        return Rollouts(
            prompt_tokens=np.concatenate([left_pad(p.prompt_tokens, pad_id) for p in parts]),
            prompt_mask=np.concatenate([left_pad(p.prompt_mask, False) for p in parts]),
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in Rollouts._ROW_FIELDS},
        )


@dataclasses.dataclass
class ScoredRound:
    """What :func:`rollout_and_score` returns for one batch of prompts."""

    prompts: list  # [P] the prompts as given to the reward functions (text or chat messages)
    rollouts: Rollouts  # rewards: the task's weighted sum plus `shaping`; prompt p's G rows adjacent
    result: rewards.RewardResult  # each function's values, the task's weighted sum, errors
    completions: list[str]  # [R] decoded
    truncated_prompts: int  # prompts that lost their first tokens
    reward_seconds: float  # host time in decoding and reward functions
    episode_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # multi-turn runs' statistics
    messages: list[list[dict]] | None = None  # [R] episodes' completions as TRL's message lists (None: single-turn)
    row_prompts: list | None = None  # [R] episodes' own prompts, an environment's observation appended


def rollout_and_score(
    backend: sampling.RolloutBackend,
    params: models.Params,
    task: tasks.Task,
    batch: tasks.PromptBatch,
    key: jax.Array,
    *,
    num_samples: int,
    max_new_tokens: int,
    max_prompt_length: int,
    prompt_truncation: str = "error",
    prompt_bucket: int = 8,
    on_reward_error: str = "raise",
    shaping: Any = None,
    trainer_state: rewards.TrainerState | None = None,
) -> ScoredRound:
    """Samples ``G = num_samples`` completions of each prompt of ``batch`` and scores them.

    ``shaping``, when given, is a reward function (TRL's convention) whose values are
    added to the task's rewards but not logged among them: DAPO's overlong punishment.
    ``trainer_state`` is passed to the reward functions.
    """
    tokens, mask, truncated_prompts = fit_prompts(
        batch, max_length=max_prompt_length, truncation=prompt_truncation, bucket=prompt_bucket, pad_id=task.pad_id
    )
    rollout = backend(params, tokens, mask, key, num_samples=num_samples, max_new_tokens=max_new_tokens)
    n = rollout.completion_mask.shape[1]
    # Only the completions come to the host (every process's: they are small), the prompts
    # are here already, once each.
    host = distributed.gather(
        rollout._replace(tokens=rollout.tokens[:, -n:], attention_mask=rollout.attention_mask[:, -n:])
    )
    if task.stop_strings:
        host = sampling.stop_at_strings(
            host, tokenizer=task.tokenizer, stop_strings=task.stop_strings, pad_id=task.pad_id
        )
    started = time.perf_counter()
    texts, completion_ids = decode_completions(task.tokenizer, host.tokens, host.lengths, eos_ids=task.eos_ids)
    completions = texts
    if any(not isinstance(p, str) for p in batch.prompts):  # TRL's conversational format: messages in, messages out
        completions = [[{"role": "assistant", "content": text}] for text in texts]
    arguments = dict(
        prompts=[copy.deepcopy(p) for p in batch.prompts for _ in range(num_samples)],
        completions=completions,
        completion_ids=completion_ids,
        columns={
            name: [copy.deepcopy(v) for v in values for _ in range(num_samples)]  # a function may mutate its
            for name, values in batch.columns.items()
        },
    )
    result = rewards_by_process(
        task.reward_fns, task.reward_weights, on_error=on_reward_error, trainer_state=trainer_state, **arguments
    )
    total = result.total
    if shaping is not None:
        total = total + rewards_by_process([shaping], [1.0], trainer_state=trainer_state, **arguments).total
    reward_seconds = time.perf_counter() - started
    return ScoredRound(
        prompts=list(batch.prompts),
        rollouts=Rollouts(
            prompt_tokens=tokens,
            prompt_mask=mask,
            completion_tokens=host.tokens,
            completion_mask=host.completion_mask,
            logprobs=host.logprobs,
            lengths=host.lengths,
            truncated=host.truncated,
            rewards=total,
        ),
        result=result,
        completions=texts,
        truncated_prompts=truncated_prompts,
        reward_seconds=reward_seconds,
    )


class RolloutStrategy(Protocol):
    """How a batch of prompts becomes a :class:`ScoredRound`: :class:`Completions`
    (single-turn) or :class:`jaxrl_llm.episodes.scoring.Episodic` (multi-turn episodes with
    tools or environments). ``train`` and ``evaluate`` choose one, once
    (:func:`jaxrl_llm.episodes.scoring.rollout_strategy`); the trainer's collector and the
    evaluator call its ``score``."""

    def score(
        self,
        backend: sampling.RolloutBackend,
        params: models.Params,
        task: tasks.Task,
        batch: tasks.PromptBatch,
        key: jax.Array,
        *,
        num_samples: int,
        sampling_config: sampling.SamplingConfig,
        prompt_bucket: int = 8,
        on_reward_error: str = "raise",
        shaping: Any = None,
        trainer_state: rewards.TrainerState | None = None,
    ) -> ScoredRound:
        """``G = num_samples`` scored rollouts of each prompt of ``batch``: the completion
        budget and the prompt settings from ``sampling_config``, the rest as in
        :func:`rollout_and_score`."""
        ...

    def reward_functions(self) -> list[Callable]:
        """Reward functions the strategy adds to the task's (weight 1 each)."""
        ...

    @property
    def gives_prompts(self) -> bool:
        """Whether the strategy's own environments give the prompts (a task whose prompts
        only an environment gives, ``environment_prompts``, needs one that does)."""
        ...

    @property
    def takes_custom_rollout(self) -> bool:
        """Whether ``train(..., rollout=...)`` may replace the built-in sampler for it."""
        ...


@dataclasses.dataclass(frozen=True)
class Completions:
    """Single-turn rollouts: one completion per sample (:func:`rollout_and_score`)."""

    def score(
        self,
        backend: sampling.RolloutBackend,
        params: models.Params,
        task: tasks.Task,
        batch: tasks.PromptBatch,
        key: jax.Array,
        *,
        num_samples: int,
        sampling_config: sampling.SamplingConfig,
        prompt_bucket: int = 8,
        on_reward_error: str = "raise",
        shaping: Any = None,
        trainer_state: rewards.TrainerState | None = None,
    ) -> ScoredRound:
        return rollout_and_score(
            backend,
            params,
            task,
            batch,
            key,
            num_samples=num_samples,
            max_new_tokens=sampling_config.max_new_tokens,
            max_prompt_length=sampling_config.max_prompt_length,
            prompt_truncation=sampling_config.prompt_truncation,
            prompt_bucket=prompt_bucket,
            on_reward_error=on_reward_error,
            shaping=shaping,
            trainer_state=trainer_state,
        )

    def reward_functions(self) -> list[Callable]:
        return []

    gives_prompts = False
    takes_custom_rollout = True


def rewards_by_process(
    reward_fns, weights, *, on_error: str = "raise", trainer_state: rewards.TrainerState | None = None, **arguments
) -> rewards.RewardResult:
    """:func:`jaxrl_llm.rewards.compute_rewards` of every row, each process of a
    multi-process run calling the reward functions on its share of the rows only (the
    ``i``-th of ``jax.process_count()`` equal blocks), every process getting all of them
    but what the functions log (``logged``, ``extra``), which stays with its process.

    A reward function that raises on one process stops every process, with the original
    error where it happened: the others would otherwise wait for it in their next
    collective. One process: ``compute_rewards`` itself.
    """
    if jax.process_count() == 1:
        return rewards.compute_rewards(reward_fns, weights, on_error=on_error, trainer_state=trainer_state, **arguments)
    num_rows = len(arguments["completions"])
    rows = np.array_split(np.arange(num_rows), jax.process_count())[jax.process_index()]

    def mine(values):
        return [values[row] for row in rows]

    local = dict(
        prompts=mine(arguments["prompts"]),
        completions=mine(arguments["completions"]),
        completion_ids=mine(arguments["completion_ids"]),
        columns={name: mine(values) for name, values in arguments["columns"].items()},
    )
    failure = None
    try:
        result = rewards.compute_rewards(
            reward_fns,
            weights,
            on_error=on_error,
            first_row=int(rows[0]) if len(rows) else 0,
            trainer_state=trainer_state,
            **local,
        )
    except Exception as error:  # noqa: BLE001 (raised again below, on every process)
        failure, result = error, None
    if distributed.process_sum(np.int32(failure is not None)):
        if failure is not None:
            raise failure
        raise rewards.RewardFunctionError(
            "A reward function failed on another process of the run (its log has the error); stopping every process."
        )
    names = rewards.combine.reward_names(reward_fns)

    def everyone(values):  # [b] here -> [B] from every process's block
        whole = np.zeros(num_rows, np.float32)
        whole[rows] = values
        return whole

    totals = distributed.process_sum(
        {
            "total": everyone(result.total),
            **{name: everyone(result.values[name]) for name in names},
            **{f"errors/{name}": np.int32(result.errors.get(name, 0)) for name in names},
        }
    )
    return rewards.RewardResult(
        total=totals["total"],
        values={name: totals[name] for name in names},
        errors={name: int(totals[f"errors/{name}"]) for name in names if totals[f"errors/{name}"]},
        logged=result.logged,
    )
