"""The settings of a training run: frozen, validated dataclasses grouped by concern.

* :class:`~jaxrl_llm.sampling.SamplingConfig` (``TrainConfig.sampling``): how completions
  are drawn and how long they may be, shared with the sampler and the evaluation;
* :class:`OptimizerConfig` (``TrainConfig.optimizer``): AdamW, its clip and its
  learning-rate schedule;
* :class:`~jaxrl_llm.episodes.config.EpisodeConfig` (``TrainConfig.episodes``): the limits
  of multi-turn episodes (runs with tools or environments);
* :class:`TrainConfig`: the batch's shape, those three, the held-out evaluations, fault
  tolerance and memory.

**Flat names.** In Python a grouped setting is set and read in its group:
``TrainConfig(sampling=SamplingConfig(temperature=0.7))``, ``config.sampling.temperature``.
A config file's ``[train]`` table, a stored run's config and the ``--train.*`` flags also
take each one by its flat name (``temperature = 0.7``, :data:`GROUPED_FIELDS`), moved into
its group by :func:`nest_flat_settings`, so runs stored before the groups resume.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from jaxrl_llm import _checks
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.rewards.combine import ON_ERROR
from jaxrl_llm.sampling import SamplingConfig

LR_SCHEDULES = ("constant", "linear", "cosine")
"""The learning rate after the linear warm-up: constant at the peak, or a linear or cosine decay."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW after a global gradient-norm clip, at a learning rate warmed up linearly and then
    held or decayed (:func:`jaxrl_llm.training.optim.make_optimizer`); the critic's (methods
    with GAE) has the same shape at its own peak rate."""

    learning_rate: float = 3e-3
    """Peak AdamW learning rate of the policy (linear warm-up over ``warmup_steps``, then
    ``lr_schedule``)."""
    critic_learning_rate: float = 3e-3
    """Peak AdamW learning rate of the critic (methods with GAE); same schedule shape."""
    warmup_steps: int = 5
    """Optimizer steps of linear warm-up, from ``lr / warmup_steps`` to ``lr``: step ``k``
    (from 0) takes ``lr (k + 1) / warmup_steps``, the last of them the peak."""
    lr_schedule: str = "constant"
    """After the warm-up: ``"constant"`` stays at the peak; ``"linear"`` and ``"cosine"``
    decay from it to ``end_learning_rate_fraction * lr`` over ``decay_steps``, then stay
    there (:func:`jaxrl_llm.training.optim.learning_rate_schedule`)."""
    decay_steps: int | None = None
    """Optimizer steps from the peak (the warm-up's last step) to the end of the decay: the
    rate reaches its end value at step ``warmup_steps - 1 + decay_steps``. ``None``: the
    run's last optimizer step, which then takes the end value (``train`` tells the step its
    length: ``make_train_step``'s ``total_steps``). Ignored by ``"constant"``. An optimizer
    step is one minibatch: a train step takes ``num_iterations * num_minibatches`` of them."""
    end_learning_rate_fraction: float = 0.0
    """The decay's end value as a fraction of the peak, in ``[0, 1]``."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay ``lambda``: each step also subtracts ``lr * lambda *
    theta`` from the matrices and embeddings (params with two or more axes; norm scales and
    biases are not decayed)."""
    adam_b1: float = 0.9
    """AdamW's first-moment decay ``beta_1``, in ``[0, 1)``."""
    adam_b2: float = 0.999
    """AdamW's second-moment decay ``beta_2``, in ``[0, 1)``."""
    adam_eps: float = 1e-8
    """AdamW's ``epsilon`` (> 0), added to ``sqrt(v_hat)`` in the denominator."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip, before AdamW (finite: a very large value turns it off)."""

    def __post_init__(self):
        where = "OptimizerConfig"
        _checks.positive_int(where, "warmup_steps", self.warmup_steps)
        for field in ("learning_rate", "critic_learning_rate", "max_grad_norm", "adam_eps"):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.positive(where, field, getattr(self, field))
        _checks.one_of(where, "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.decay_steps is not None:
            _checks.positive_int(where, "decay_steps", self.decay_steps)
        _checks.finite_number(where, "weight_decay", self.weight_decay)
        _checks.nonnegative(where, "weight_decay", self.weight_decay)
        for field, closed in (("end_learning_rate_fraction", "[]"), ("adam_b1", "[)"), ("adam_b2", "[)")):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.in_range(where, field, getattr(self, field), 0.0, 1.0, closed=closed)


GROUPS: dict[str, type] = {"sampling": SamplingConfig, "optimizer": OptimizerConfig, "episodes": EpisodeConfig}
"""TrainConfig's groups of settings: field name -> its dataclass."""

GROUPED_FIELDS: dict[str, str] = {
    field.name: group for group, kind in GROUPS.items() for field in dataclasses.fields(kind)
}
"""The flat name of each grouped setting -> its group: ``"temperature" -> "sampling"``
(a config file's ``[train] temperature`` is ``[train.sampling] temperature``)."""


def nest_flat_settings(table: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """A ``[train]`` table (a config file's, a stored run's) with the flat names of grouped
    settings moved into their group's table: ``{"temperature": 0.7}`` becomes
    ``{"sampling": {"temperature": 0.7}}``. Raises ValueError for a setting given both ways."""
    nested = dict(table)
    for name in [key for key in table if key in GROUPED_FIELDS]:
        group = GROUPED_FIELDS[name]
        inner = nested.get(group, {})
        if not isinstance(inner, Mapping):
            raise ValueError(f"{where}.{group} must be a table of {GROUPS[group].__name__}'s fields; got {inner!r}.")
        if name in inner:
            raise ValueError(
                f"{where}: `{name}` is given twice, as {where}.{name} and {where}.{group}.{name} "
                f"; give it once, in {group}."
            )
        nested[group] = {**inner, name: nested.pop(name)}
    return nested


LORA_DECODINGS = ("unmerged", "merged")
""":attr:`TrainConfig.lora_decoding`'s choices."""


def _flat_names_refused(cls):
    """Makes ``cls(...)`` refuse a grouped setting's flat name with its grouped spelling
    (``TrainConfig(temperature=0.7)``: ``sampling=SamplingConfig(temperature=0.7)``)."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, **settings):
        if flat := [name for name in settings if name in GROUPED_FIELDS]:
            spelled = ", ".join(
                f"{n} as {GROUPED_FIELDS[n]}={GROUPS[GROUPED_FIELDS[n]].__name__}({n}=...)" for n in flat
            )
            raise TypeError(f"{cls.__name__}: a grouped setting is passed in its group: {spelled}.")
        generated(self, **settings)

    cls.__init__ = __init__
    return cls


@_flat_names_refused
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of a training run; the defaults fit the digit task on a CPU."""

    num_prompts: int = 8
    """P: prompts per rollout batch."""
    group_size: int = 8
    """G: completions per prompt; the batch has ``B = P * G`` sequences."""
    sampling: SamplingConfig = SamplingConfig()
    """How the rollouts (and the held-out evaluations' samples) are drawn: temperature,
    top-k/top-p/min-p, the completion budget ``N = max_new_tokens``, the prompts' length
    (:class:`~jaxrl_llm.sampling.SamplingConfig`). Training needs a temperature > 0."""
    minibatch_size: int | None = None
    """Sequences per optimizer step; ``None`` is the whole batch. Must divide ``B``. Each of
    the method's ``num_iterations`` passes visits every minibatch once, in a fresh order."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The policy's (and the critic's) AdamW and learning-rate schedule (:class:`OptimizerConfig`)."""
    episodes: EpisodeConfig = EpisodeConfig()
    """Runs with tools or environments: the tool-calling rounds, the tools' timeout and the
    tool-call format (:class:`~jaxrl_llm.episodes.config.EpisodeConfig`); the episode's
    token budget is ``sampling.max_new_tokens``."""
    on_reward_error: str = "raise"
    """A reward function that raises: ``"raise"`` stops the run naming the function and the
    example; ``"zero"`` scores those completions 0 (counted in ``reward_errors``)."""
    eval_every: int = 0
    """Evaluate on the task's test split every this many steps (0: never); the results
    join that step's metrics as ``eval_*``."""
    eval_samples: int = 0
    """Samples per test prompt (drawn as ``sampling`` says) for the evaluation's pass@k (0: greedy only)."""
    chunk_size: int = 256
    """Tokens per chunk (over all rows) when log-probs and KLs are computed from hidden
    states: the float32 logits held at once are about ``chunk_size x V``, and at least one
    position of every row, ``B x V`` (:func:`jaxrl_llm.ops.chunked_token_logprobs`)."""
    max_consecutive_skips: int = 3
    """Stop the run after this many train steps in a row with a non-finite update."""
    max_refill_rounds: int = 4
    """Dynamic sampling (DAPO): extra rollouts per step to replace groups whose rewards are
    all equal; groups still missing after that are masked out of the loss."""
    seed: int = 0
    """Seeds the initial PRNG key (rollouts, shuffles) and the prompt stream."""
    share_prompts: bool = True
    """Teacher-forced passes over whole groups (reference and old log-probs, critic values,
    the update's (micro-)batches when they hold whole groups, TRPO's) run each prompt once
    for its ``G`` completions (:func:`jaxrl_llm.models.functional.group_completion_hidden_states`):
    the same numbers, with a fraction ``(1 - 1/G) S / (S + N)`` of the token positions
    fewer. Shuffled minibatches mix groups and always run every row in full."""
    micro_batch_size: int | None = None
    """Gradient accumulation: sequences per forward and backward pass; each optimizer step's
    gradient is summed over ``minibatch_size / micro_batch_size`` micro-batches, weighted so
    that it equals the whole minibatch's (the loss's normaliser spans the minibatch). Cuts
    the activations' memory by that factor. ``None``: the whole minibatch at once. Must
    divide the minibatch (or ``B``)."""
    reference_metrics: bool = False
    """Log the KL to the reference (``kl_k3``) for methods without a KL term too. Their
    reference model is otherwise neither kept nor run: this costs its copy of the params
    and a forward pass per step."""
    lora_decoding: str = "unmerged"
    r"""How a LoRA run (``train(..., lora=)``) decodes its rollouts and evaluations:
    ``unmerged``, the LoRA model as it trains (:math:`x W + s (x A) B` at every step), or
    ``merged``, the adapters folded into a copy of the targeted kernels once per rollout
    (:math:`W + s A B` in the base's dtype, ``models.lora.merge``), a plain model to decode.
    Which is faster depends on the shape and the device (docs/performance.md measures both);
    the update always runs unmerged."""
    exact_kl: bool = False
    r"""Log ``kl_exact``, the exact :math:`D_{KL}(\pi_{old}\|\pi_{ref})` over the vocabulary
    at the batch's states (once per step, at the params that sampled it). Keeps and runs
    the reference like ``reference_metrics``, and costs a policy forward pass per step
    when the update would not otherwise recompute the old log-probs (``num_iterations =
    1`` and one minibatch)."""

    def __post_init__(self):
        where = "TrainConfig"
        for group, kind in GROUPS.items():
            if not isinstance(getattr(self, group), kind):
                raise ValueError(f"{where}: `{group}` must be of type {kind.__name__}; got {getattr(self, group)!r}.")
        for field in ("num_prompts", "group_size", "chunk_size", "max_consecutive_skips"):
            _checks.positive_int(where, field, getattr(self, field))
        for field in ("max_refill_rounds", "eval_every", "eval_samples"):
            _checks.nonnegative_int(where, field, getattr(self, field))
        _checks.seed(where, "seed", self.seed)
        if not self.sampling.temperature > 0:
            raise ValueError(
                f"{where}: `sampling.temperature` must be a finite number > 0 (the policy trained is "
                f"softmax(logits / T)); got {self.sampling.temperature}."
            )
        _checks.one_of(where, "on_reward_error", self.on_reward_error, ON_ERROR)
        _checks.one_of(where, "lora_decoding", self.lora_decoding, LORA_DECODINGS)
        for field in ("share_prompts", "reference_metrics", "exact_kl"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{where}: `{field}` must be True or False; got {getattr(self, field)!r}.")
        if self.minibatch_size is not None:
            _checks.positive_int(where, "minibatch_size", self.minibatch_size)
            if self.batch_size % self.minibatch_size:
                raise ValueError(
                    f"TrainConfig: `minibatch_size` must divide the batch B = num_prompts * group_size = "
                    f"{self.batch_size}; got {self.minibatch_size}."
                )
        if self.micro_batch_size is not None:
            _checks.positive_int(where, "micro_batch_size", self.micro_batch_size)
            rows = self.batch_size if self.minibatch_size is None else self.minibatch_size
            if rows % self.micro_batch_size:
                raise ValueError(
                    f"TrainConfig: `micro_batch_size` must divide the rows of an optimizer step "
                    f"({'minibatch_size' if self.minibatch_size else 'B'} = {rows}); got "
                    f"{self.micro_batch_size}."
                )

    @property
    def batch_size(self) -> int:
        """B = P * G sequences per rollout batch."""
        return self.num_prompts * self.group_size

    @property
    def num_minibatches(self) -> int:
        return 1 if self.minibatch_size is None else self.batch_size // self.minibatch_size

    @property
    def num_micro_batches(self) -> int:
        """Forward and backward passes per optimizer step (gradient accumulation)."""
        rows = self.batch_size // self.num_minibatches
        return 1 if self.micro_batch_size is None else rows // self.micro_batch_size
