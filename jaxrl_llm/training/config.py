"""The settings of a training run: one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses

from jaxrl_llm import _checks
from jaxrl_llm.rewards.combine import ON_ERROR
from jaxrl_llm.sampling import PROMPT_TRUNCATION

LR_SCHEDULES = ("constant", "linear", "cosine")
"""The learning rate after the linear warm-up: constant at the peak, or a linear or cosine decay."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of a training run; the defaults fit the digit task on a CPU."""

    num_prompts: int = 8
    """P: prompts per rollout batch."""
    group_size: int = 8
    """G: completions per prompt; the batch has ``B = P * G`` sequences."""
    max_new_tokens: int = 4
    """N: completion budget in tokens."""
    minibatch_size: int | None = None
    """Sequences per optimizer step; ``None`` is the whole batch. Must divide ``B``. Each of
    the method's ``num_iterations`` passes visits every minibatch once, in a fresh order."""
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
    there (:func:`jaxrl_llm.training.step.learning_rate_schedule`)."""
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
    temperature: float = 1.0
    """Sampling temperature; the policy trained is ``softmax(logits / T)`` (see sampling)."""
    top_k: int | None = None
    """Rollouts sample among the ``k`` most likely tokens (``None``: all)."""
    top_p: float | None = None
    """Rollouts sample from the smallest set of tokens with mass ``>= top_p`` (``None``: all)."""
    min_p: float | None = None
    """Rollouts sample among tokens at least ``min_p`` times as likely as the most likely
    one (``None``: all). With top-k, top-p or min-p, the old policy's log-probs are still
    those of ``softmax(logits / T)`` (see :mod:`jaxrl_llm.sampling`)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens. Prompts are padded to one of a few widths up to this
    (``8, 16, 32, ...``), so the train step compiles a bounded number of times."""
    prompt_truncation: str = "error"
    """A longer prompt: ``"error"`` stops the run naming it; ``"left"`` drops its first
    tokens (counted in the ``truncated_prompts`` metric)."""
    on_reward_error: str = "raise"
    """A reward function that raises: ``"raise"`` stops the run naming the function and the
    example; ``"zero"`` scores those completions 0 (counted in ``reward_errors``)."""
    eval_every: int = 0
    """Evaluate on the task's test split every this many steps (0: never); the results
    join that step's metrics as ``eval_*``."""
    eval_samples: int = 0
    """Samples per test prompt at ``temperature`` for the evaluation's pass@k (0: greedy only)."""
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
    for its ``G`` completions (:func:`jaxrl_llm.models.group_completion_hidden_states`):
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
    exact_kl: bool = False
    r"""Log ``kl_exact``, the exact :math:`D_{KL}(\pi_{old}\|\pi_{ref})` over the vocabulary
    at the batch's states (once per step, at the params that sampled it). Keeps and runs
    the reference like ``reference_metrics``, and costs a policy forward pass per step
    when the update would not otherwise recompute the old log-probs (``num_iterations =
    1`` and one minibatch)."""

    def __post_init__(self):
        where = "TrainConfig"
        for field in ("num_prompts", "group_size", "max_new_tokens", "warmup_steps", "chunk_size",
                      "max_consecutive_skips"):
            _checks.positive_int(where, field, getattr(self, field))
        for field in ("max_refill_rounds", "eval_every", "eval_samples"):
            _checks.nonnegative_int(where, field, getattr(self, field))
        _checks.positive_int(where, "max_prompt_length", self.max_prompt_length)
        _checks.nonnegative_int(where, "seed", self.seed)
        if self.top_k is not None:
            _checks.positive_int(where, "top_k", self.top_k)
        for field, closed in (("top_p", "(]"), ("min_p", "[]")):
            if getattr(self, field) is not None:
                _checks.finite_number(where, field, getattr(self, field))
                _checks.in_range(where, field, getattr(self, field), 0.0, 1.0, closed=closed)
        _checks.one_of(where, "prompt_truncation", self.prompt_truncation, PROMPT_TRUNCATION)
        _checks.one_of(where, "on_reward_error", self.on_reward_error, ON_ERROR)
        for field in ("share_prompts", "reference_metrics", "exact_kl"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"TrainConfig: `{field}` must be True or False; got {getattr(self, field)!r}.")
        for field in ("learning_rate", "critic_learning_rate", "max_grad_norm", "temperature", "adam_eps"):
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
                raise ValueError(f"TrainConfig: `micro_batch_size` must divide the rows of an optimizer step "
                                 f"({'minibatch_size' if self.minibatch_size else 'B'} = {rows}); got "
                                 f"{self.micro_batch_size}.")

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
