r"""Evaluation over a task's split: greedy accuracy, mean reward and unbiased pass@k.

.. code-block:: python

    metrics = evaluation.evaluate(model, params, task, sampling=SamplingConfig(max_new_tokens=256), num_samples=16)
    metrics["greedy_accuracy"], metrics["pass@1"], metrics["pass@16"]

:func:`evaluate` walks the *whole* split in order, in batches of prompts, through
:func:`jaxrl_llm.rollouts.rollout_and_score` (the trainer's own path from prompts to
rewards: prompt fitting, sampling, stop strings, decoding, reward functions), once
greedily and, when asked, once more with ``n`` samples per prompt at a temperature. The
trainer's held-out evaluations (``TrainConfig.eval_every``) and ``jaxrl-llm eval`` call it
and record its results as ``eval_*`` metrics (:func:`as_metrics`).

**Solved.** An example (or a sample) is *solved* when the reward function named by
``correct_reward`` returns at least ``threshold`` for it:
:math:`\text{solved} = r_{\text{correct}} \ge \text{threshold}`. A function that returns
``None`` ("does not apply") for a completion leaves it unsolved. The default, the task's
first reward function with threshold 1, fits the usual 0/1 correctness reward listed
first; a task whose correctness is another function names it (by index or by its logged
name, :func:`jaxrl_llm.rewards.combine.reward_names`).

**pass@k** is the unbiased estimator of Chen et al. (2021), :func:`pass_at_k`, averaged
over the split's examples: with ``n`` samples per example of which ``c`` are solved,
the probability that ``k`` of them drawn without replacement hold a solved one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl_llm import _checks, distributed, models, rewards, tasks
from jaxrl_llm.episodes import scoring
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.rollouts import RolloutStrategy, ScoredRound
from jaxrl_llm.sampling import Sampler, SamplingConfig


def pass_at_k(num_samples: int | np.ndarray, num_correct: int | np.ndarray, k: int) -> float | np.ndarray:
    r"""The unbiased pass@k estimate of each problem (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1).

    With :math:`n` samples of a problem, :math:`c` of them correct, the probability that a
    draw of :math:`k` of the samples without replacement holds at least one correct one:

    .. math::
        \text{pass@}k = 1 - \frac{\binom{n - c}{k}}{\binom{n}{k}}
                      = 1 - \prod_{i = n - c + 1}^{n} \left(1 - \frac{k}{i}\right),

    computed in the product form, which neither overflows nor cancels (the binomials of
    :math:`n = 200` reach :math:`10^{58}`). It is 1 when :math:`n - c < k` (the product then
    has the factor :math:`i = k`, exactly 0) and 0 when :math:`c = 0` (an empty product).
    Averaged over problems it is an unbiased estimate of the expected pass@k; its
    special case :math:`k = 1` is the fraction correct, :math:`c / n`.

    Args:
      num_samples: ``n >= 1``, one int or an integer array ``[M]`` (any shape; one per problem).
      num_correct: ``0 <= c <= n``, an int or an integer array broadcastable with ``num_samples``.
      k: ``1 <= k <= n`` for every problem.

    Returns:
      A float for scalar inputs, else a float64 array of the broadcast shape.

    Raises:
      ValueError: a non-integer input, ``n < 1``, ``c`` outside ``[0, n]``, or ``k`` outside
        ``[1, n]`` (naming the first such problem).
    """
    fn = "pass_at_k"
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{fn}: `k` must be an integer >= 1; got {k!r}.")
    k = int(k)
    arrays = []
    for name, value in (("num_samples", num_samples), ("num_correct", num_correct)):
        array = np.asarray(value)
        if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"{fn}: `{name}` must be an integer or an integer array; got {value!r} (dtype {array.dtype})."
            )
        arrays.append(array.astype(np.int64))
    try:
        n, c = np.broadcast_arrays(*arrays)
    except ValueError:
        raise ValueError(
            f"{fn}: `num_samples` {list(arrays[0].shape)} and `num_correct` {list(arrays[1].shape)} "
            f"must have broadcastable shapes."
        ) from None

    def first(bad: np.ndarray) -> str:
        where = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))  # () for scalars
        at = f" at problem {where[0] if len(where) == 1 else where}" if where else ""
        return f"n = {int(n[where])}, c = {int(c[where])}{at}"

    if (bad := n < 1).any():
        raise ValueError(f"{fn}: `num_samples` must be >= 1; got {first(bad)}.")
    if (bad := (c < 0) | (c > n)).any():
        raise ValueError(f"{fn}: `num_correct` must be in [0, num_samples]; got {first(bad)}.")
    if (bad := k > n).any():
        raise ValueError(
            f"{fn}: `k` must be <= num_samples (k of the n samples are drawn); got k = {k} with {first(bad)}."
        )
    if n.size == 0:
        return np.zeros(n.shape, np.float64)
    # The estimate depends on (n, c) alone: compute it once per distinct pair (at most n + 1
    # of them for one n), so the work does not grow with the number of problems.
    pairs, inverse = np.unique(np.stack([n.ravel(), c.ravel()], axis=1), axis=0, return_inverse=True)  # [U, 2]
    distinct_n, distinct_c = pairs[:, 0], pairs[:, 1]  # [U]
    i = np.arange(1, int(distinct_n.max()) + 1, dtype=np.float64)  # [I]
    in_product = (i > (distinct_n - distinct_c)[:, None]) & (i <= distinct_n[:, None])  # [U, I]: n - c < i <= n
    factors = np.where(in_product, 1.0 - k / i, 1.0)  # [U, I]
    estimate = (1.0 - np.prod(factors, axis=1))[inverse.reshape(-1)].reshape(n.shape)  # [...]
    return float(estimate) if estimate.ndim == 0 else estimate


def wilson_interval(successes: float, trials: float, *, z: float = 1.959964) -> tuple[float, float]:
    r"""The Wilson score interval of a success probability (95% for the default ``z``): with
    :math:`\hat p = s / n`,

    .. math::
        \frac{\hat p + \frac{z^2}{2n} \pm z \sqrt{\frac{\hat p (1 - \hat p)}{n} + \frac{z^2}{4n^2}}}
             {1 + \frac{z^2}{n}}

    (Wilson 1927), which stays inside ``[0, 1]`` and holds its coverage at small ``n`` and
    at accuracies near 0 or 1, where the normal approximation does not."""
    if trials <= 0:
        raise ValueError(f"wilson_interval: `trials` must be > 0; got {trials}.")
    p = successes / trials
    center = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    scale = 1 + z * z / trials
    return max(0.0, (center - spread) / scale), min(1.0, (center + spread) / scale)


def pass_at_k_values(num_samples: int) -> tuple[int, ...]:
    """The ``k`` that :func:`evaluate` reports for ``n = num_samples``: the powers of two
    up to ``n``, and ``n`` itself (``n = 12``: 1, 2, 4, 8, 12)."""
    _checks.positive_int("pass_at_k_values", "num_samples", num_samples)
    num_samples = int(num_samples)
    ks = [1 << j for j in range(num_samples.bit_length()) if 1 << j <= num_samples]
    return tuple(ks if ks[-1] == num_samples else [*ks, num_samples])


def _correct_name(task: tasks.Task, correct_reward: int | str, strategy: RolloutStrategy) -> str:
    """The logged name of the reward function that decides whether a completion is solved
    (the task's, then the strategy's: the environments' ``get_reward``)."""
    names = rewards.combine.reward_names([*task.reward_fns, *strategy.reward_functions()])
    allowed = f"an index in [0, {len(names)}) into the task's reward functions or one of their names {names}"
    if isinstance(correct_reward, str):
        if correct_reward not in names:
            raise ValueError(f"evaluate: `correct_reward` must be {allowed}; got {correct_reward!r}.")
        return correct_reward
    if (
        not isinstance(correct_reward, numbers.Integral)
        or isinstance(correct_reward, bool)
        or not (0 <= correct_reward < len(names))
    ):
        raise ValueError(f"evaluate: `correct_reward` must be {allowed}; got {correct_reward!r}.")
    return names[int(correct_reward)]


def evaluate(
    model: models.Model,
    params: models.Params,
    task: tasks.Task,
    *,
    sampling: SamplingConfig | None = None,
    split: str = "test",
    num_samples: int = 0,
    batch_size: int = 32,
    prompt_bucket: int = 8,
    correct_reward: int | str = 0,
    threshold: float = 1.0,
    seed: int = 0,
    on_reward_error: str = "raise",
    progress: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Any = None,
    episodes: EpisodeConfig | None = None,
    strategy: RolloutStrategy | None = None,
    **sampling_fields: Any,
) -> dict[str, float]:
    r"""Greedy accuracy, mean rewards and pass@k of ``params`` over every example of a split.

    .. code-block:: python

        evaluate(model, params, task, sampling=SamplingConfig(max_new_tokens=256, temperature=0.6),
                 num_samples=16)
        evaluate(model, params, task, max_new_tokens=256, temperature=0.6, num_samples=16)  # the same

    The split's ``M = task.split_size(split)`` examples are taken in order (indices
    ``0 .. M-1``, ``task.examples(split, indices, seed=seed)``) in batches of
    ``P = batch_size`` prompts (the last one may be smaller). Each batch is rolled out
    through :func:`jaxrl_llm.rollouts.rollout_and_score` with the built-in
    :class:`jaxrl_llm.sampling.Sampler`:

    - greedily (temperature 0, one completion ``[P, S + N]`` per prompt): example ``m`` is
      solved when :math:`r_{\text{correct}}(y_m) \ge \text{threshold}` (see the module
      doc), and its reward is the task's weighted total :math:`r(y_m) = \sum_j w_j r_j(y_m)`;
    - with ``n = num_samples > 0``, ``n`` completions per prompt (``[P n, S + N]``, those of
      prompt ``p`` adjacent) drawn as ``sampling`` says (temperature, top-k, top-p, min-p):
      :math:`c_m` of example ``m``'s samples are solved, and

      .. math::
          \text{pass@}k = \frac{1}{M} \sum_{m=1}^{M}
              \left[1 - \binom{n - c_m}{k} \Big/ \binom{n}{k}\right]

      (:func:`pass_at_k`) for ``k`` in 1, 2, 4, ... up to ``n``, and ``n``
      (:func:`pass_at_k_values`). ``pass@1`` is the mean solved fraction :math:`\frac{1}{M n}
      \sum_m c_m`.

    The samples of batch ``b`` are drawn with ``fold_in(fold_in(key(seed), b), 1)`` (the
    greedy rollout draws nothing), so they depend on ``seed`` and ``batch_size`` and not
    on earlier calls: the same arguments give the same metrics.

    Args:
      model, params: the policy (:func:`jaxrl_llm.models.init` / ``from_pretrained``).
      task: a :class:`jaxrl_llm.tasks.Task`.
      sampling: the completion budget ``N = max_new_tokens`` of every rollout, the prompts'
        ``max_prompt_length`` and ``prompt_truncation``, and the samples' temperature
        ``T >= 0`` and truncation (top-k, top-p, min-p; not the greedy rollout's)
        (:class:`jaxrl_llm.sampling.SamplingConfig`, a run's ``TrainConfig.sampling``).
      sampling_fields: fields of a ``SamplingConfig`` by name, replacing those of
        ``sampling`` (``max_new_tokens=256``); without ``sampling`` the budget,
        ``max_new_tokens``, must be among them.
      split: one of :data:`jaxrl_llm.tasks.base.SPLITS`; it must be finite and non-empty.
      num_samples: ``n >= 0`` samples per prompt for the sampled metrics; 0: greedy only.
      batch_size: ``P >= 1`` prompts per rollout call (``P n`` sequences when sampling).
      prompt_bucket, on_reward_error: as in :func:`jaxrl_llm.rollouts.rollout_and_score`
        (and :class:`jaxrl_llm.training.TrainConfig`).
      correct_reward: the reward function that decides "solved": an index into
        ``task.reward_fns`` or its logged name (:func:`jaxrl_llm.rewards.combine.reward_names`).
      threshold: a completion is solved when that function returns at least this.
      seed: seeds the sampling keys, and is passed to ``task.examples``.
      progress: show a ``tqdm`` bar of the examples done.
      mesh: decode each batch over this mesh's devices (:func:`jaxrl_llm.sampling.sample`);
        needed when ``params`` are split over several processes, each of which then calls
        this with the same arguments, scores its share of the rows and gets every metric.
      tools, environment_factory: as in :func:`jaxrl_llm.training.train` (TRL's), added to
        the task's own ``tools``: the rollouts are then multi-turn episodes
        (:mod:`jaxrl_llm.episodes`), greedy and sampled alike, limited by ``episodes``
        (default ``EpisodeConfig()``), and the metrics also hold the greedy episodes'
        mean turns and tool calls.
      strategy: the rollouts chosen already, instead of ``tools``, ``environment_factory``
        and ``episodes`` (:func:`jaxrl_llm.episodes.scoring.rollout_strategy`; a training
        run's evaluations pass the run's own, its environments' pool with it).

    Returns:
      A flat dict of floats:

      - ``"examples"``: ``M``, the examples evaluated;
      - ``"greedy_accuracy"``: the fraction of examples solved by the greedy completion;
      - ``"greedy_reward"``: the mean task reward of the greedy completions;
      - with ``num_samples > 0``: ``"reward"``, the mean task reward of all ``M n``
        samples, and ``"pass@k"`` for each ``k`` of :func:`pass_at_k_values`;
      - with tools or environments: ``"greedy_turns"`` and ``"greedy_tool_calls"``, the
        greedy episodes' mean model turns and tool calls;
      - with ``prompt_truncation="left"``: ``"truncated_prompts"``, prompts that lost
        their first tokens;
      - with ``on_reward_error="zero"``: ``"reward_errors"``, completions (greedy and
        sampled) scored 0 because a reward function raised.

    Raises:
      ValueError: a bad argument (the message names the allowed values), an unbounded or
        empty split, a prompt longer than ``max_prompt_length`` with
        ``prompt_truncation="error"``.
      TypeError: no completion budget (neither ``sampling`` nor ``max_new_tokens``), or a
        keyword that is neither an argument nor a ``SamplingConfig`` field.
      jaxrl_llm.rewards.RewardFunctionError: a reward function failed (see
        :func:`jaxrl_llm.rewards.compute_rewards`).
    """
    sampling = _sampling_of(sampling, sampling_fields)
    _check_arguments(
        task,
        split=split,
        num_samples=num_samples,
        batch_size=batch_size,
        prompt_bucket=prompt_bucket,
        threshold=threshold,
        seed=seed,
        on_reward_error=on_reward_error,
        progress=progress,
    )
    if strategy is None:
        strategy = scoring.rollout_strategy(
            task, tools=tools, environment_factory=environment_factory, episodes=episodes
        )
    elif tools is not None or environment_factory is not None or episodes is not None:
        raise ValueError(
            "evaluate: pass `strategy` or `tools`, `environment_factory` and `episodes` (which make one), not both."
        )
    tasks.check_task(task, needs_rewards=not strategy.reward_functions())
    correct = _correct_name(task, correct_reward, strategy)
    size = _split_size(task, split)
    greedy_sampling = dataclasses.replace(sampling, temperature=0.0, top_k=None, top_p=None, min_p=None)
    backends = [
        (Sampler(model=model, eos_ids=task.eos_ids, pad_id=task.pad_id, sampling=greedy_sampling, mesh=mesh), 1)
    ]
    if num_samples:
        backends.append(
            (Sampler(model=model, eos_ids=task.eos_ids, pad_id=task.pad_id, sampling=sampling, mesh=mesh), num_samples)
        )
    settings = dict(
        sampling_config=sampling,
        prompt_bucket=prompt_bucket,
        on_reward_error=on_reward_error,
    )
    key = jax.random.key(seed)
    tally = _Tally(correct=correct, threshold=threshold)
    show = progress and distributed.is_main_process()
    with tqdm(total=size, desc=f"evaluate {split}", unit="example", disable=not show) as bar:
        for number, start in enumerate(range(0, size, batch_size)):
            batch = _examples(task, split, np.arange(start, min(start + batch_size, size), dtype=np.int64), seed=seed)
            batch_key = jax.random.fold_in(key, number)
            for index, (backend, samples) in enumerate(backends):  # greedy (key 0), then sampled (key 1)
                scored = strategy.score(
                    backend, params, task, batch, jax.random.fold_in(batch_key, index), num_samples=samples, **settings
                )
                tally.add(scored, samples=samples, sampled=index > 0)
            bar.update(len(batch))
            bar.set_postfix(greedy_accuracy=f"{tally.greedy_solved / (start + len(batch)):.3f}")
    return tally.metrics(
        size, num_samples=num_samples, truncation=sampling.prompt_truncation, on_reward_error=on_reward_error
    )


def _sampling_of(sampling: SamplingConfig | None, fields: dict[str, Any]) -> SamplingConfig:
    """``sampling`` with ``fields`` (``evaluate``'s keywords that name SamplingConfig fields) replaced."""
    known = {field.name for field in dataclasses.fields(SamplingConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(
            f"evaluate: unexpected keyword {', '.join(map(repr, unknown))}; besides its own arguments it "
            f"takes SamplingConfig's fields ({', '.join(sorted(known))})."
        )
    if sampling is None:
        if "max_new_tokens" not in fields:
            raise TypeError(
                "evaluate: give the completion budget, `max_new_tokens=` (or a whole "
                "`sampling=SamplingConfig(max_new_tokens=...)`)."
            )
        return SamplingConfig(**fields)
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"evaluate: `sampling` must be a SamplingConfig; got {sampling!r}.")
    return dataclasses.replace(sampling, **fields)


def _check_arguments(
    task: tasks.Task,
    *,
    split: str,
    num_samples: int,
    batch_size: int,
    prompt_bucket: int,
    threshold: float,
    seed: int,
    on_reward_error: str,
    progress: bool,
) -> None:
    """Raises ValueError naming the first of ``evaluate``'s arguments that is out of range."""
    fn = "evaluate"
    tasks.check_task(task, needs_rewards=False)  # checked with the environments' rewards once they are built
    _checks.one_of(fn, "split", split, tasks.base.SPLITS)
    _checks.nonnegative_int(fn, "num_samples", num_samples)
    for name, value in (("batch_size", batch_size), ("prompt_bucket", prompt_bucket)):
        _checks.positive_int(fn, name, value)
    _checks.one_of(fn, "on_reward_error", on_reward_error, rewards.combine.ON_ERROR)
    _checks.finite_number(fn, "threshold", threshold)
    _checks.nonnegative_int(fn, "seed", seed)
    if not isinstance(progress, bool):
        raise ValueError(f"{fn}: `progress` must be True or False; got {progress!r}.")


def _split_size(task: tasks.Task, split: str) -> int:
    """``M``, the examples of ``split``; raises ValueError for an unbounded or empty split."""
    size = task.split_size(split)
    if size is None:
        raise ValueError(
            f"evaluate: the {split!r} split of {type(task).__name__} is unbounded (procedural); "
            f"evaluation walks a finite split. Evaluate on a finite split (e.g. 'test')."
        )
    if size < 1:
        hint = (
            " Give the task a test split: pass `test_records=` or `test_fraction=` when building it "
            "(jaxrl_llm.tasks.text.from_records, from_jsonl, from_dataset)."
            if split == "test"
            else ""
        )
        raise ValueError(f"evaluate: the {split!r} split of {type(task).__name__} has no examples.{hint}")
    return size


def _examples(task: tasks.Task, split: str, indices: np.ndarray, *, seed: int) -> tasks.PromptBatch:
    """The examples ``indices`` ``[P]`` of ``split``; raises ValueError if the task returns another number."""
    batch = task.examples(split, indices, seed=seed)
    if len(batch) != len(indices):
        raise ValueError(f"{type(task).__name__}.examples returned {len(batch)} examples for {len(indices)} indices.")
    return batch


@dataclasses.dataclass
class _Tally:
    """:func:`evaluate`'s running sums over the split's batches (rewards in float64, on the host)."""

    correct: str  # the logged name of the reward function that decides "solved"
    threshold: float
    greedy_solved: int = 0
    greedy_reward: float = 0.0
    sample_reward: float = 0.0
    solved_counts: list = dataclasses.field(default_factory=list)  # per batch: [P] int, solved samples per example
    truncated_prompts: int = 0
    reward_errors: int = 0
    greedy_turns: float = 0.0  # sums over the greedy episodes (runs with tools or environments)
    greedy_tool_calls: float = 0.0

    def add(self, scored: ScoredRound, *, samples: int, sampled: bool) -> None:
        """One batch's greedy rollout (``samples = 1``) or its ``samples`` samples per prompt."""
        # [P n], prompt p's rows p n .. p n + n - 1; NaN (None: "does not apply") is unsolved.
        solved = scored.result.values[self.correct] >= self.threshold
        total = float(scored.result.total.sum(dtype=np.float64))
        if sampled:
            self.solved_counts.append(solved.reshape(-1, samples).sum(axis=1))
            self.sample_reward += total
        else:
            self.greedy_solved += int(solved.sum())
            self.greedy_reward += total
            self.truncated_prompts += scored.truncated_prompts
            if episodes := scored.episode_metrics:
                self.greedy_turns += episodes["episodes/turns"] * len(solved)
                self.greedy_tool_calls += episodes["tools/call_frequency"] * len(solved)
        self.reward_errors += sum(scored.result.errors.values())

    def metrics(self, size: int, *, num_samples: int, truncation: str, on_reward_error: str) -> dict[str, float]:
        """The split's metrics (see :func:`evaluate`'s Returns)."""
        metrics = {
            "examples": float(size),
            "greedy_accuracy": self.greedy_solved / size,
            "greedy_reward": self.greedy_reward / size,
        }
        if self.greedy_turns:  # episodes: every one has a turn
            metrics.update(greedy_turns=self.greedy_turns / size, greedy_tool_calls=self.greedy_tool_calls / size)
        if num_samples:
            counts = np.concatenate(self.solved_counts)  # [M]
            metrics["reward"] = self.sample_reward / (size * num_samples)
            for k in pass_at_k_values(num_samples):
                metrics[f"pass@{k}"] = float(np.mean(pass_at_k(num_samples, counts, k)))
        if truncation == "left":
            metrics["truncated_prompts"] = float(self.truncated_prompts)
        if on_reward_error == "zero":
            metrics["reward_errors"] = float(self.reward_errors)
        return metrics


def as_metrics(results: dict[str, float], *, seconds: float) -> dict[str, float]:
    """:func:`evaluate`'s results as a run records them beside its train metrics: each as
    ``eval_<name>``, and ``eval_seconds``, the evaluation's wall time."""
    return {**{f"eval_{name}": value for name, value in results.items()}, "eval_seconds": seconds}
