r"""The named methods, each a frozen config that picks parts of the functional core.

A method is not a class hierarchy: it is an advantage estimator, a policy objective, an
aggregation mode, a KL term and an update rule. The presets below are the six classic
methods (policy gradient, REINFORCE with a baseline, RLOO, TRPO, PPO, GRPO) and the
modern variants; any other combination is one ``dataclasses.replace`` away (RLOO
advantages with PPO clipping, GRPO with a KL penalty, ...):

.. code-block:: python

    from jaxrl_llm import algorithms
    rloo_ppo = dataclasses.replace(algorithms.RLOO, name="rloo-ppo", objective="ppo_clip",
                                   agg="token-mean", num_iterations=2)

Two pure functions turn a config into numbers; trainers call these, not the parts:

* :func:`compute_advantages`: rewards ``[B]`` (plus log-probs for a KL penalty in the
  reward, and a critic's values for GAE) -> advantages ``[B]`` or ``[B, N]``; its
  sequence-level core is :func:`sequence_advantages`, rewards ``[P, G]`` -> ``[P * G]``;
* :func:`policy_loss`: per-token log-probs -> ``(loss, metrics)``, with the KL and
  entropy terms the config asks for.

Conventions chosen where the papers leave room are documented on each field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks, objectives
from jaxrl_llm import advantages as adv_lib
from jaxrl_llm import kl as kl_lib
from jaxrl_llm.ops import aggregation

AdvantageEstimator = Literal[
    "reinforce", "batch_mean_baseline", "running_mean_baseline", "rloo", "grpo", "reinforce_pp", "gae"
]
PolicyObjective = Literal["policy_gradient", "ppo_clip", "cispo"]
ObjectiveAlias = Literal["grpo"]
UpdateRule = Literal["optax", "trpo"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
POLICY_OBJECTIVES: tuple[str, ...] = get_args(PolicyObjective)
OBJECTIVE_ALIASES: dict[str, str] = {"grpo": "ppo_clip"}
"""Aliases of an objective, accepted (config files, ``--algorithm.objective``, the configs
stored in run directories) and replaced by its name: ``"grpo"`` is the clipped surrogate,
:func:`jaxrl_llm.objectives.ppo_clip`."""
UPDATE_RULES: tuple[str, ...] = get_args(UpdateRule)
PeerLibrary = Literal["trl", "verl", "openrlhf"]
PEER_LIBRARIES: tuple[str, ...] = get_args(PeerLibrary)
VERL_DUAL_CLIP = 3.0
"""verl's ``clip_ratio_c``: the dual clip of its token-level actor loss (``compute_policy_loss_vanilla``)."""
VERL_GSPO_LOG_RATIO_CAP = 10.0
"""verl's cap on GSPO's sequence log-ratio (``compute_policy_loss_gspo``: ``clamp(max=10.0)``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
    """One RL post-training method as a choice of parts and their hyperparameters."""

    name: str
    """Display name, used in logs and tables."""

    # --- Advantages ---------------------------------------------------------------------
    advantage: AdvantageEstimator
    """How advantages are estimated: ``reinforce`` (A = R), ``batch_mean_baseline``,
    ``running_mean_baseline`` (state carried across steps), ``rloo``, ``grpo``,
    ``reinforce_pp`` (returns to go whitened over the batch's tokens) or ``gae`` (a
    learned critic)."""
    group_scale: adv_lib.GroupScale = "group"
    """``grpo`` only: divide by the group std, the batch std, or not at all (Dr. GRPO)."""
    std_ddof: int = 0
    """Every standard deviation the advantages take (``grpo``'s, and the whitening of
    ``gae`` and ``reinforce_pp``): 0 is the population std, 1 the sample std of
    TRL/verl/Tunix."""
    advantage_eps: float = 1e-6
    """``grpo``: added to the group's std; ``reinforce_pp``: its whitening's eps (where
    ``eps_placement`` puts it). ``gae``'s whitening uses a fixed 1e-8, every peer's."""
    eps_placement: aggregation.EpsPlacement = "std"
    """``gae`` and ``reinforce_pp`` whitening: its eps added to the std, added to the
    variance (verl's ``rsqrt(var + eps)``) or a floor under it (OpenRLHF's); see
    :func:`jaxrl_llm.ops.whiten`."""
    baseline_decay: float | None = 0.9
    """``running_mean_baseline`` only: EMA decay, or ``None`` for the mean of all rewards."""
    subtract_group_mean: bool = False
    """``reinforce_pp`` only: subtract each group's mean before whitening (-baseline)."""
    group_mean_of: adv_lib.GroupMeanOf = "reward"
    """``reinforce_pp`` with ``subtract_group_mean``: the mean of the rewards before the
    per-token returns (OpenRLHF's), or of the KL-penalised sequence returns, carried by
    every token (``"sequence_return"``, verl's); see
    :func:`jaxrl_llm.advantages.reinforce_plus_plus`."""
    gamma: float = 1.0
    """``gae`` and ``reinforce_pp``: discount per token."""
    lam: float = 0.95
    """``gae`` only: GAE lambda."""

    # --- Policy objective -----------------------------------------------------------------
    objective: Literal[PolicyObjective, ObjectiveAlias]
    """The per-token surrogate: ``policy_gradient``, ``ppo_clip`` (the one clipped
    surrogate: PPO, TRPO, GRPO, Dr. GRPO, DAPO, GSPO, REINFORCE++) or ``cispo``; see
    :mod:`jaxrl_llm.objectives`. ``"grpo"``, an alias of ``ppo_clip``, is accepted and
    becomes ``"ppo_clip"`` (:data:`OBJECTIVE_ALIASES`)."""
    agg: aggregation.AggregationMode
    """How per-token terms become the loss; see :func:`jaxrl_llm.ops.aggregate`."""
    eps_low: float | None = 0.2
    """Lower clip range (``None``: unbounded)."""
    eps_high: float | None = None
    """Upper clip range; ``None`` means equal to ``eps_low`` for ``ppo_clip`` (symmetric)
    and unbounded for ``cispo``."""
    dual_clip: float | None = None
    """``ppo_clip`` only: dual-clip constant c > 1 (Ye et al., 2020): a token with a
    negative advantage loses at most ``-c * A`` (at the sequence level: a response whose
    sequence ratio exceeds c); ``None``: off. verl's actor applies c = 3 at the token level."""
    ratio_level: objectives.RatioLevel = "token"
    """``ppo_clip`` only: ``sequence`` is GSPO's length-normalised sequence ratio."""
    log_ratio_cap: float = objectives.LOG_RATIO_LIMIT
    """``ppo_clip`` only: the upper clamp of the log-ratio before ``exp`` (the ratio is at
    most e^cap), in (0, 20]; the lower clamp is -20. verl caps GSPO's sequence log-ratio at 10."""

    # --- Regularisation ---------------------------------------------------------------------
    kl_coef: float = 0.0
    """beta of a KL-to-reference term in the loss, aggregated like the objective."""
    kl_estimator: kl_lib.KLEstimator = "k3"
    """Which sample estimator the loss's KL term uses."""
    kl_clamp: float | None = None
    """Clamp each of the loss's KL estimates to ``[-kl_clamp, kl_clamp]`` (verl's
    ``low_var_kl``: k3 with 10); ``None``: no clamp."""
    kl_reward_coef: float = 0.0
    """KL-to-reference penalty in the per-token reward (PPO, REINFORCE++): the trainer
    subtracts ``kl_reward_coef * k1`` from each token's reward before GAE."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""

    # --- Update -----------------------------------------------------------------------------
    update: UpdateRule = "optax"
    """``optax``: gradient steps; ``trpo``: natural-gradient steps with a KL line search."""
    num_iterations: int = 1
    """mu: optimisation passes over each rollout batch (1: on-policy, ratio = 1)."""
    max_kl: float = 0.01
    """``trpo`` only: trust-region radius delta on KL(pi_old || pi)."""
    cg_damping: float = 0.1
    """``trpo`` only: damping added to the Fisher matrix."""
    cg_iters: int = 10
    """``trpo`` only: conjugate-gradient iterations."""
    backtrack_coef: float = 0.8
    """``trpo`` only: line-search shrink factor."""
    max_backtracks: int = 10
    """``trpo`` only: line-search shrinks before giving up."""
    value_clip: float | None = 0.2
    """``gae`` only: the critic's value clip range."""

    # --- Sampling-side (DAPO) ---------------------------------------------------------------
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (they carry no signal under group baselines)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: length of the buffer before the token limit (0: off)."""
    overlong_penalty: float = 1.0
    """DAPO's soft overlong punishment: penalty at the token limit."""

    def __post_init__(self):
        def fail(message: str):
            raise ValueError(f"Algorithm {self.name!r}: {message}")

        def one_of(field: str, allowed: tuple[str, ...]):
            value = getattr(self, field)
            if value not in allowed:
                fail(f"`{field}` must be one of {', '.join(map(repr, allowed))}; got {value!r}.")

        if self.objective in OBJECTIVE_ALIASES:  # an alias (a stored config, a config file)
            object.__setattr__(self, "objective", OBJECTIVE_ALIASES[self.objective])
        one_of("advantage", ADVANTAGE_ESTIMATORS)
        one_of("objective", POLICY_OBJECTIVES)
        one_of("update", UPDATE_RULES)
        one_of("agg", aggregation.AGGREGATION_MODES)
        one_of("group_scale", adv_lib.GROUP_SCALES)
        one_of("group_mean_of", adv_lib.GROUP_MEAN_OF)
        one_of("eps_placement", aggregation.EPS_PLACEMENTS)
        one_of("ratio_level", objectives.RATIO_LEVELS)
        one_of("kl_estimator", kl_lib.KL_ESTIMATORS)
        where = f"Algorithm {self.name!r}"
        optional = ("eps_low", "eps_high", "dual_clip", "value_clip", "baseline_decay", "kl_clamp")  # None: off
        for field in (
            "advantage_eps",
            "gamma",
            "lam",
            "kl_coef",
            "kl_reward_coef",
            "entropy_coef",
            "max_kl",
            "cg_damping",
            "backtrack_coef",
            "overlong_penalty",
            "log_ratio_cap",
            *optional,
        ):
            if not (field in optional and getattr(self, field) is None):
                _checks.finite_number(where, field, getattr(self, field))
        for field in ("advantage_eps", "kl_coef", "kl_reward_coef", "entropy_coef", "cg_damping", "overlong_penalty"):
            _checks.nonnegative(where, field, getattr(self, field))
        for field in ("eps_low", "eps_high"):
            if getattr(self, field) is not None:
                _checks.nonnegative(where, field, getattr(self, field))
        for field in ("num_iterations", "cg_iters"):
            _checks.positive_int(where, field, getattr(self, field))
        for field in ("std_ddof", "max_backtracks", "overlong_buffer"):
            _checks.nonnegative_int(where, field, getattr(self, field))
        if self.baseline_decay is not None and not 0 <= self.baseline_decay < 1:
            fail(f"`baseline_decay` must be in [0, 1) or None; got {self.baseline_decay}.")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            fail(f"`kl_clamp` must be > 0 or None; got {self.kl_clamp}.")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            fail(f"`gamma` and `lam` must be in [0, 1]; got gamma={self.gamma}, lam={self.lam}.")
        if self.dual_clip is not None and not self.dual_clip > 1:
            fail(f"`dual_clip` must be > 1 or None; got {self.dual_clip}.")
        if self.dual_clip is not None and self.objective != "ppo_clip":
            fail(f"`dual_clip` applies to objective='ppo_clip' only; got objective={self.objective!r}.")
        if self.ratio_level != "token" and self.objective != "ppo_clip":
            fail(f"`ratio_level='sequence'` (GSPO) needs objective='ppo_clip'; got objective={self.objective!r}.")
        if not 0 < self.log_ratio_cap <= objectives.LOG_RATIO_LIMIT:
            fail(f"`log_ratio_cap` must be in (0, {objectives.LOG_RATIO_LIMIT}]; got {self.log_ratio_cap}.")
        if self.log_ratio_cap != objectives.LOG_RATIO_LIMIT and self.objective != "ppo_clip":
            fail(f"`log_ratio_cap` applies to objective='ppo_clip' only; got objective={self.objective!r}.")
        if self.value_clip is not None and not self.value_clip > 0:
            fail(f"`value_clip` must be > 0 or None; got {self.value_clip}.")
        if self.update == "trpo":
            _checks.positive(where, "max_kl", self.max_kl)
            if not 0 < self.backtrack_coef < 1:
                fail(f"`backtrack_coef` must be in (0, 1); got {self.backtrack_coef}.")
            if self.num_iterations != 1:
                fail("update='trpo' takes one natural-gradient step per batch: `num_iterations` must be 1.")

    @property
    def needs_critic(self) -> bool:
        """Whether the method learns a value function (GAE advantages)."""
        return self.advantage == "gae"

    @property
    def needs_reference(self) -> bool:
        """Whether reference-model log-probs are needed (a KL term in loss or reward)."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0

    @property
    def compares_within_groups(self) -> bool:
        """Whether the method compares each completion with the others of its prompt's group
        (group baselines, dynamic sampling): it needs ``G >= 2`` completions per prompt."""
        return (
            self.advantage in ("rloo", "grpo")
            or (self.advantage == "reinforce_pp" and self.subtract_group_mean)
            or self.dynamic_sampling
        )

    @property
    def needs_old_logp(self) -> bool:
        """Whether the objective reads log-probs of the sampling policy. With mu = 1 they
        equal the current ones at the single update, so a trainer may reuse them."""
        return self.objective != "policy_gradient" or self.update == "trpo"

    def matching(self, library: PeerLibrary) -> Algorithm:
        """This method with ``library``'s numerical conventions where they differ from the
        library's defaults (docs/methods.md, "Matching TRL, verl and OpenRLHF"):

        * ``"trl"`` (``GRPOTrainer``): GRPO's group std, the sample std plus 1e-4 (TRL's
          RLOO is ours; other methods are left as they are).
        * ``"verl"`` (``core_algos.py``): the group's sample std plus 1e-6; whitening
          ``(x - mean) * rsqrt(var_unbiased + 1e-8)``; ``seq-mean-token-sum-norm`` as
          verl computes it (``token-sum-norm``: no division by the rows); the loss's k3 as
          ``low_var_kl`` (clamped to 10); REINFORCE++-baseline's group mean taken of the
          KL-penalised sequence return; the actor's dual clip, ``dual_clip=3``
          (``clip_ratio_c``), on the token-level clipped surrogate trained by gradient
          steps (PPO, GRPO, Dr. GRPO, DAPO, REINFORCE++; a ``dual_clip`` already set is
          kept); GSPO's sequence log-ratio capped at 10 (``log_ratio_cap``), and no dual
          clip there, as verl's ``compute_policy_loss_gspo``.
        * ``"openrlhf"``: the group's sample std plus 1e-9; whitening with the population
          variance floored at 1e-8; every KL estimate in the loss clamped to 10.

        Everything else (the objective, its clip ranges, the coefficients) stays as set.
        """
        if library not in PEER_LIBRARIES:
            raise ValueError(
                f"Algorithm.matching: `library` must be one of {', '.join(map(repr, PEER_LIBRARIES))}; got {library!r}."
            )
        whitens = self.advantage in ("gae", "reinforce_pp")
        pp = self.advantage == "reinforce_pp"
        if library == "trl":
            changes = dict(std_ddof=1, advantage_eps=1e-4) if self.advantage == "grpo" else {}
        elif library == "verl":
            surrogate = self.objective == "ppo_clip" and self.update == "optax"
            token_surrogate = surrogate and self.ratio_level == "token"
            changes = dict(
                std_ddof=1,
                advantage_eps=1e-8 if pp else 1e-6,
                eps_placement="variance",
                group_mean_of="sequence_return",
                agg="token-sum-norm" if self.agg == "seq-mean-token-sum-norm" else self.agg,
                kl_clamp=10.0 if self.kl_estimator == "k3" else self.kl_clamp,
                dual_clip=VERL_DUAL_CLIP if token_surrogate and self.dual_clip is None else self.dual_clip,
                log_ratio_cap=VERL_GSPO_LOG_RATIO_CAP if self.ratio_level == "sequence" else self.log_ratio_cap,
            )
        else:
            changes = dict(
                std_ddof=0 if whitens else 1,
                advantage_eps=1e-8 if pp else 1e-9,
                eps_placement="variance_floor",
                kl_clamp=10.0,
            )
        return dataclasses.replace(self, **changes)


def sequence_advantages(
    algorithm: Algorithm,
    rewards: jax.Array,
    baseline: adv_lib.RunningMeanState | None = None,
) -> tuple[jax.Array, adv_lib.RunningMeanState | None]:
    """Advantages per response for every estimator but the token-level ``gae`` and ``reinforce_pp``.

    Args:
      algorithm: the method.
      rewards: ``[P, G]`` rewards, row ``p`` holding prompt ``p``'s group.
      baseline: the running-mean state (``running_mean_baseline`` only).

    Returns:
      ``(advantages [P * G], baseline)``: the flattened advantages, rows in the order of
      ``rewards.reshape(-1)``, and the baseline state after folding in this batch (the
      input unchanged for other estimators, and for a batch with a non-finite reward).
    """
    estimator = algorithm.advantage
    if estimator == "gae":
        raise ValueError(
            f"Algorithm {algorithm.name!r} uses GAE: its advantages come from "
            "`advantages.gae` with a critic's per-token values, not from sequence rewards."
        )
    if estimator == "reinforce_pp":
        raise ValueError(
            f"Algorithm {algorithm.name!r} uses REINFORCE++, whose advantages are per token (returns to go "
            "whitened over the batch's tokens): use `compute_advantages` with the completion mask."
        )
    if estimator == "reinforce":
        advantages = adv_lib.reinforce(rewards)
    elif estimator == "batch_mean_baseline":
        advantages = adv_lib.batch_mean_baseline(rewards)
    elif estimator == "running_mean_baseline":
        if baseline is None:
            raise ValueError(f"Algorithm {algorithm.name!r} needs the running baseline state (`baseline=`).")
        advantages = adv_lib.baseline(rewards, baseline.mean)  # the baseline from before this batch
        # A non-finite reward makes the advantages NaN, so the update skips this batch; it
        # must not enter the baseline either, or every later batch would be skipped too.
        folded = adv_lib.running_mean_update(baseline, rewards, decay=algorithm.baseline_decay)
        finite = jnp.all(jnp.isfinite(rewards))
        baseline = jax.tree.map(lambda new, old: jnp.where(finite, new, old), folded, baseline)
    elif estimator == "rloo":
        advantages = adv_lib.rloo(rewards)
    else:  # grpo
        advantages = adv_lib.grpo(
            rewards, eps=algorithm.advantage_eps, ddof=algorithm.std_ddof, scale=algorithm.group_scale
        )
    return advantages.reshape(-1), baseline


def compute_advantages(
    algorithm: Algorithm,
    rewards: jax.Array,
    mask: jax.Array,
    *,
    group_size: int,
    logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    values: jax.Array | None = None,
    baseline: adv_lib.RunningMeanState | None = None,
) -> tuple[jax.Array, jax.Array | None, adv_lib.RunningMeanState | None]:
    r"""Advantages of a rollout batch for any estimator, with the KL-in-reward penalty.

    With ``kl_reward_coef`` :math:`= c > 0` each token pays
    :math:`c\,k_1 = c(\log\pi_{old} - \log\pi_{ref})` (Ouyang et al., 2022), and the
    per-token reward is :math:`r_t = R\,[t = |o|] - c\,k_{1,t}`:

    * ``gae`` (PPO): :math:`A = \operatorname{whiten}(\operatorname{GAE}_{\gamma,\lambda}(r, V))`
      over the batch's valid tokens; ``returns`` :math:`= \operatorname{GAE} + V` are the
      critic's targets (unwhitened).
    * ``reinforce_pp`` (REINFORCE++, Hu 2025): the return to go
      :math:`A_t = \sum_{s \ge t} \gamma^{s-t} r_s` (after subtracting the group mean from
      :math:`R` if ``subtract_group_mean``), whitened over the batch's valid tokens, for
      any :math:`c \ge 0` (:func:`jaxrl_llm.advantages.reinforce_plus_plus`).
    * every other estimator works on sequence rewards :math:`R - c\sum_t k_{1,t}` through
      :func:`sequence_advantages`.

    Args:
      algorithm: the method.
      rewards: ``[B]`` sequence rewards, ``B = P * G`` with groups adjacent.
      mask: ``[B, N]`` completion mask (right-padded, or with gaps: tool outputs of a
        multi-turn rollout; the reward goes on each row's last valid token).
      group_size: ``G``.
      logp: ``[B, N]`` log-probs under the sampling policy (``kl_reward_coef > 0``).
      ref_logp: ``[B, N]`` reference log-probs (``kl_reward_coef > 0``).
      values: ``[B, N]`` critic values of the state before each token (``gae``).
      baseline: the running-mean state (``running_mean_baseline``).

    Rows whose mask is all zero are excluded from the per-token statistics (whitening);
    the sequence estimators' batch-wide statistics (batch mean, running mean, GRPO's
    ``group_scale="batch"``) take every row.

    Returns:
      ``(advantages, returns, baseline)``: advantages ``[B]`` (sequence estimators) or
      ``[B, N]`` (per-token paths), returns ``[B, N]`` for ``gae`` and ``None`` otherwise,
      and the baseline state after this batch.
    """
    mask = _checks.mask("compute_advantages", mask, "mask", mask)  # [B, N] bool
    _checks.rank("compute_advantages", "mask", mask, 2, "[B, N]")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"compute_advantages: `rewards` must have shape [B] with B = {mask.shape[0]} (the mask's "
            f"rows); got {list(rewards.shape)}."
        )
    if mask.shape[0] % group_size:
        raise ValueError(
            f"compute_advantages: the batch B = {mask.shape[0]} must be a multiple of group_size={group_size}."
        )
    penalty = jnp.zeros(mask.shape, jnp.float32)  # [B, N]: c * k1 per token
    if algorithm.kl_reward_coef > 0:
        if logp is None or ref_logp is None:
            raise ValueError(
                f"Algorithm {algorithm.name!r} has kl_reward_coef={algorithm.kl_reward_coef} > 0: pass `logp` and "
                "`ref_logp`."
            )
        penalty = jnp.where(mask, algorithm.kl_reward_coef * kl_lib.k1(logp, ref_logp), 0.0)
    if algorithm.advantage == "gae":
        if values is None:
            raise ValueError(f"Algorithm {algorithm.name!r} uses GAE: pass the critic's `values`.")
        token_rewards = adv_lib.token_rewards(rewards, mask, kl_penalty=penalty)  # [B, N]
        advantages, returns = adv_lib.gae(token_rewards, values, mask, gamma=algorithm.gamma, lam=algorithm.lam)
        return (
            aggregation.whiten(advantages, mask, ddof=algorithm.std_ddof, eps_placement=algorithm.eps_placement),
            returns,
            baseline,
        )
    if algorithm.advantage == "reinforce_pp":
        advantages = adv_lib.reinforce_plus_plus(
            rewards.reshape(-1, group_size),
            mask,
            kl_penalty=penalty,
            gamma=algorithm.gamma,
            eps=algorithm.advantage_eps,
            subtract_group_mean=algorithm.subtract_group_mean,
            group_mean_of=algorithm.group_mean_of,
            ddof=algorithm.std_ddof,
            eps_placement=algorithm.eps_placement,
        )
        return advantages, None, baseline
    sequence_rewards = rewards - jnp.sum(penalty, axis=1)
    advantages, baseline = sequence_advantages(algorithm, sequence_rewards.reshape(-1, group_size), baseline)
    return advantages, None, baseline


def policy_loss(
    algorithm: Algorithm,
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    max_len: int | None = None,
) -> tuple[jax.Array, objectives.Metrics]:
    r"""The method's policy loss: objective, plus :math:`\beta` KL, minus the entropy bonus.

    .. math::
        L = \operatorname{agg}\big[\ell^{\text{objective}}_{i,t}
            + \beta\, \widehat{D}_{KL}[\pi_\theta\|\pi_{\text{ref}}]_{i,t}\big]
            - c_H\, \operatorname{agg}[H_{i,t}]

    Args:
      algorithm: the method.
      logp: ``[B, T]`` log-probs under the policy being optimised.
      old_logp: ``[B, T]`` log-probs under the sampling policy (``policy_gradient``
        reads them for its ratio metrics only).
      advantages: ``[B]`` or ``[B, T]``.
      mask: ``[B, T]`` validity mask.
      ref_logp: ``[B, T]`` reference log-probs; required when ``kl_coef > 0``, the KL
        reported as ``kl_<kl_estimator>`` whenever given (:func:`objectives.kl_penalty`).
      entropy: ``[B, T]`` per-token entropies; required when ``entropy_coef > 0``.
      max_len: generation budget :math:`L` for ``agg="seq-mean-token-sum-norm"`` and
        ``"token-sum-norm"``.

    Returns:
      ``(loss, metrics)``.
    """
    common = dict(agg=algorithm.agg, max_len=max_len)
    if algorithm.objective == "policy_gradient":
        loss, metrics = objectives.policy_gradient(logp, advantages, mask, old_logp=old_logp, **common)
    elif algorithm.objective == "ppo_clip":
        loss, metrics = objectives.ppo_clip(
            logp,
            old_logp,
            advantages,
            mask,
            eps_low=algorithm.eps_low,
            eps_high=algorithm.eps_high,
            dual_clip=algorithm.dual_clip,
            ratio_level=algorithm.ratio_level,
            log_ratio_cap=algorithm.log_ratio_cap,
            **common,
        )
    else:  # cispo
        loss, metrics = objectives.cispo(
            logp, old_logp, advantages, mask, eps_low=algorithm.eps_low, eps_high=algorithm.eps_high, **common
        )

    if algorithm.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"Algorithm {algorithm.name!r} has kl_coef={algorithm.kl_coef} > 0: pass `ref_logp`.")
    if ref_logp is not None:
        penalty, kl_metrics = objectives.kl_penalty(
            logp,
            ref_logp,
            mask,
            coef=algorithm.kl_coef,
            estimator=algorithm.kl_estimator,
            clamp=algorithm.kl_clamp,
            **common,
        )
        loss = loss + penalty
        metrics.update(kl_metrics)
    if algorithm.entropy_coef > 0 or entropy is not None:
        if entropy is None:
            raise ValueError(
                f"Algorithm {algorithm.name!r} has entropy_coef={algorithm.entropy_coef} > 0: pass `entropy`."
            )
        bonus, entropy_metrics = objectives.entropy_bonus(entropy, mask, coef=algorithm.entropy_coef, **common)
        loss = loss + bonus
        metrics.update(entropy_metrics)
    metrics["loss"] = loss
    return loss, metrics


# --- Presets ----------------------------------------------------------------------------------

PG = Algorithm(name="pg", advantage="reinforce", objective="policy_gradient", agg="seq-mean-token-sum")
"""Policy gradient (REINFORCE, Williams 1992), :math:`L = -R_i \\sum_t \\log\\pi_\\theta`."""

REINFORCE_BASELINE = Algorithm(
    name="reinforce-baseline", advantage="running_mean_baseline", objective="policy_gradient", agg="seq-mean-token-sum"
)
"""REINFORCE with a running-mean (EMA 0.9) baseline carried in the train state."""

RLOO = Algorithm(name="rloo", advantage="rloo", objective="policy_gradient", agg="seq-mean-token-sum")
"""RLOO (Ahmadian et al., 2024): leave-one-out baseline,
:math:`-\\frac1G\\sum_i A_i \\sum_t \\log\\pi_\\theta`."""

PPO = Algorithm(
    name="ppo",
    advantage="gae",
    objective="ppo_clip",
    agg="token-mean",
    gamma=1.0,
    lam=0.95,
    kl_reward_coef=0.05,
    value_clip=0.2,
    num_iterations=2,
)
"""PPO (Schulman et al., 2017) with a critic: GAE on per-token rewards that include a k1 KL penalty to the
reference (Ouyang et al., 2022), clipped policy and value losses."""

TRPO = Algorithm(
    name="trpo",
    advantage="rloo",
    objective="ppo_clip",
    eps_low=None,
    eps_high=None,
    agg="token-mean",
    update="trpo",
    max_kl=0.01,
)
"""TRPO (Schulman et al., 2015): maximise :math:`\\mathbb{E}[\\rho A]` (the unclipped surrogate) subject to
:math:`D_{KL}(\\pi_{old}\\|\\pi_\\theta) \\le \\delta`. Advantages are leave-one-out (our
choice: critic-free, unbiased)."""

GRPO = Algorithm(name="grpo", advantage="grpo", objective="ppo_clip", agg="seq-mean-token-mean", kl_coef=0.04)
"""GRPO (Shao et al., 2024, eq. 3): group-normalised advantages, the clipped surrogate
averaged per response, and DeepSeekMath's k3 KL penalty (eq. 4, beta = 0.04)."""

DR_GRPO = Algorithm(
    name="dr-grpo", advantage="grpo", group_scale="none", objective="ppo_clip", agg="seq-mean-token-sum-norm"
)
"""Dr. GRPO (Liu et al., 2025): no std division, constant normaliser (no length bias), no KL."""

DAPO = Algorithm(
    name="dapo",
    advantage="grpo",
    objective="ppo_clip",
    eps_low=0.2,
    eps_high=0.28,
    agg="token-mean",
    dynamic_sampling=True,
    overlong_buffer=4096,
    overlong_penalty=1.0,
)
"""DAPO (Yu et al., 2025): clip-higher (0.2 / 0.28), token-level loss, dynamic sampling, soft overlong
punishment over the last 4096 tokens (the paper's, for a 20480-token budget), no KL.
Scale ``overlong_buffer`` with the generation budget (``dataclasses.replace``); the trainer
turns one longer than the budget into a fifth of it (:func:`jaxrl_llm.training.fit_overlong_buffer`)."""

GSPO = Algorithm(
    name="gspo",
    advantage="grpo",
    objective="ppo_clip",
    ratio_level="sequence",
    eps_low=3e-4,
    eps_high=4e-4,
    agg="seq-mean-token-mean",
)
"""GSPO (Zheng et al., 2025): sequence-level, length-normalised ratio with GSPO's clip range (3e-4 / 4e-4)."""

CISPO = Algorithm(name="cispo", advantage="grpo", objective="cispo", eps_low=None, eps_high=0.28, agg="token-mean")
"""CISPO: clipped, stop-gradient importance weights; no lower bound (MiniMax-M1). The
upper bound 0.28 is our choice (MiniMax-M1 does not publish its value)."""

REINFORCE_PP = Algorithm(
    name="reinforce++", advantage="reinforce_pp", objective="ppo_clip", agg="token-mean", kl_reward_coef=0.01
)
"""REINFORCE++ (Hu, 2025): returns to go of k1-KL-penalised token rewards, whitened over the batch's
tokens; PPO clipping."""

PRESETS: dict[str, Algorithm] = {
    a.name: a for a in (PG, REINFORCE_BASELINE, RLOO, PPO, TRPO, GRPO, DR_GRPO, DAPO, GSPO, CISPO, REINFORCE_PP)
}
"""All presets by name."""


def get(name: str) -> Algorithm:
    """The preset called ``name``; the error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"Unknown algorithm {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[name]


def preset_names(entries: Sequence[str]) -> tuple[str, ...]:
    """Preset names from command-line entries, each one name or several comma-separated
    (``["grpo", "ppo"]`` and ``["grpo,ppo"]`` are the same). Raises ValueError for an
    unknown name or none at all."""
    names = tuple(name.strip() for entry in entries for name in entry.split(",") if name.strip())
    if not names:
        raise ValueError(f"No method named; known: {', '.join(PRESETS)}.")
    for name in names:
        get(name)
    return names


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Algorithm",
    "CISPO",
    "DAPO",
    "DR_GRPO",
    "GRPO",
    "GSPO",
    "OBJECTIVE_ALIASES",
    "PG",
    "POLICY_OBJECTIVES",
    "PPO",
    "PRESETS",
    "REINFORCE_BASELINE",
    "REINFORCE_PP",
    "RLOO",
    "TRPO",
    "UPDATE_RULES",
    "compute_advantages",
    "get",
    "policy_loss",
    "sequence_advantages",
]
