r"""The host loop: rollout -> rewards -> score -> update, with metrics and timings.

.. code-block:: python

    state, history = training.train(model, params, algorithms.GRPO, training.TrainConfig(), steps=100)

Each step:

1. **rollout**: the sampler draws ``G`` completions for each of ``P`` prompts from the
   current params (the old policy; a snapshot is free, arrays are immutable);
2. **rewards**: the task's reward functions run on the host; each must return ``[B]``
   numbers. DAPO's soft overlong penalty is added here. With dynamic sampling (DAPO) the
   groups whose rewards are all equal are dropped and more rollouts refill the batch,
   up to ``max_refill_rounds`` extra rounds; groups still missing are masked out;
3. **score** and **update**: the two jitted halves of :mod:`jaxrl_llm.training.step`.

Prompts are left-padded to a multiple of ``prompt_bucket`` tokens, so both halves trace
once per prompt width: once per run when the task's prompts fit one bucket (the digit
task's do). ``history[i]["score_traces"]`` and ``["update_traces"]`` count the traces.
The prompt stream is seeded by ``(seed, step)`` and every PRNG key lives in the state,
so a run continued from a saved state (``state=``) draws what the uninterrupted run
would have drawn.

A run that ends early loses nothing: an exception inside a step, Ctrl-C, or too many
non-finite updates in a row raise :class:`RunStopped`, :class:`RunInterrupted` or
:class:`NonFiniteUpdates`, each carrying the state after the last completed step and the
history, from which ``train(..., state=error.state)`` continues the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import _checks, algorithms, models, sampling, sharding
from jaxrl_llm.tasks import DigitSumTask
from jaxrl_llm.training.config import TrainConfig
from jaxrl_llm.training.step import Batch, TrainState, check_params, check_state, init_state, make_train_step


class _StoppedRun:
    """What is left of a run that ended before its last step."""

    def __init__(self, message: str, state: TrainState, history: list[dict[str, float]]):
        super().__init__(message)
        # The state after the last completed step, or the one the run started from (the
        # caller's, intact) if none completed; `train(..., state=error.state)` continues
        # the run, drawing the stopped step again.
        self.state = state
        self.history = history  # one dict of metrics per completed step

    def __reduce__(self):  # pickles whole (multiprocessing), cause aside
        return type(self), (str(self), self.state, self.history)


class RunStopped(_StoppedRun, RuntimeError):
    """:func:`train` ended early because a step raised (a reward function, the task, a
    callback, ...): the original exception is ``__cause__``; ``state`` and ``history``
    hold the run up to its last completed step."""


class RunInterrupted(_StoppedRun, KeyboardInterrupt):
    """:func:`train` was interrupted (Ctrl-C, a notebook's stop button); ``state`` and
    ``history`` hold the run up to its last completed step. A ``KeyboardInterrupt``, so
    code that stops on Ctrl-C still does."""


class NonFiniteUpdates(RunStopped, FloatingPointError):
    """Raised after ``max_consecutive_skips`` non-finite updates in a row. ``state`` holds the
    run's state (params of the last finite update) and ``history`` the metrics so far."""


@contextlib.contextmanager
def _interrupts_held():
    """Holds Ctrl-C (SIGINT) while the body runs and delivers it after.

    The update consumes (donates) the state it is given: an interrupt between its dispatch
    and the assignment of its result would lose both states. Only the main thread receives
    signals; elsewhere, and under a handler not set from Python, this does nothing.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):
            previous(signal.SIGINT, received[0])
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def fit_overlong_buffer(algorithm: algorithms.Algorithm, max_new_tokens: int) -> algorithms.Algorithm:
    """DAPO's soft overlong zone for a budget of ``max_new_tokens``: a buffer within the
    budget is kept as set; a longer one (the preset's 4096, the paper's fifth of 20480
    tokens) becomes a fifth of the budget, none under 5 tokens."""
    if algorithm.overlong_buffer <= max_new_tokens:
        return algorithm
    return dataclasses.replace(algorithm, overlong_buffer=max_new_tokens // 5)


def _left_pad(x: np.ndarray, width: int, value) -> np.ndarray:
    return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)


def _validated_rewards(components: dict[str, Any], batch: int) -> dict[str, np.ndarray]:
    if not isinstance(components, Mapping):
        raise TypeError(f"The task's reward_components must return a dict of reward function name -> [B] numbers; "
                        f"got {type(components).__name__}.")
    if not components:
        raise ValueError("The task's reward_components returned no reward functions; it must return at least one "
                         "name -> [B] array.")
    checked = {}
    for name, values in components.items():
        values = np.asarray(values)
        if values.shape != (batch,) or not np.issubdtype(values.dtype, np.number):
            raise ValueError(f"Reward function {name!r} must return [B] = [{batch}] numbers; got shape "
                             f"{list(values.shape)} of dtype {values.dtype}.")
        checked[name] = values.astype(np.float32)
    return checked


@dataclasses.dataclass
class _Rollouts:
    """Host copies of one or more rollout rounds, concatenated along the batch."""

    tokens: np.ndarray  # [R, S + N]
    attention_mask: np.ndarray  # [R, S + N]
    completion_mask: np.ndarray  # [R, N]
    logprobs: np.ndarray  # [R, N]
    lengths: np.ndarray  # [R]
    truncated: np.ndarray  # [R]
    rewards: np.ndarray  # [R]

    def take(self, rows: np.ndarray) -> _Rollouts:
        return _Rollouts(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})

    @staticmethod
    def concatenate(parts: list[_Rollouts], pad_id: int) -> _Rollouts:
        width = max(p.tokens.shape[1] for p in parts)  # prompt buckets can differ between rounds
        return _Rollouts(
            tokens=np.concatenate([_left_pad(p.tokens, width, pad_id) for p in parts]),
            attention_mask=np.concatenate([_left_pad(p.attention_mask, width, False) for p in parts]),
            **{name: np.concatenate([getattr(p, name) for p in parts])
               for name in ("completion_mask", "logprobs", "lengths", "truncated", "rewards")},
        )


@dataclasses.dataclass
class CollectedBatch:
    """What :func:`collect_batch` returns."""

    rollouts: _Rollouts
    """The batch to train on: ``P`` groups (groups without signal masked out, with dynamic sampling)."""
    first_round: _Rollouts
    """The first rollout round, unfiltered: the policy's own statistics."""
    components: dict[str, np.ndarray]
    """Each reward function's ``[B]`` values on the first round."""
    refill_rounds: int
    """Extra rounds drawn by dynamic sampling."""
    sampled_tokens: int
    """Completion tokens generated over all rounds."""
    reward_seconds: float
    """Host time spent in reward functions."""


def collect_batch(
    sampler: sampling.RolloutBackend,
    params: models.Params,
    task: DigitSumTask,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    rng: np.random.Generator,
    key: jax.Array,
    prompt_bucket: int = 8,
) -> CollectedBatch:
    """Rollouts and rewards for one train step.

    Without dynamic sampling: one round of ``P`` prompts times ``G`` completions. With it
    (DAPO): groups whose rewards are all equal are dropped and rounds of ``P`` new prompts
    are drawn until ``P`` groups with signal are collected or ``config.max_refill_rounds``
    extra rounds are spent; the batch is the first ``P`` groups with signal, then groups
    without it with an all-zero completion mask (padding rows: they change no loss).
    """
    algorithm = fit_overlong_buffer(algorithm, config.max_new_tokens)
    num_prompts, group = config.num_prompts, config.group_size
    rounds: list[_Rollouts] = []
    informative = np.zeros(0, bool)  # [groups so far]
    reward_seconds = 0.0
    max_rounds = 1 + (config.max_refill_rounds if algorithm.dynamic_sampling else 0)
    for round_index in range(max_rounds):
        prompt_ids, prompt_mask, answers = task.prompts(rng, num_prompts)
        width = -(-prompt_ids.shape[1] // prompt_bucket) * prompt_bucket
        rollout = sampler(params, _left_pad(prompt_ids, width, task.pad_id), _left_pad(prompt_mask, width, False),
                          jax.random.fold_in(key, round_index), num_samples=group,
                          max_new_tokens=config.max_new_tokens)
        host = jax.device_get(rollout)
        reward_started = time.perf_counter()
        round_components = _validated_rewards(
            task.reward_components(np.asarray(host.completion_tokens), host.lengths, np.repeat(answers, group)),
            num_prompts * group)
        rewards = sum(round_components.values())
        if algorithm.overlong_buffer:
            rewards = rewards + np.asarray(algorithms.overlong_penalty(
                host.lengths, max_len=config.max_new_tokens, buffer=algorithm.overlong_buffer,
                penalty=algorithm.overlong_penalty))
        reward_seconds += time.perf_counter() - reward_started
        if round_index == 0:
            components = round_components
        rounds.append(_Rollouts(tokens=host.tokens, attention_mask=host.attention_mask,
                                completion_mask=host.completion_mask, logprobs=host.logprobs,
                                lengths=host.lengths, truncated=host.truncated, rewards=rewards))
        grouped = rewards.reshape(num_prompts, group)
        informative = np.concatenate([informative, grouped.max(1) > grouped.min(1)])
        if not algorithm.dynamic_sampling or informative.sum() >= num_prompts:
            break
    rollouts = rounds[0]
    if algorithm.dynamic_sampling:
        rollouts = _Rollouts.concatenate(rounds, task.pad_id)
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:num_prompts]
        rollouts = rollouts.take((order[:, None] * group + np.arange(group)).reshape(-1))
        rollouts.completion_mask = rollouts.completion_mask & np.repeat(informative[order], group)[:, None]
    return CollectedBatch(rollouts=rollouts, first_round=rounds[0], components=components,
                          refill_rounds=len(rounds) - 1, sampled_tokens=int(sum(r.lengths.sum() for r in rounds)),
                          reward_seconds=reward_seconds)


def train(
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    steps: int,
    task: DigitSumTask | None = None,
    state: TrainState | None = None,
    ref_params: models.Params | None = None,
    prompt_bucket: int = 8,
    rollout_mesh: jax.sharding.Mesh | None = None,
    callback=None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Runs ``steps`` train steps of ``algorithm`` on ``task``.

    Args:
      model, params: the policy (``params`` is copied, never donated).
      algorithm: the method (a preset from :mod:`jaxrl_llm.algorithms` or any config).
      config: the run's settings.
      steps: train steps (rollout batches) to run.
      task: prompts and reward functions (default: :class:`DigitSumTask`).
      state: continue from this state instead of a fresh one (it is donated: its
        buffers are reused by the first update).
      ref_params: the frozen reference (default: a copy of ``params``).
      prompt_bucket: prompts are left-padded to a multiple of this many tokens.
      rollout_mesh: decode the rollouts data-parallel over this mesh's ``data`` axis
        (:func:`jaxrl_llm.sharding.make_mesh`; ``num_prompts`` must be a multiple of its
        size); ``score`` and ``update`` run where the state is.
      callback: called as ``callback(step, metrics)`` after each step (logging, plots).

    Returns:
      The final state and one dict of float metrics per step.

    Raises:
      ValueError: settings that cannot work together, or a ``state`` / ``params`` that
        does not fit the model and method (before any compute).
      NonFiniteUpdates: after ``config.max_consecutive_skips`` non-finite updates in a row.
      RunStopped: a step raised (a reward function, the task, the callback): the original
        exception is its ``__cause__``.
      RunInterrupted: ``KeyboardInterrupt`` during the run.

    The last three carry ``.state``, the state after the last completed step (the caller's
    ``state``, intact, if none completed), and ``.history``, so nothing is lost: continue
    with ``train(..., state=error.state)``.
    """
    _checks.nonnegative_int("train", "steps", steps)
    _checks.positive_int("train", "prompt_bucket", prompt_bucket)
    task = task or DigitSumTask()
    traces = {"score": 0, "update": 0}

    def counting(name, fn):
        def traced(*args):
            traces[name] += 1  # runs once per trace, not per call
            return fn(*args)
        return traced

    if rollout_mesh is not None and config.num_prompts % sharding.data_size(rollout_mesh):
        raise ValueError(f"train: num_prompts ({config.num_prompts}) must be a multiple of the rollout mesh's "
                         f"{sharding.data_size(rollout_mesh)} {sharding.DATA!r} devices.")
    halves = make_train_step(model, algorithm, config)
    check_params(model, params)
    if state is None:
        if ref_params is not None:
            check_params(model, ref_params, name="ref_params")
        state = init_state(model, params, algorithm, config, ref_params=ref_params)
    elif ref_params is not None:
        raise ValueError("train: pass either `state` (which holds its reference) or `ref_params`, not both.")
    else:
        check_state(state, model, params, algorithm, config)
    score = jax.jit(counting("score", halves.score))
    update = jax.jit(counting("update", halves.update), donate_argnums=0)
    sampler = sampling.Sampler(model=model, eos_ids=(task.eos_id,), pad_id=task.pad_id, temperature=config.temperature,
                               mesh=rollout_mesh)
    num_prompts, group = config.num_prompts, config.group_size
    history: list[dict[str, float]] = []

    def record(started, update_started, collected, host_metrics, score_metrics, update_metrics) -> dict[str, float]:
        """The step's metrics, once its update has run (waits for it)."""
        metrics = {k: float(v) for k, v in jax.device_get({**score_metrics, **update_metrics}).items()}
        now = time.perf_counter()
        metrics.update(host_metrics, update_seconds=now - update_started, step_seconds=now - started,
                       tokens_per_second=collected.sampled_tokens / (now - started),
                       skipped_updates=float(state.skipped_updates), consecutive_skips=float(state.consecutive_skips),
                       score_traces=float(traces["score"]), update_traces=float(traces["update"]))
        history.append(metrics)
        return metrics

    pending = None  # the arguments of `record` for a step whose update is dispatched but not recorded
    first_step = int(state.step)
    try:
        for _ in range(steps):
            started = time.perf_counter()
            step = int(state.step)
            rng = np.random.default_rng((config.seed, step))
            key, rollout_key = jax.random.split(state.key)

            # 1-2. Rollouts and rewards, refilled while groups carry no signal (DAPO).
            collected = collect_batch(sampler, state.params, task, algorithm, config, rng=rng, key=rollout_key,
                                      prompt_bucket=prompt_bucket)
            rollouts, first, components = collected.rollouts, collected.first_round, collected.components
            reward_seconds = collected.reward_seconds
            rollout_seconds = time.perf_counter() - started - reward_seconds

            # 3. Score (reference / old log-probs, values, advantages) and update.
            batch = Batch(tokens=jnp.asarray(rollouts.tokens), attention_mask=jnp.asarray(rollouts.attention_mask),
                          completion_mask=jnp.asarray(rollouts.completion_mask),
                          sampling_logp=jnp.asarray(rollouts.logprobs), rewards=jnp.asarray(rollouts.rewards))
            score_started = time.perf_counter()
            scored, baseline, score_metrics = jax.block_until_ready(score(state, batch))
            update_started = time.perf_counter()

            task_rewards = sum(components.values())
            grouped = first.rewards.reshape(num_prompts, group)  # as the advantages see them (overlong shaping in)
            host_metrics = dict(
                reward=float(task_rewards.mean()), reward_std=float(task_rewards.std()),
                **{f"reward_{name}": float(values.mean()) for name, values in components.items()},
                nonfinite_rewards=float(np.sum(~np.isfinite(task_rewards))),
                completion_length=float(first.lengths.mean()), completion_length_max=float(first.lengths.max()),
                truncated_fraction=float(np.mean(first.truncated)),
                identical_reward_groups=float(np.mean(grouped.max(1) == grouped.min(1))),
                refill_rounds=float(collected.refill_rounds),
                rollout_seconds=rollout_seconds, reward_seconds=reward_seconds,
                logprob_seconds=update_started - score_started,
            )
            # The update consumes (donates) the state: from here on only its result is valid.
            with _interrupts_held():
                state, update_metrics = update(state._replace(key=key, baseline=baseline), scored)
                pending = (started, update_started, collected, host_metrics, score_metrics, update_metrics)
            metrics = record(*pending)
            pending = None
            if callback is not None:
                callback(step, metrics)
            if metrics["consecutive_skips"] >= config.max_consecutive_skips:
                mismatched = int(metrics["prompt_mismatch_rows"])
                hint = (f" {mismatched} rows of the last batch do not share their group's prompt, which makes the "
                        "shared-prompt passes NaN (TrainConfig.share_prompts)." if mismatched else "")
                raise NonFiniteUpdates(
                    f"Stopping at step {step}: {int(metrics['consecutive_skips'])} updates in a row had a non-finite "
                    f"loss, gradient or update (max_consecutive_skips={config.max_consecutive_skips}); the state "
                    f"keeps the params of the last finite update.{hint}", state, history)
    except RunStopped:
        raise
    except (Exception, KeyboardInterrupt) as error:
        if pending is not None:  # the update ran: its step is part of the state, so of the history
            with contextlib.suppress(Exception):  # what failed may have been this; the state is what counts
                record(*pending)
        where = f"train stopped at step {first_step + len(history)} ({len(history)} of {steps} steps done)"
        if isinstance(error, KeyboardInterrupt):
            raise RunInterrupted(f"{where}: interrupted; `.state` and `.history` hold the run so far.", state,
                                 history) from error
        raise RunStopped(f"{where}: {type(error).__name__}: {error}; `.state` and `.history` hold the run so far.",
                         state, history) from error
    return state, history
