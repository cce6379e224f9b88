r"""PPO's critic: a scalar value head on its own copy of the policy's backbone.

Our choice (documented in docs/training.md): the critic does not share the policy's
backbone. A shared trunk would couple the two losses through one set of weights and
one optimizer state, and a value-loss coefficient would have to balance them; a separate
trunk, initialised from the policy as in InstructGPT, keeps PPO's policy update exactly
the objective of :mod:`jaxrl_llm.objectives` at the price of a second set of weights.

.. math::
    V_\phi(s_t) = w^\top h_\phi(s_t) + b

where :math:`h_\phi(s_t)` is the critic backbone's final-norm hidden state at the
position that predicts token :math:`t`. The head starts at zero, so :math:`V \equiv 0`
before the first update and the first advantages are the plain returns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import models

CriticParams = dict[str, Any]
"""``{"backbone": Params, "head": {"kernel": [E], "bias": []}}``."""


def init_critic(model: models.Model, params: models.Params) -> CriticParams:
    """A critic whose backbone is a copy of ``params`` and whose head is zero."""
    width = model.config.hidden_size
    return {
        "backbone": jax.tree.map(jnp.copy, params),
        "head": {"kernel": jnp.zeros((width,), jnp.float32), "bias": jnp.zeros((), jnp.float32)},
    }


def completion_values(
    model: models.Model,
    critic_params: CriticParams,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    completion_tokens: jax.Array,
    *,
    share_prompts: bool = True,
) -> jax.Array:
    """``[B, N]`` float32 values :math:`V(s_t)` of the states before each completion token.

    Args:
      model: the policy's model (the critic's backbone has its architecture).
      critic_params: from :func:`init_critic`.
      prompt_tokens: ``[P, S]`` left-padded prompts; prompt_mask: ``[P, S]``.
      completion_tokens: ``[B, N]``, ``G = B / P`` per prompt, adjacent (see
        :func:`jaxrl_llm.models.functional.group_completion_hidden_states`, which ``share_prompts``
        is passed to).
    """
    hidden = models.functional.group_completion_hidden_states(
        model, critic_params["backbone"], prompt_tokens, prompt_mask, completion_tokens, share_prompts=share_prompts
    )  # [B, N, E]
    head = critic_params["head"]
    return hidden.astype(jnp.float32) @ head["kernel"] + head["bias"]
