r"""The losses of a train step on rows of a scored batch, and the teacher-forced passes they run.

Every pass reads the model at the completion tokens only: the hidden states before each
completion token (each prompt run once for its group when ``TrainConfig.share_prompts``,
:func:`jaxrl_llm.models.group_completion_hidden_states`), then log-probs chunked over the
tokens from the output projection as stored (a tied embedding stays ``[V, E]``).

:func:`policy_loss` is the method's loss (:func:`jaxrl_llm.algorithms.policy_loss`) at
params :math:`\theta`, with :math:`\log\pi_{old} = \operatorname{sg}(\log\pi_\theta)` when
the step is on-policy (:func:`is_on_policy`); :func:`critic_loss` is PPO's value loss.
"""

from __future__ import annotations

import jax

from jaxrl_llm import algorithms, kl, models, objectives, ops
from jaxrl_llm.objectives import Metrics
from jaxrl_llm.training import critic
from jaxrl_llm.training.batch import Batch, ScoredBatch
from jaxrl_llm.training.config import TrainConfig


def is_on_policy(algorithm: algorithms.Algorithm, config: TrainConfig) -> bool:
    """Whether the step's one gradient is taken at the params that sampled the batch
    (``num_iterations = 1`` and one minibatch): then the old log-probs are the policy's own."""
    return algorithm.num_iterations * config.num_minibatches == 1


def logprob_options(config: TrainConfig) -> dict:
    """The options of every chunked log-prob and KL pass of the run."""
    return dict(chunk_size=config.chunk_size, temperature=config.temperature)


def output_kernel(model: models.Model, params: models.Params) -> jax.Array:
    """The output projection as stored: a tied embedding stays ``[V, E]`` (no transposed copy)."""
    return models.output_kernel(model, params, as_stored=True)


def completion_hidden_states(model: models.Model, params: models.Params, rows: Batch | ScoredBatch, *,
                             config: TrainConfig) -> jax.Array:
    """``[b, N, E]`` states before each completion token (each prompt once if shared)."""
    return models.group_completion_hidden_states(model, params, rows.prompt_tokens, rows.prompt_mask,
                                                 rows.completion_tokens, share_prompts=config.share_prompts)


def completion_logprobs(model: models.Model, params: models.Params, hidden: jax.Array, rows: Batch | ScoredBatch,
                        *, config: TrainConfig, **options):
    """``[b, N]`` log-probs of the completion tokens from ``hidden`` ``[b, N, E]``
    (:func:`jaxrl_llm.ops.chunked_token_logprobs`; ``options`` such as ``with_entropy``)."""
    return ops.chunked_token_logprobs(hidden, output_kernel(model, params), rows.completion_tokens,
                                      transposed_kernel=model.config.tie_word_embeddings, **logprob_options(config),
                                      **options)


def completion_values(model: models.Model, critic_params: critic.CriticParams, rows: Batch | ScoredBatch, *,
                      config: TrainConfig) -> jax.Array:
    """``[b, N]``: the critic's value before each completion token."""
    return critic.completion_values(model, critic_params, rows.prompt_tokens, rows.prompt_mask,
                                    rows.completion_tokens, share_prompts=config.share_prompts)


def policy_loss(params: models.Params, rows: ScoredBatch, *, model: models.Model, algorithm: algorithms.Algorithm,
                config: TrainConfig, old_logp: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)`` of the method on some rows at ``params``; ``old_logp`` ``[b, N]``
    overrides the rows'. Runs with a reference also report ``kl_k3`` (k3 to the reference)."""
    n = rows.completion_tokens.shape[1]
    logp, entropy = completion_logprobs(model, params, completion_hidden_states(model, params, rows, config=config),
                                        rows, config=config, with_entropy=True)
    if old_logp is None:
        old_logp = jax.lax.stop_gradient(logp) if is_on_policy(algorithm, config) else rows.old_logp
    if algorithm.entropy_coef == 0:
        entropy = jax.lax.stop_gradient(entropy)  # a metric only
    loss, metrics = algorithms.policy_loss(algorithm, logp, old_logp, rows.advantages, rows.completion_mask,
                                           ref_logp=rows.ref_logp, entropy=entropy, max_len=n)
    if rows.ref_logp is not None and "kl_k3" not in metrics:  # the KL metric of every run with a reference
        metrics["kl_k3"] = ops.masked_mean(jax.lax.stop_gradient(kl.k3(logp, rows.ref_logp)), rows.completion_mask)
    return loss, metrics


def critic_loss(critic_params: critic.CriticParams, rows: ScoredBatch, *, model: models.Model,
                algorithm: algorithms.Algorithm, config: TrainConfig) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)``: the clipped value loss (:func:`jaxrl_llm.objectives.value_loss`)."""
    return objectives.value_loss(completion_values(model, critic_params, rows, config=config), rows.old_values,
                                 rows.returns, rows.completion_mask, clip=algorithm.value_clip)
