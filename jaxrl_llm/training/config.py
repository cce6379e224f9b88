"""The settings of a training run: one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses

from jaxrl_llm import _checks


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
    """Peak AdamW learning rate of the policy (linear warm-up over ``warmup_steps``)."""
    critic_learning_rate: float = 3e-3
    """Peak AdamW learning rate of the critic (methods with GAE)."""
    warmup_steps: int = 5
    """Optimizer steps of linear warm-up, from ``lr / warmup_steps`` to ``lr``."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip, before AdamW (finite: a very large value turns it off)."""
    temperature: float = 1.0
    """Sampling temperature; the policy trained is ``softmax(logits / T)`` (see sampling)."""
    chunk_size: int = 256
    """Tokens per chunk when log-probs and KLs are computed from hidden states."""
    max_consecutive_skips: int = 3
    """Stop the run after this many train steps in a row with a non-finite update."""
    max_refill_rounds: int = 4
    """Dynamic sampling (DAPO): extra rollouts per step to replace groups whose rewards are
    all equal; groups still missing after that are masked out of the loss."""
    seed: int = 0
    """Seeds the initial PRNG key (rollouts, shuffles) and the prompt stream."""
    share_prompts: bool = True
    """Teacher-forced passes over the whole batch (reference and old log-probs, critic
    values, the update when there is one minibatch) run each group's prompt once for its
    ``G`` completions (:func:`jaxrl_llm.models.completion_hidden_states`): the same
    numbers, with a fraction ``(1 - 1/G) S / (S + N)`` of the token positions fewer.
    Shuffled minibatches mix groups and always run every row in full."""

    def __post_init__(self):
        where = "TrainConfig"
        for field in ("num_prompts", "group_size", "max_new_tokens", "warmup_steps", "chunk_size",
                      "max_consecutive_skips"):
            _checks.positive_int(where, field, getattr(self, field))
        _checks.nonnegative_int(where, "max_refill_rounds", self.max_refill_rounds)
        if not isinstance(self.share_prompts, bool):
            raise ValueError(f"TrainConfig: `share_prompts` must be True or False; got {self.share_prompts!r}.")
        for field in ("learning_rate", "critic_learning_rate", "max_grad_norm", "temperature"):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.positive(where, field, getattr(self, field))
        if self.minibatch_size is not None:
            _checks.positive_int(where, "minibatch_size", self.minibatch_size)
            if self.batch_size % self.minibatch_size:
                raise ValueError(
                    f"TrainConfig: `minibatch_size` must divide the batch B = num_prompts * group_size = "
                    f"{self.batch_size}; got {self.minibatch_size}."
                )

    @property
    def batch_size(self) -> int:
        """B = P * G sequences per rollout batch."""
        return self.num_prompts * self.group_size

    @property
    def num_minibatches(self) -> int:
        return 1 if self.minibatch_size is None else self.batch_size // self.minibatch_size
