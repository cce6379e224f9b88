"""From a task's prompts to scored episodes (:func:`score_episodes`): the multi-turn
counterpart of :func:`jaxrl_llm.rollouts.rollout_and_score`, and the rollout strategy a
run with tools or environments takes (:class:`Episodic`, chosen by :func:`rollout_strategy`).

Reward functions are called as TRL calls them in a multi-turn run: ``prompts`` are each
row's prompt messages (an environment's observation appended), ``completions`` each
row's messages after it (the model's, with their ``tool_calls``, and the tools'),
``completion_ids`` its ids (tool results included), the example's columns, and
``environments`` (each row's instance) when the run has environments. An environment
class with ``get_reward`` adds a reward function under its name, weight 1.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxrl_llm import models, rewards, rollouts, sampling, sharding, tasks
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.episodes.environments import Environments
from jaxrl_llm.episodes.sampling import Episodes, sample_episodes
from jaxrl_llm.episodes.tools import check_tools
from jaxrl_llm.rollouts import Rollouts, ScoredRound, rewards_by_process


@dataclasses.dataclass(frozen=True)
class Toolset:
    """What a run's episodes may call: standalone tools and environments (TRL's ``tools``
    and ``environment_factory``)."""

    tools: tuple[Callable, ...] = ()
    environments: Environments | None = None

    @classmethod
    def build(
        cls,
        task: tasks.Task,
        *,
        tools: Sequence[Callable] | None = None,
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | Environments | None = None,
    ) -> Toolset | None:
        """The toolset of ``task``'s own ``tools`` (if it has any), ``tools`` and
        ``environment_factory`` (checked; built :class:`Environments` are taken as they
        are, their pool shared), or ``None`` when there is none of them: a single-turn run."""
        tools = (*getattr(task, "tools", ()), *(tools or ()))
        tools = check_tools(list(dict.fromkeys(tools)), where="tools")  # one function given twice is one tool
        if environment_factory is None:
            return cls(tools=tools) if tools else None
        if isinstance(environment_factory, Environments):
            return cls(tools=environment_factory.tools, environments=environment_factory)
        return cls(tools=tools, environments=Environments(environment_factory, tools=tools))

    def reward_functions(self) -> list[Callable]:
        """The environments' ``get_reward`` as reward functions (weight 1 each)."""
        return [] if self.environments is None else self.environments.reward_functions()


@dataclasses.dataclass(frozen=True)
class Episodic:
    """Multi-turn rollouts: episodes with ``toolset``'s tools and environments, limited by
    ``config`` (:func:`score_episodes`; the :class:`jaxrl_llm.rollouts.RolloutStrategy` of a
    run with tools or environments)."""

    toolset: Toolset
    config: EpisodeConfig = EpisodeConfig()

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
        return score_episodes(
            backend,
            params,
            task,
            batch,
            key,
            toolset=self.toolset,
            config=self.config,
            num_samples=num_samples,
            max_new_tokens=sampling_config.max_new_tokens,
            prompt_bucket=prompt_bucket,
            on_reward_error=on_reward_error,
            shaping=shaping,
            trainer_state=trainer_state,
        )

    def reward_functions(self) -> list[Callable]:
        return self.toolset.reward_functions()

    @property
    def gives_prompts(self) -> bool:
        return self.toolset.environments is not None

    takes_custom_rollout = False  # episodes run on the built-in sampler


def rollout_strategy(
    task: tasks.Task,
    *,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | Environments | None = None,
    episodes: EpisodeConfig | None = None,
) -> rollouts.RolloutStrategy:
    """The rollouts of a run or an evaluation, chosen once: episodes (:class:`Episodic`,
    limited by ``episodes``, default ``EpisodeConfig()``) when ``task`` has tools or
    ``tools`` or ``environment_factory`` are given (:meth:`Toolset.build`), else single-turn
    completions (:class:`jaxrl_llm.rollouts.Completions`)."""
    toolset = Toolset.build(task, tools=tools, environment_factory=environment_factory)
    if toolset is None:
        return rollouts.Completions()
    return Episodic(toolset, EpisodeConfig() if episodes is None else episodes)


def _conversational(batch: tasks.PromptBatch) -> list:
    if bad := [i for i, p in enumerate(batch.prompts) if isinstance(p, str)]:
        raise ValueError(
            f"Tools and environments need conversational prompts (lists of messages, rendered by the tokenizer's "
            f"chat template with the tools' schemas); example {int(batch.indices[bad[0]])}'s prompt is a string. "
            f"Give the task a `prompt` of messages, e.g. [{{'role': 'user', 'content': ...}}]."
        )
    return list(batch.prompts)


def _row_mesh(mesh: jax.sharding.Mesh | None, num_prompts: int) -> jax.sharding.Mesh | None:
    """The sampler's mesh when the prompts split evenly over its ``data`` devices, else
    ``None`` (one device: an evaluation batch that does not split). Episodes run in one
    process: a mesh over several is not used for them."""
    if mesh is None or mesh.is_multi_process or num_prompts % sharding.data_size(mesh):
        return None
    return mesh


def score_episodes(
    sampler: sampling.Sampler,
    params: models.Params,
    task: tasks.Task,
    batch: tasks.PromptBatch,
    key: jax.Array,
    *,
    toolset: Toolset,
    config: EpisodeConfig,
    num_samples: int,
    max_new_tokens: int,
    prompt_bucket: int = 8,
    on_reward_error: str = "raise",
    shaping: Any = None,
    trainer_state: rewards.TrainerState | None = None,
) -> ScoredRound:
    """Runs ``G = num_samples`` episodes of each prompt of ``batch`` and scores them.

    ``sampler`` gives the model, the stop ids, the sampling settings (its ``sampling``,
    with ``max_new_tokens``, the episode's token budget) and the mesh the rows are split
    over (its ``mesh``, when the prompts split evenly over its ``data`` devices; else
    one device decodes them, as for an evaluation batch that does not); ``shaping`` is added to the
    rewards as in :func:`jaxrl_llm.rollouts.rollout_and_score`. The returned round's
    rollouts are the episodes (completion mask: the model's tokens; ``lengths``: the
    model's tokens, as TRL counts them), its ``completions`` each episode's text and its
    ``episode_metrics`` :func:`episode_metrics`.
    """
    if not isinstance(sampler, sampling.Sampler):
        raise TypeError(
            "Episodes need the built-in sampler (they continue its KV cache across turns); "
            f"got {type(sampler).__name__}."
        )
    episodes = sample_episodes(
        sampler.model,
        params,
        task.tokenizer,
        _conversational(batch),
        key,
        num_samples=num_samples,
        eos_ids=sampler.eos_ids,
        pad_id=sampler.pad_id,
        sampling_config=dataclasses.replace(sampler.sampling, max_new_tokens=max_new_tokens),
        tools=toolset.tools,
        environments=toolset.environments,
        columns=batch.columns,
        config=config,
        prompt_bucket=prompt_bucket,
        mesh=_row_mesh(sampler.mesh, len(batch.prompts)),
    )
    started = time.perf_counter()
    columns = {
        name: [copy.deepcopy(v) for v in values for _ in range(num_samples)] for name, values in batch.columns.items()
    }
    if episodes.environments is not None:
        columns["environments"] = episodes.environments
    arguments = dict(
        prompts=copy.deepcopy(episodes.prompts),
        completions=copy.deepcopy(episodes.completions),
        completion_ids=episodes.completion_ids,
        columns=columns,
    )
    reward_fns = (*task.reward_fns, *toolset.reward_functions())
    weights = (*task.reward_weights, *[1.0] * (len(reward_fns) - len(task.reward_fns)))
    result = rewards_by_process(reward_fns, weights, on_error=on_reward_error, trainer_state=trainer_state, **arguments)
    total = result.total
    if shaping is not None:
        total = total + rewards_by_process([shaping], [1.0], trainer_state=trainer_state, **arguments).total
    texts = [task.tokenizer.decode(ids, skip_special_tokens=False) for ids in episodes.completion_ids]
    return ScoredRound(
        prompts=list(batch.prompts),
        rollouts=Rollouts(
            prompt_tokens=episodes.prompt_tokens,
            prompt_mask=episodes.prompt_mask,
            completion_tokens=episodes.completion_tokens,
            completion_mask=episodes.completion_mask,
            logprobs=episodes.logprobs,
            lengths=episodes.model_tokens,
            truncated=episodes.truncated,
            rewards=total,
        ),
        result=result,
        completions=texts,
        truncated_prompts=0,
        reward_seconds=time.perf_counter() - started,
        episode_metrics=episode_metrics(episodes),
        messages=episodes.completions,
        row_prompts=episodes.prompts,
    )


def episode_metrics(episodes: Episodes) -> dict[str, float]:
    """A batch of episodes' statistics: turns, tool calls (TRL's ``tools/call_frequency``,
    calls per episode, and ``tools/failure_frequency``, failed calls per call), the
    model's tokens, the tool results' (with the template's ids around them) and the
    openings' (the rows' rests of their prompts: an environment's observation), and the
    episodes the limits ended."""
    calls = int(episodes.tool_calls.sum())
    return {
        "episodes/turns": float(episodes.turns.mean()),
        "episodes/model_tokens": float(episodes.model_tokens.mean()),
        "episodes/tool_tokens": float(episodes.tool_tokens.mean()),
        "episodes/opening_tokens": float(episodes.openings.mean()),
        "episodes/truncated": float(episodes.truncated.mean()),
        "episodes/turn_limited": float(episodes.turn_limited.mean()),
        "tools/call_frequency": float(episodes.tool_calls.mean()),
        "tools/failure_frequency": float(episodes.tool_failures.sum() / calls) if calls else 0.0,
        "tools/timeouts": float(episodes.tool_timeouts.sum()),
    }
