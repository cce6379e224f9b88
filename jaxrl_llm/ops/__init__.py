"""Numerical building blocks: per-token log-probs, entropies and masked reductions.

Ops take ``jax.Array``s and return per-token ``[B, T]`` values; reduction to a scalar
happens in one place, :func:`aggregate`, with the mode named explicitly.
"""

from jaxrl_llm.ops.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate,
    aggregation_count,
    masked_max,
    masked_mean,
    masked_min,
    whiten,
)
from jaxrl_llm.ops.logprobs import chunked_categorical_kl, chunked_token_logprobs, entropy, token_logprobs
from jaxrl_llm.ops.trees import all_finite

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "aggregate",
    "aggregation_count",
    "all_finite",
    "chunked_categorical_kl",
    "chunked_token_logprobs",
    "entropy",
    "masked_max",
    "masked_mean",
    "masked_min",
    "token_logprobs",
    "whiten",
]
