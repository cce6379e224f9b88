r"""Supervised fine-tuning on demonstrations: the warm start before RL.

RL improves a policy that sometimes succeeds; a randomly initialised model almost never
does, and then every group's rewards tie and group baselines give no gradient. A few
steps of maximum likelihood on solved examples fix that:

.. math::
    L_{SFT}(\theta) = -\frac{1}{\sum_{i,t} m_{i,t}} \sum_{i,t} m_{i,t} \log \pi_\theta(y_{i,t} \mid y_{i,<t})
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import _checks, models, ops
from jaxrl_llm.training.optim import in_float32


def sft_loss(
    model: models.Model,
    params: models.Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    completion_mask: jax.Array,
    *,
    chunk_size: int = 256,
) -> jax.Array:
    """Token-mean negative log-likelihood of the completion tokens.

    Args:
      tokens: ``[B, S + N]``; attention_mask: ``[B, S + N]``.
      completion_mask: ``[B, N]``, the tokens to learn.
    """
    n = completion_mask.shape[1]
    logp = models.completion_logprobs(model, params, tokens, attention_mask, n, chunk_size=chunk_size)
    return -ops.aggregate(logp, completion_mask, mode="token-mean")


def supervised_finetune(
    model: models.Model,
    params: models.Params,
    tokens: np.ndarray,
    attention_mask: np.ndarray,
    completion_mask: np.ndarray,
    *,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 1e-2,
    seed: int = 0,
    stop: Callable[[int, models.Params], bool] | None = None,
    check_every: int = 25,
) -> tuple[models.Params, list[float]]:
    """Adam on :func:`sft_loss` over random minibatches of the demonstrations.

    Args:
      model, params: the model to fine-tune (``params`` is not modified).
      tokens, attention_mask, completion_mask: the demonstrations (``[D, S + N]``,
        ``[D, S + N]``, ``[D, N]``), e.g. ``DigitSumTask.demonstrations``.
      steps: optimizer steps.
      batch_size: demonstrations per step (sampled with replacement).
      learning_rate: Adam's learning rate.
      seed: seeds the minibatch draws.
      stop: called as ``stop(step, params)`` every ``check_every`` steps; returning True
        ends the fine-tuning early (e.g. once an accuracy target is met: a fixed step
        count is fragile, since when a small model leaves its loss plateau depends on
        float rounding).
      check_every: steps between calls of ``stop``.

    Returns:
      The fine-tuned params and the loss of each step taken.
    """
    fn = "supervised_finetune"
    _checks.positive_int(fn, "steps", steps)
    _checks.positive_int(fn, "batch_size", batch_size)
    _checks.positive(fn, "learning_rate", learning_rate)
    _checks.positive_int(fn, "check_every", check_every)
    optimizer = in_float32(optax.adam(learning_rate))  # bfloat16 params get float32 moments

    @jax.jit
    def step(params, opt_state, tokens, attention_mask, completion_mask):
        loss, grads = jax.value_and_grad(sft_loss, argnums=1)(model, params, tokens, attention_mask, completion_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    opt_state = optimizer.init(params)
    losses = []
    for step_index in range(steps):
        if stop is not None and step_index % check_every == 0 and stop(step_index, params):
            break
        rows = rng.integers(0, tokens.shape[0], size=batch_size)
        params, opt_state, loss = step(
            params,
            opt_state,
            jnp.asarray(tokens[rows]),
            jnp.asarray(attention_mask[rows]),
            jnp.asarray(completion_mask[rows]),
        )
        losses.append(float(loss))
    return params, losses
