r"""Gradient accumulation: one optimizer step's gradients from several forward and backward
passes, equal to the whole minibatch's.

A loss aggregated over a minibatch divides by a normaliser that spans it
(:func:`jaxrl_llm.ops.aggregation.aggregation_count`: tokens, sequences, ...). Micro-batch :math:`j`'s
loss :math:`L_j` divides by its own count :math:`n_j`, so the minibatch's loss is

.. math::
    L = \sum_j w_j L_j, \qquad w_j = \frac{n_j}{\max(n, 1)}, \qquad n = \sum_j n_j,

and its gradient the same sum of the micro-batches' gradients. Metrics combine likewise:
the loss's by :math:`w_j`, token means by the micro-batch's share of the tokens, ``*_min``
and ``*_max`` by min and max.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives import Metrics
from jaxrl_llm.ops.aggregation import aggregation_count

LossMetricsGrads = tuple[jax.Array, Metrics, object]
"""One objective's ``(loss, metrics, grads)``."""

LOSS_METRICS = ("loss", "policy_loss")
"""Metrics aggregated like the loss; the others are token means (:func:`jaxrl_llm.ops.masked_mean`)."""


def _share(part_mask: jax.Array, whole_mask: jax.Array, mode: str) -> jax.Array:
    """``[]``: the part's share of the whole's normaliser under aggregation ``mode``."""
    return aggregation_count(part_mask, mode=mode) / jnp.maximum(aggregation_count(whole_mask, mode=mode), 1.0)


def combine_metrics(metrics: Metrics, loss_weights: jax.Array, token_weights: jax.Array) -> Metrics:
    """Per-micro-batch metrics ``[k]`` -> the whole minibatch's: min of ``*_min``, max of
    ``*_max``, the loss weighted by its normaliser's shares (``loss_weights`` ``[k]``), the
    token means by the tokens' (``token_weights``); each set of weights sums to 1, or is 0."""

    def combine(name, values):
        if name.endswith("_min"):
            return jnp.min(values)
        if name.endswith("_max"):
            return jnp.max(values)
        weights = loss_weights if name in LOSS_METRICS else token_weights
        return jnp.sum(values * weights.astype(values.dtype))

    return {name: combine(name, values) for name, values in metrics.items()}


def accumulate_gradients(
    value_and_grads: Callable[[object, jax.Array], Sequence[LossMetricsGrads]],
    parts,
    *,
    completion_mask: jax.Array,
    modes: Sequence[str],
    params: Sequence[object],
) -> tuple[LossMetricsGrads, ...]:
    """Each objective's ``(loss, metrics, grads)`` over the rows of ``parts``, one pass per part.

    Args:
      value_and_grads: ``(rows, index)`` -> one ``(loss, metrics, grads)`` per objective (the
        policy's, then the critic's, ...), on the rows given, the ``index``-th micro-batch
        (``[]`` int32: what draws its own randomness, LoRA dropout's masks, folds in).
      parts: the micro-batches, every leaf with a leading ``[k]`` axis, with a
        ``completion_mask`` ``[k, b, N]`` (:func:`jaxrl_llm.training.batch.micro_batches`).
      completion_mask: ``[B, N]``, the whole minibatch's (``B = k b``).
      modes: each objective's aggregation mode (:func:`jaxrl_llm.ops.aggregate`).
      params: each objective's params (the structure of its gradient).

    Returns:
      One ``(loss, metrics, grads)`` per objective, the gradient float32, in one ``lax.scan``.
    """

    def accumulate(totals, numbered):
        part, index = numbered
        results = value_and_grads(part, index)
        tokens = _share(part.completion_mask, completion_mask, "token-mean")
        sums, outputs = [], []
        for (loss, metrics, grads), (loss_sum, grad_sum), mode in zip(results, totals, modes):
            weight = _share(part.completion_mask, completion_mask, mode)
            loss_sum = loss_sum + weight * loss
            grad_sum = jax.tree.map(lambda total, g, w=weight: total + w * g.astype(jnp.float32), grad_sum, grads)
            sums.append((loss_sum, grad_sum))
            outputs.append((metrics, weight, tokens))
        return tuple(sums), tuple(outputs)

    totals = tuple(
        (jnp.zeros((), jnp.float32), jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)) for tree in params
    )
    count = jax.tree.leaves(parts)[0].shape[0]
    sums, outputs = jax.lax.scan(accumulate, totals, (parts, jnp.arange(count, dtype=jnp.int32)))
    return tuple(
        (loss, combine_metrics(metrics, weights, tokens), grads)
        for (loss, grads), (metrics, weights, tokens) in zip(sums, outputs)
    )
