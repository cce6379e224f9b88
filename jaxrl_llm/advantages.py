r"""Advantage estimators: how much better a response was than expected.

Sequence-level estimators take rewards ``[B]`` or, when they compare within a group,
``[P, G]`` (``P`` prompts, ``G`` responses each, row ``p`` holding prompt ``p``'s group);
they return advantages of the same shape. Reshape ``[P, G] -> [B = P * G]`` to feed an
objective, which broadcasts a per-sequence advantage over the response's tokens.
:func:`gae` (PPO with a critic) and :func:`reinforce_plus_plus` are token-level: they
take a ``[B, T]`` completion mask and return ``[B, T]``.

Everything is computed in float32 and is meant to be used under ``stop_gradient``
(the objectives apply it): advantages are constants of the policy update.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.ops import aggregation

GroupScale = Literal["group", "batch", "none"]
GROUP_SCALES: tuple[str, ...] = get_args(GroupScale)
GroupMeanOf = Literal["reward", "sequence_return"]
GROUP_MEAN_OF: tuple[str, ...] = get_args(GroupMeanOf)


def _rewards(fn: str, rewards: jax.Array) -> jax.Array:
    rewards = jnp.asarray(rewards)
    if not jnp.issubdtype(rewards.dtype, jnp.number) or jnp.issubdtype(rewards.dtype, jnp.complexfloating):
        raise TypeError(f"{fn}: `rewards` must be a real-valued array; got dtype {rewards.dtype}.")
    return rewards.astype(jnp.float32)


def _grouped(fn: str, rewards: jax.Array, *, min_group: int) -> jax.Array:
    rewards = _rewards(fn, rewards)
    _checks.rank(fn, "rewards", rewards, 2, "[P, G] (prompts x responses per prompt)")
    if rewards.shape[1] < min_group:
        raise ValueError(
            f"{fn}: needs at least {min_group} responses per prompt (G = rewards.shape[1]); "
            f"got rewards of shape {list(rewards.shape)}."
        )
    return rewards


def _centered(rewards: jax.Array, axis: int | None) -> jax.Array:
    """``rewards - mean`` along ``axis``, exactly 0 where all rewards there are equal.

    A float32 mean of identical values can be off by an ulp; divided by a standard
    deviation near 0 (plus eps), that ulp would become an advantage of order 0.1.
    """
    keepdims = axis is not None
    spread = jnp.max(rewards, axis=axis, keepdims=keepdims) - jnp.min(rewards, axis=axis, keepdims=keepdims)
    centered = rewards - jnp.mean(rewards, axis=axis, keepdims=keepdims)
    return jnp.where(spread == 0, 0.0, centered)  # `== 0`, not `<= 0`: a NaN must propagate


def _safe_divide(centered: jax.Array, scale: jax.Array) -> jax.Array:
    """``centered / scale``, 0 where ``scale`` is 0 (then ``centered`` is 0 too, eps = 0).
    A NaN propagates: a broken reward must reach the update's non-finite check."""
    zero = scale == 0
    return jnp.where(zero, 0.0, centered / jnp.where(zero, 1.0, scale))


def reinforce(rewards: jax.Array) -> jax.Array:
    r"""Plain policy gradient: :math:`A_i = R_i`.

    Args:
      rewards: ``[...]`` rewards, typically ``[B]``.

    Returns:
      float32 advantages, same shape.
    """
    return _rewards("reinforce", rewards)


def baseline(rewards: jax.Array, b: jax.Array | float) -> jax.Array:
    r"""REINFORCE with a baseline: :math:`A_i = R_i - b`.

    Args:
      rewards: ``[B]`` rewards.
      b: a scalar baseline, or ``[B]`` per-sample baselines (e.g. a critic's values).

    Returns:
      ``[B]`` float32 advantages.
    """
    fn = "baseline"
    rewards = _rewards(fn, rewards)
    b = jnp.asarray(b, dtype=jnp.float32)
    if b.ndim and b.shape != rewards.shape:
        raise ValueError(
            f"{fn}: `b` must be a scalar or have the shape of `rewards`, {list(rewards.shape)}; got {list(b.shape)}."
        )
    return rewards - b


def batch_mean_baseline(rewards: jax.Array) -> jax.Array:
    r""":math:`A_i = R_i - \frac1B\sum_j R_j`, the batch's own mean as the baseline. ``[B] -> [B]``."""
    rewards = _rewards("batch_mean_baseline", rewards)
    return rewards - jnp.mean(rewards)


class RunningMeanState(NamedTuple):
    """State of a running-mean baseline; a pytree, so it lives in the train state."""

    mean: jax.Array  # [] float32: the current baseline b.
    count: jax.Array  # [] int32: rewards seen so far.


def running_mean_init() -> RunningMeanState:
    """An empty running mean: ``b = 0`` until the first :func:`running_mean_update`."""
    return RunningMeanState(mean=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32))


def running_mean_update(
    state: RunningMeanState,
    rewards: jax.Array,
    *,
    decay: float | None = None,
) -> RunningMeanState:
    r"""Folds a batch of rewards into the running-mean baseline.

    With :math:`\bar R` the batch mean over its :math:`n` rewards:

    .. math::
        b \leftarrow \begin{cases}
          b + \frac{n}{N + n}(\bar R - b) & \text{decay = None (mean of all rewards seen)} \\
          \gamma b + (1-\gamma) \bar R & \text{decay} = \gamma \text{ (exponential)}
        \end{cases}

    The first update sets :math:`b = \bar R` in both cases (no bias towards the initial 0).
    Use the state's mean from *before* the update as the baseline for a batch, so that
    no response's own reward is in its baseline:

    .. code-block:: python

        adv = advantages.baseline(rewards, state.mean)
        state = advantages.running_mean_update(state, rewards, decay=0.9)

    Args:
      state: the current :class:`RunningMeanState`.
      rewards: ``[...]`` rewards of this batch.
      decay: ``None`` for the cumulative mean, or :math:`\gamma \in [0, 1)` for an
        exponential moving average.

    Returns:
      The updated state.
    """
    fn = "running_mean_update"
    rewards = _rewards(fn, rewards)
    if decay is not None:
        _checks.in_range(fn, "decay", decay, 0.0, 1.0, closed="[)")
    n = rewards.size
    batch_mean = jnp.mean(rewards)
    if decay is None:
        weight = n / (state.count + n).astype(jnp.float32)
    else:
        weight = jnp.where(state.count > 0, 1.0 - decay, 1.0)
    mean = state.mean + weight * (batch_mean - state.mean)
    return RunningMeanState(mean=mean, count=state.count + n)


def rloo(rewards: jax.Array) -> jax.Array:
    r"""REINFORCE leave-one-out (Ahmadian et al., 2024; Kool et al., 2019).

    .. math::
        b_i = \frac{1}{G-1}\sum_{j \ne i} R_j, \qquad A_i = R_i - b_i
            = \frac{G}{G-1}\,(R_i - \mu_G)

    Args:
      rewards: ``[P, G]`` rewards, ``G >= 2`` responses per prompt.

    Returns:
      ``[P, G]`` float32 advantages; each group sums to zero.
    """
    rewards = _grouped("rloo", rewards, min_group=2)
    group = rewards.shape[1]
    # R_i - (sum_j R_j - R_i) / (G - 1) = G / (G - 1) * (R_i - mu_G), computed in the
    # second form so that identical rewards give exactly 0.
    return group / (group - 1) * _centered(rewards, axis=1)


def grpo(
    rewards: jax.Array,
    *,
    eps: float = 1e-6,
    ddof: int = 0,
    scale: GroupScale = "group",
) -> jax.Array:
    r"""Group-relative advantages (Shao et al., 2024, DeepSeekMath).

    .. math::
        A_i = \frac{R_i - \mu_G}{\sigma + \epsilon}, \qquad
        \mu_G = \frac1G \sum_{j=1}^G R_j, \qquad
        \sigma_G = \sqrt{\frac{1}{G - \text{ddof}} \sum_{j=1}^G (R_j - \mu_G)^2}

    ``ddof=0`` is the population standard deviation, our default (Shao et al., 2024,
    "DeepSeekMath", write :math:`\operatorname{std}(r)` without saying which); ``ddof=1`` the
    sample standard deviation of TRL, verl and Tunix. ``scale`` chooses :math:`\sigma`:

    * ``"group"``: :math:`\sigma = \sigma_G`, per group (GRPO).
    * ``"batch"``: the standard deviation of all ``P * G`` rewards (group mean, batch
      std; Liu et al. 2025 "Part I: Tricks or Traps?", TRL's ``scale_rewards="batch"``).
    * ``"none"``: :math:`A_i = R_i - \mu_G` (Dr. GRPO; ``eps`` is unused).

    A group whose rewards are all equal gets advantages of exactly 0.

    Args:
      rewards: ``[P, G]`` rewards.
      eps: added to the standard deviation.
      ddof: delta degrees of freedom, ``0 <= ddof < G`` (``< P * G`` for ``"batch"``).
      scale: one of :data:`GROUP_SCALES`.

    Returns:
      ``[P, G]`` float32 advantages.
    """
    fn = "advantages.grpo"
    _checks.one_of(fn, "scale", scale, GROUP_SCALES)
    _checks.nonnegative(fn, "eps", eps)
    _checks.nonnegative_int(fn, "ddof", ddof)
    rewards = _grouped(fn, rewards, min_group=1)
    num_prompts, group = rewards.shape
    pool = group if scale == "group" else num_prompts * group
    if scale != "none" and ddof >= pool:
        raise ValueError(
            f"{fn}: `ddof` must be < the number of rewards per standard deviation "
            f"({pool} with scale={scale!r}); got ddof={ddof}."
        )
    centered = _centered(rewards, axis=1)  # [P, G]
    if scale == "none":
        return centered
    if scale == "group":
        std = jnp.std(rewards, axis=1, keepdims=True, ddof=ddof)  # [P, 1]
    else:
        std = jnp.std(rewards, ddof=ddof)  # []
    return _safe_divide(centered, std + eps)


def token_rewards(rewards: jax.Array, mask: jax.Array, *, kl_penalty: jax.Array | None = None) -> jax.Array:
    r"""``[B, T]`` per-token rewards: :math:`r_{i,t} = R_i\,[t = |o_i|] - \kappa_{i,t}`.

    The sequence reward ``[B]`` goes on each response's last valid token of the ``[B, T]``
    mask (right-padded, or with gaps: tool outputs in a multi-turn rollout; nowhere for
    an empty row), minus the per-token penalty :math:`\kappa` (``[B, T]``, e.g.
    ``c * k1``) at valid tokens; 0 at masked ones.
    """
    mask = mask.astype(bool)
    length = mask.shape[1]
    last = jnp.where(jnp.any(mask, axis=1), length - 1 - jnp.argmax(mask[:, ::-1], axis=1), -1)  # [B]; -1: none
    at_last_token = jax.nn.one_hot(last, length, dtype=jnp.float32)  # [B, T]
    penalty = 0.0 if kl_penalty is None else jnp.where(mask, kl_penalty, 0.0)
    return at_last_token * jnp.asarray(rewards, jnp.float32)[:, None] - penalty


def reinforce_plus_plus(
    rewards: jax.Array,
    mask: jax.Array,
    *,
    kl_penalty: jax.Array | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
    subtract_group_mean: bool = False,
    group_mean_of: GroupMeanOf = "reward",
    ddof: int = 0,
    eps_placement: aggregation.EpsPlacement = "std",
) -> jax.Array:
    r"""REINFORCE++ (Hu et al., 2025): returns to go, whitened over the batch's valid tokens.

    .. math::
        r_{i,t} = R'_i\,[t = |o_i|] - \kappa_{i,t}, \qquad
        G_{i,t} = \sum_{s \ge t} \gamma^{s-t} r_{i,s}, \qquad
        A_{i,t} = \frac{G_{i,t} - \operatorname{mean}(G)}{\operatorname{std}(G) + \epsilon}

    with :math:`R'_i = R_i - \mu_{G(i)}` (the group mean subtracted, "REINFORCE++-baseline")
    if ``subtract_group_mean`` and :math:`R_i` otherwise, :math:`\kappa` the per-token
    KL penalty (``c * k1`` in the paper), sums over valid tokens, and the mean and
    population std taken over every valid token of the batch. Without a penalty and with
    :math:`\gamma = 1` every token of a response carries :math:`R'_i`, so longer
    responses weigh more in the statistics; one estimator for any penalty, continuous as
    it goes to 0. Rows whose mask is all zero are left out of the statistics.

    With ``subtract_group_mean``, ``group_mean_of`` names what the group mean is taken of:

    * ``"reward"`` (the default, OpenRLHF's REINFORCE++-baseline): :math:`R_i` alone, as
      above; the penalty then enters each token's return to go.
    * ``"sequence_return"`` (verl's): the sequence's penalised return
      :math:`S_i = R_i - \sum_t \kappa_{i,t}`, the sum of its token rewards (0 for an
      empty row, which holds no token to carry :math:`R_i`), and every valid token carries
      :math:`S_i - \mu_{G(i)}(S)` (no return to go, ``gamma`` unused) before the
      whitening. Without a penalty, with :math:`\gamma = 1` and no empty row the two are
      the same.

    Args:
      rewards: ``[B]`` sequence rewards, or ``[P, G]`` (groups in rows, ``B = P * G``;
        required for ``subtract_group_mean``).
      mask: ``[B, T]`` completion mask (right-padded, or with gaps).
      kl_penalty: ``[B, T]`` per-token penalty :math:`\kappa` (``None``: 0).
      gamma: discount per token, in ``[0, 1]``.
      eps: added to the standard deviation.
      subtract_group_mean: subtract each prompt's group mean from its rewards first.
      group_mean_of: ``"reward"`` or ``"sequence_return"`` (see above).
      ddof, eps_placement: the whitening's variance and where ``eps`` enters
        (:func:`jaxrl_llm.ops.whiten`: verl's, OpenRLHF's).

    Returns:
      ``[B, T]`` float32 advantages, 0 at masked positions.
    """
    fn = "reinforce_plus_plus"
    _checks.nonnegative(fn, "eps", eps)
    _checks.one_of(fn, "group_mean_of", group_mean_of, GROUP_MEAN_OF)
    grouped = _grouped(fn, rewards, min_group=1) if subtract_group_mean else None  # [P, G]
    of_returns = grouped is not None and group_mean_of == "sequence_return"
    rewards = _centered(grouped, axis=1) if grouped is not None and not of_returns else _rewards(fn, rewards)
    rewards = rewards.reshape(-1)  # [B]
    mask = _checks.mask(fn, mask, "mask", mask)  # [B, T] bool
    _checks.rank(fn, "mask", mask, 2, "[B, T]")
    if mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"{fn}: `mask` must have one row per reward, [B, T] with B = {rewards.shape[0]}; got {list(mask.shape)}."
        )
    penalty = (
        jnp.zeros(mask.shape, jnp.float32) if kl_penalty is None else _checks.floating(fn, "kl_penalty", kl_penalty)
    )
    _checks.same_shape(fn, "kl_penalty", penalty, "mask", mask)
    rewards_per_token = token_rewards(rewards, mask, kl_penalty=penalty)  # [B, T]
    if of_returns:  # verl: every token carries its sequence's penalised return, less its group's mean
        sequence_returns = jnp.sum(rewards_per_token, axis=1)  # [B]: 0 for an empty row
        centered = _centered(sequence_returns.reshape(grouped.shape), axis=1).reshape(-1)  # [B]
        returns_to_go = jnp.where(mask, centered[:, None], 0.0)  # [B, T]
    else:
        returns_to_go, _ = gae(rewards_per_token, jnp.zeros_like(rewards_per_token), mask, gamma=gamma, lam=1.0)
    return aggregation.whiten(returns_to_go, mask, eps=eps, ddof=ddof, eps_placement=eps_placement)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    r"""Generalised advantage estimation (Schulman et al., 2016) as a reverse ``lax.scan``.

    Over the valid tokens of each row, with :math:`t'` the next valid token after
    :math:`t` (and :math:`V_{t'} = A_{t'} = 0` past the last one, a terminal state):

    .. math::
        \delta_t = r_t + \gamma V_{t'} - V_t, \qquad
        A_t = \delta_t + \gamma \lambda A_{t'}, \qquad
        \hat R_t = A_t + V_t

    Masked positions are skipped, not treated as episode ends: for a right-padded
    completion this is the textbook recursion, and for interleaved tokens that are not
    actions (tool outputs in multi-turn rollouts) the trace passes over them. Rewards at
    masked positions are ignored. A completion truncated at the token limit is treated as
    terminal (no bootstrap), as in TRL and verl.

    Args:
      rewards: ``[B, T]`` per-token rewards (e.g. the score on the last valid token
        minus a per-token KL penalty).
      values: ``[B, T]`` critic values :math:`V_t` of the state before token ``t``.
      mask: ``[B, T]`` validity mask.
      gamma: discount, in ``[0, 1]``.
      lam: GAE :math:`\lambda`, in ``[0, 1]``.

    Returns:
      ``(advantages, returns)``, both ``[B, T]`` float32 and 0 at masked positions.
    """
    fn = "gae"
    rewards = _checks.floating(fn, "rewards", rewards)
    _checks.rank(fn, "rewards", rewards, 2, "[B, T]")
    values = _checks.floating(fn, "values", values)
    _checks.same_shape(fn, "values", values, "rewards", rewards)
    valid = _checks.mask(fn, mask, "rewards", rewards)  # [B, T] bool
    _checks.in_range(fn, "gamma", gamma, 0.0, 1.0)
    _checks.in_range(fn, "lam", lam, 0.0, 1.0)
    rewards = jnp.where(valid, rewards.astype(jnp.float32), 0.0)
    values = jnp.where(valid, jax.lax.stop_gradient(values).astype(jnp.float32), 0.0)

    def step(carry, xs):
        next_value, next_advantage = carry  # [B], [B]: at the next valid token.
        reward, value, is_valid = xs  # [B] each
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        carry = (jnp.where(is_valid, value, next_value), jnp.where(is_valid, advantage, next_advantage))
        return carry, jnp.where(is_valid, advantage, 0.0)

    batch = rewards.shape[0]
    init = (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32))
    # Scan over time: [B, T] -> [T, B], reversed.
    _, advantages = jax.lax.scan(step, init, (rewards.T, values.T, valid.T), reverse=True)
    advantages = advantages.T  # [T, B] -> [B, T]
    returns = jnp.where(valid, advantages + values, 0.0)
    return advantages, returns
