"""The batches a train step consumes: a rollout with its rewards (:class:`Batch`), then
with everything the update needs (:class:`ScoredBatch`), and how their rows are cut.

A batch carries each of its ``P`` prompts once, ``[P, S]``, beside the ``B = P G``
completions ``[B, N]``: row ``b`` continues prompt ``b // G``. Split over devices, a group
stays with its prompt (:func:`batch_shardings`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import distributed, sharding
from jaxrl_llm.advantages import RunningMeanState


class Batch(NamedTuple):
    """A rollout batch with its rewards, as ``score`` consumes it: ``P`` prompts, each
    carried once, and their ``G`` completions (``B = P * G``, row ``b`` of prompt ``b // G``)."""

    prompt_tokens: jax.Array  # [P, S] int32, left-padded
    prompt_mask: jax.Array  # [P, S] bool: real prompt tokens
    completion_tokens: jax.Array  # [B, N] int32
    completion_mask: jax.Array  # [B, N] bool: tokens that enter the loss
    sampling_logp: jax.Array  # [B, N] float32: log pi_T of the sampler (Rollout.logprobs)
    rewards: jax.Array  # [B] float32
    prompts_drawn: jax.Array  # [] int32: prompts taken from the task's stream for it (refills included)

    @classmethod
    def from_rollout(
        cls,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        rollout,
        rewards: jax.Array,
        *,
        prompts_drawn: int | None = None,
    ) -> Batch:
        """The batch of a :class:`jaxrl_llm.sampling.Rollout` of ``prompt_tokens`` /
        ``prompt_mask`` ``[P, S]`` with its ``rewards`` ``[B]``; ``prompts_drawn``
        defaults to ``P``."""
        num_prompts = prompt_tokens.shape[0]
        return cls(
            prompt_tokens=jnp.asarray(prompt_tokens),
            prompt_mask=jnp.asarray(prompt_mask, bool),
            completion_tokens=jnp.asarray(rollout.completion_tokens),
            completion_mask=jnp.asarray(rollout.completion_mask),
            sampling_logp=jnp.asarray(rollout.logprobs),
            rewards=jnp.asarray(rewards, jnp.float32),
            prompts_drawn=jnp.asarray(num_prompts if prompts_drawn is None else prompts_drawn, jnp.int32),
        )


class ScoredBatch(NamedTuple):
    """A batch with everything ``update`` needs; ``None`` fields are not used by the run."""

    prompt_tokens: jax.Array  # [P, S] int32
    prompt_mask: jax.Array  # [P, S] bool
    completion_tokens: jax.Array  # [B, N] int32
    completion_mask: jax.Array  # [B, N] bool
    old_logp: jax.Array  # [B, N] float32: log pi_old (the sampler's when on-policy)
    ref_logp: jax.Array | None  # [B, N] float32; None without a reference
    advantages: jax.Array  # [B] or [B, N] float32
    returns: jax.Array | None  # [B, N] float32: the critic's targets (GAE)
    old_values: jax.Array | None  # [B, N] float32: the critic's values at scoring time
    baseline: RunningMeanState  # the running baseline after this batch
    prompts_drawn: jax.Array  # [] int32


_PROMPT_FIELDS = ("prompt_tokens", "prompt_mask")
_ROW_FIELDS = ("completion_tokens", "completion_mask", "old_logp", "ref_logp", "advantages", "returns", "old_values")


def rows_with_own_prompts(scored: ScoredBatch, rows: jax.Array) -> ScoredBatch:
    """The rows ``rows`` ``[b]`` of ``scored``, each with its own copy of its prompt
    (``P = b``): shuffled minibatches mix groups."""
    group = scored.completion_tokens.shape[0] // scored.prompt_tokens.shape[0]
    return scored._replace(
        **{name: getattr(scored, name)[rows // group] for name in _PROMPT_FIELDS},
        **{name: getattr(scored, name)[rows] for name in _ROW_FIELDS if getattr(scored, name) is not None},
    )


def micro_batches(scored: ScoredBatch, parts: int) -> ScoredBatch:
    """``scored`` cut into ``parts`` consecutive micro-batches: every row and prompt field
    gets a leading ``[parts]`` axis. Micro-batches that would split a group carry a prompt
    per row. The batch's own fields (``baseline``, ``prompts_drawn``) are ``None``."""
    num_prompts, batch = scored.prompt_tokens.shape[0], scored.completion_tokens.shape[0]
    group = batch // num_prompts
    if (batch // parts) % group:
        scored = scored._replace(**{name: jnp.repeat(getattr(scored, name), group, axis=0) for name in _PROMPT_FIELDS})
    split = {
        name: getattr(scored, name).reshape(parts, -1, *getattr(scored, name).shape[1:])
        for name in (*_PROMPT_FIELDS, *_ROW_FIELDS)
        if getattr(scored, name) is not None
    }
    return scored._replace(**split, baseline=None, prompts_drawn=None)


def batch_shardings(mesh: jax.sharding.Mesh) -> Batch:
    """Where a :class:`Batch` goes on ``mesh``: completions split by rows over ``data x
    fsdp``, prompts over ``data`` (a device's rows continue prompts of its ``data`` slice),
    the count replicated."""
    rows = distributed.rows_sharding(mesh)
    prompts = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(sharding.DATA if sharding.DATA in mesh.axis_names else None)
    )
    return Batch(
        prompt_tokens=prompts,
        prompt_mask=prompts,
        completion_tokens=rows,
        completion_mask=rows,
        sampling_logp=rows,
        rewards=rows,
        prompts_drawn=sharding.replicated(mesh),
    )
