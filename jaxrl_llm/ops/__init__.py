"""Numerical building blocks: per-token log-probs, entropies and masked reductions.

Ops take ``jax.Array``s and return per-token ``[B, T]`` values; reduction to a scalar
happens in one place, :func:`aggregate`, with the mode named explicitly.

The package exports what a user calls; the library's own helpers stay in their modules
(``ops.aggregation.aggregation_count``, gradient accumulation's weights;
``ops.trees.all_finite``, the non-finite guard).
"""

from jaxrl_llm.ops.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate,
    masked_max,
    masked_mean,
    masked_min,
    whiten,
)
from jaxrl_llm.ops.logprobs import chunked_categorical_kl, chunked_token_logprobs, entropy, token_logprobs

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "aggregate",
    "chunked_categorical_kl",
    "chunked_token_logprobs",
    "entropy",
    "masked_max",
    "masked_mean",
    "masked_min",
    "token_logprobs",
    "whiten",
]
