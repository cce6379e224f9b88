r"""The losses of a train step on rows of a scored batch, and the teacher-forced passes they run.

A train step reads its policy through :class:`TeacherForcing`: the states before each
completion token, the output head, log-probs and per-token KLs from them, and the critic's
values. :class:`DecoderTeacherForcing` is the language model's: the hidden states before
each completion token (each prompt run once for its group when ``TrainConfig.share_prompts``,
:func:`jaxrl_llm.models.functional.group_completion_hidden_states`), then log-probs chunked over the
tokens from the output projection as stored (a tied embedding stays ``[V, E]``). Another
policy (``experiments/toy_digits.py``'s MLP) brings its own and trains with the same step.

:func:`policy_loss` is the method's loss (:func:`jaxrl_llm.algorithms.policy_loss`) at
params :math:`\theta`, with :math:`\log\pi_{old} = \operatorname{sg}(\log\pi_\theta)` when
the step is on-policy (:func:`is_on_policy`); :func:`critic_loss` is PPO's value loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from jaxrl_llm import algorithms, kl, models, objectives, ops
from jaxrl_llm.objectives import Metrics
from jaxrl_llm.training import critic
from jaxrl_llm.training.batch import Batch, ScoredBatch
from jaxrl_llm.training.config import TrainConfig

Rows = Batch | ScoredBatch


class TeacherForcing(Protocol):
    """How a train step runs its policy (and critic) over a batch's given completions."""

    def states(self, params: Any, rows: Rows) -> jax.Array:
        """``[b, N, ...]``: what the output head reads before each completion token."""

    def head(self, params: Any) -> Any:
        """The part of ``params`` that maps states to logits."""

    def logprobs(self, states: jax.Array, head: Any, rows: Rows, *, with_entropy: bool = False):
        """``[b, N]`` log-probs of the completion tokens (and ``[b, N]`` entropies)."""

    def categorical_kl(self, states: jax.Array, head: Any, other_states: jax.Array, other_head: Any) -> jax.Array:
        """``[b, N]``: the exact KL of the first distribution from the second at each token."""

    def values(self, critic_params: Any, rows: Rows) -> jax.Array:
        """``[b, N]``: the critic's value before each completion token."""


@dataclasses.dataclass(frozen=True)
class DecoderTeacherForcing:
    """:class:`TeacherForcing` of a :class:`jaxrl_llm.models.Model` with a run's settings."""

    model: models.Model
    config: TrainConfig

    def states(self, params: models.Params, rows: Rows, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """``[b, N, E]`` hidden states before each completion token (each prompt once if shared);
        ``dropout_key``: LoRA dropout in this pass (:class:`AdaptedTeacherForcing` passes it)."""
        return models.functional.group_completion_hidden_states(
            self.model,
            params,
            rows.prompt_tokens,
            rows.prompt_mask,
            rows.completion_tokens,
            share_prompts=self.config.share_prompts,
            dropout_key=dropout_key,
        )

    def head(self, params: models.Params) -> jax.Array:
        """The output projection as stored: a tied embedding stays ``[V, E]`` (no transposed copy)."""
        return models.output_kernel(self.model, params, as_stored=True)

    def _options(self) -> dict:
        return dict(chunk_size=self.config.chunk_size, temperature=self.config.sampling.temperature)

    def logprobs(self, states: jax.Array, head: jax.Array, rows: Rows, *, with_entropy: bool = False):
        """:func:`jaxrl_llm.ops.chunked_token_logprobs` of the completion tokens."""
        return ops.chunked_token_logprobs(
            states,
            head,
            rows.completion_tokens,
            transposed_kernel=self.model.config.tie_word_embeddings,
            **self._options(),
            with_entropy=with_entropy,
        )

    def categorical_kl(
        self, states: jax.Array, head: jax.Array, other_states: jax.Array, other_head: jax.Array
    ) -> jax.Array:
        """:func:`jaxrl_llm.ops.chunked_categorical_kl` over the vocabulary, ``[b, N]``."""
        return ops.chunked_categorical_kl(
            states,
            head,
            other_states,
            other_head,
            transposed_kernels=self.model.config.tie_word_embeddings,
            **self._options(),
        )

    def values(self, critic_params: critic.CriticParams, rows: Rows) -> jax.Array:
        """:func:`jaxrl_llm.training.critic.completion_values`, ``[b, N]``."""
        return critic.completion_values(
            self.model,
            critic_params,
            rows.prompt_tokens,
            rows.prompt_mask,
            rows.completion_tokens,
            share_prompts=self.config.share_prompts,
        )


@dataclasses.dataclass(frozen=True)
class AdaptedTeacherForcing:
    """:class:`TeacherForcing` of a LoRA policy whose params are its adapters alone: ``inner``
    (the LoRA model's) runs on ``lora.combine(base, adapters)``, and a critic's backbone on
    ``lora.combine(base, its adapters)``. Built inside a traced step around the run's
    ``fixed.base`` (:func:`over_base`), so gradients with respect to the params reach the
    adapters only and the base is read, never differentiated."""

    inner: DecoderTeacherForcing
    base: models.Params
    dropout_key: jax.Array | None = None
    """LoRA dropout in :meth:`states` (the update's passes, when ``lora.dropout > 0``;
    :func:`fold_dropout_key` gives each minibatch and micro-batch its own); ``None``: none."""

    def states(self, params: models.Params, rows: Rows) -> jax.Array:
        return self.inner.states(models.lora.combine(self.base, params), rows, dropout_key=self.dropout_key)

    def head(self, params: models.Params) -> Any:
        return self.inner.head(models.lora.combine(self.base, params))

    def logprobs(self, states: jax.Array, head: Any, rows: Rows, *, with_entropy: bool = False):
        return self.inner.logprobs(states, head, rows, with_entropy=with_entropy)

    def categorical_kl(self, states: jax.Array, head: Any, other_states: jax.Array, other_head: Any) -> jax.Array:
        return self.inner.categorical_kl(states, head, other_states, other_head)

    def values(self, critic_params: Any, rows: Rows) -> jax.Array:
        """The critic's values: its backbone is adapters of its own over the same base."""
        backbone = models.lora.combine(self.base, critic_params["backbone"])
        return self.inner.values({**critic_params, "backbone": backbone}, rows)


def over_base(
    policy: TeacherForcing, base: models.Params | None, *, dropout_key: jax.Array | None = None
) -> TeacherForcing:
    """``policy`` (a LoRA model's :class:`DecoderTeacherForcing`) over params that are adapters
    of ``base``, or ``policy`` itself when ``base`` is None. ``dropout_key``: the
    update's LoRA dropout, kept when the model's ``lora.dropout > 0``; the scoring passes take none."""
    if base is None:
        return policy
    if dropout_key is not None and not policy.model.config.lora.dropout > 0:
        dropout_key = None
    return AdaptedTeacherForcing(policy, base, dropout_key)


def fold_dropout_key(policy: TeacherForcing, index: jax.Array) -> TeacherForcing:
    """``policy`` with its LoRA dropout key folded with ``index`` (a minibatch's or a
    micro-batch's number: each draws its own masks); ``policy`` itself without one."""
    if not isinstance(policy, AdaptedTeacherForcing) or policy.dropout_key is None:
        return policy
    return dataclasses.replace(policy, dropout_key=jax.random.fold_in(policy.dropout_key, index))


def is_on_policy(algorithm: algorithms.Algorithm, config: TrainConfig) -> bool:
    """Whether the step's one gradient is taken at the params that sampled the batch
    (``num_iterations = 1`` and one minibatch): then the old log-probs are the policy's own."""
    return algorithm.num_iterations * config.num_minibatches == 1


def policy_loss(
    params,
    rows: ScoredBatch,
    *,
    policy: TeacherForcing,
    algorithm: algorithms.Algorithm,
    on_policy: bool,
    old_logp: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)`` of the method on some rows at ``params``; ``old_logp`` ``[b, N]``
    overrides the rows' (and ``on_policy``). Runs with a reference also report ``kl_k3``
    (k3 to the reference)."""
    n = rows.completion_tokens.shape[1]
    logp, entropy = policy.logprobs(policy.states(params, rows), policy.head(params), rows, with_entropy=True)
    if old_logp is None:
        old_logp = jax.lax.stop_gradient(logp) if on_policy else rows.old_logp
    if algorithm.entropy_coef == 0:
        entropy = jax.lax.stop_gradient(entropy)  # a metric only
    loss, metrics = algorithms.policy_loss(
        algorithm,
        logp,
        old_logp,
        rows.advantages,
        rows.completion_mask,
        ref_logp=rows.ref_logp,
        entropy=entropy,
        max_len=n,
    )
    if rows.ref_logp is not None and "kl_k3" not in metrics:  # the KL metric of every run with a reference
        metrics["kl_k3"] = ops.masked_mean(jax.lax.stop_gradient(kl.k3(logp, rows.ref_logp)), rows.completion_mask)
    return loss, metrics


def critic_loss(
    critic_params, rows: ScoredBatch, *, policy: TeacherForcing, algorithm: algorithms.Algorithm
) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)``: the clipped value loss (:func:`jaxrl_llm.objectives.value_loss`)."""
    return objectives.value_loss(
        policy.values(critic_params, rows),
        rows.old_values,
        rows.returns,
        rows.completion_mask,
        clip=algorithm.value_clip,
    )
