"""``Algorithm.matching(peer)`` against loop implementations of TRL's, verl's and OpenRLHF's
published formulas, written here from their definitions (docs/methods.md, "Matching TRL, verl and
OpenRLHF"), in float64: advantages on batches with ties, a group of equal rewards and an
empty row, and losses (values and gradients) on masks with gaps."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, objectives
from tests import reference
from tests.test_objectives import assert_matches_reference

PEERS = algorithms.PEER_LIBRARIES
P, G, T = 3, 4, 6


def _batch(seed=0):
    """Rewards ``[P * G]`` with a tie and a group of equal rewards; a mask with an empty
    row and gaps (multi-turn: tool outputs between a response's tokens); log-probs,
    reference log-probs and values ``[P * G, T]``."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=P * G).round(1)
    rewards[1] = rewards[0]  # a tie
    rewards[G : 2 * G] = 0.5  # a group of equal rewards
    lengths = rng.integers(1, T + 1, size=P * G)
    lengths[2 * G + 1] = 0  # an empty row
    lengths[[0, 5]] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[0, 1:3] = mask[5, 4] = False  # gaps
    logp, ref_logp, values = (rng.normal(size=(P * G, T)) for _ in range(3))
    return rewards.astype(np.float32), mask, logp.astype(np.float32), ref_logp.astype(np.float32), values


# --- The peers' formulas, as loops ---------------------------------------------------------


def group_normalised(rewards, eps):
    """TRL, verl and OpenRLHF's GRPO: (R - mean) / (sample std + eps) within each group."""
    out = []
    for p in range(P):
        group = [float(r) for r in rewards[p * G : (p + 1) * G]]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return np.array(out)


def leave_one_out(rewards):
    """Every peer's RLOO: R_i - the mean of the group's other rewards."""
    out = []
    for p in range(P):
        group = [float(r) for r in rewards[p * G : (p + 1) * G]]
        out += [r - (sum(group) - r) / (G - 1) for r in group]
    return np.array(out)


def verl_whiten(values, mask):
    """verl's masked_whiten: (x - mean) * rsqrt(unbiased variance + 1e-8) over valid tokens."""
    return reference.whiten(values, mask, eps=1e-8, ddof=1, eps_placement="variance")


def openrlhf_whiten(values, mask):
    """OpenRLHF's normalisation: (x - mean) * rsqrt(max(population variance, 1e-8))."""
    return reference.whiten(values, mask, eps=1e-8, ddof=0, eps_placement="variance_floor")


def kl_token_rewards(rewards, mask, logp, ref_logp, coef):
    """R at each response's last token, minus coef * k1 at every valid token (all three peers)."""
    return reference.kl_penalised_token_rewards(rewards, mask, logp, ref_logp, coef)


def verl_reinforce_pp_baseline(rewards, mask, logp, ref_logp, coef):
    """verl: each response's summed token rewards, less its group's mean, at every valid
    token, whitened over the batch's tokens."""
    scores = kl_token_rewards(rewards, mask, logp, ref_logp, coef).sum(axis=1)
    out = np.zeros(mask.shape)
    for i in range(P * G):
        group = scores[(i // G) * G : (i // G + 1) * G]
        out[i, mask[i]] = scores[i] - group.mean()
    return verl_whiten(out, mask)


def openrlhf_reinforce_pp_baseline(rewards, mask, logp, ref_logp, coef):
    """OpenRLHF: the group mean of R alone subtracted, then R at the last token less the KL
    at each, returns to go (gamma 1), whitened over the batch's tokens."""
    centered = np.array(
        [float(r) - rewards[(i // G) * G : (i // G + 1) * G].astype(np.float64).mean() for i, r in enumerate(rewards)]
    )
    token_rewards = kl_token_rewards(centered, mask, logp, ref_logp, coef)
    return openrlhf_whiten(reference.returns_to_go(token_rewards, mask, 1.0), mask)


def verl_low_var_kl(logp, ref_logp):
    log_ratio = min(max(ref_logp - logp, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1.0, -10.0), 10.0)


def peer_grpo_loss(
    logp, old_logp, advantages, mask, ref_logp, beta, kl, agg, max_len, *, eps_low=0.2, eps_high=0.2, clip_ratio_c=None
):
    """-min(rho A, clip(rho) A) + beta * kl(logp, ref) per token, aggregated: a loop. With
    ``clip_ratio_c``, verl's actor loss (``compute_policy_loss_vanilla``): for A < 0 the
    token's loss is min(-c A, max(-rho A, -clip(rho) A)), its log-ratio clamped to +-20."""
    per = np.zeros(logp.shape)
    for i, t in np.ndindex(logp.shape):
        rho = math.exp(min(max(logp[i, t] - old_logp[i, t], -20.0), 20.0))
        a = advantages[i] if np.ndim(advantages) == 1 else advantages[i, t]
        loss = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
        if clip_ratio_c is not None and a < 0:
            loss = min(-a * clip_ratio_c, loss)
        per[i, t] = loss + (beta * kl(logp[i, t], ref_logp[i, t]) if beta else 0.0)
    if agg == "verl-seq-mean-token-sum-norm":  # the sum over the batch over the padded length
        return float((per * mask).sum()) / max_len
    return reference.aggregate(per, mask, agg, max_len)


def verl_gspo_loss(logp, old_logp, advantages, mask, eps_low, eps_high):
    """verl's ``compute_policy_loss_gspo``: the sequence's mean log-ratio clamped above at 10
    (no lower clamp, no dual clip), max(-s A, -clip(s) A) at each token, aggregated
    seq-mean-token-mean whatever the configured mode."""
    per = np.zeros(logp.shape)
    for i in range(logp.shape[0]):
        length = max(float(mask[i].sum()), 1.0)
        log_s = min(sum(float(logp[i, t] - old_logp[i, t]) * mask[i, t] for t in range(logp.shape[1])) / length, 10.0)
        s = math.exp(log_s)
        for t in range(logp.shape[1]):
            a = advantages[i]
            per[i, t] = max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high))
    return reference.aggregate(per, mask, "seq-mean-token-mean")


# --- Advantages ----------------------------------------------------------------------------


@pytest.mark.parametrize("peer, eps", [("trl", 1e-4), ("verl", 1e-6), ("openrlhf", 1e-9)])
def test_grpo_advantages_match_each_peer(peer, eps):
    rewards, mask, *_ = _batch()
    adv, _, _ = algorithms.compute_advantages(algorithms.GRPO.matching(peer), rewards, mask, group_size=G)
    np.testing.assert_allclose(adv, group_normalised(rewards, eps), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(adv)[G : 2 * G] == 0)  # equal rewards: exactly 0


@pytest.mark.parametrize("peer", PEERS)
def test_rloo_advantages_match_each_peer(peer):
    rewards, mask, *_ = _batch(1)
    adv, _, _ = algorithms.compute_advantages(algorithms.RLOO.matching(peer), rewards, mask, group_size=G)
    np.testing.assert_allclose(adv, leave_one_out(rewards), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("peer, whiten", [("verl", verl_whiten), ("openrlhf", openrlhf_whiten)])
def test_ppo_gae_advantages_match_each_peer(peer, whiten):
    rewards, mask, logp, ref_logp, values = _batch(2)
    method = algorithms.PPO.matching(peer)
    adv, returns, _ = algorithms.compute_advantages(
        method, rewards, mask, group_size=G, logp=logp, ref_logp=ref_logp, values=values.astype(np.float32)
    )
    token_rewards = kl_token_rewards(rewards, mask, logp, ref_logp, method.kl_reward_coef)
    expected, expected_returns = reference.gae(token_rewards, values, mask, method.gamma, method.lam)
    np.testing.assert_allclose(adv, whiten(expected, mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns, expected_returns, rtol=1e-5, atol=1e-6)  # before whitening


@pytest.mark.parametrize("peer", ["verl", "openrlhf"])
def test_reinforce_plus_plus_matches_each_peer(peer):
    rewards, mask, logp, ref_logp, _ = _batch(3)
    method = algorithms.REINFORCE_PP.matching(peer)
    adv, _, _ = algorithms.compute_advantages(method, rewards, mask, group_size=G, logp=logp, ref_logp=ref_logp)
    token_rewards = kl_token_rewards(rewards, mask, logp, ref_logp, method.kl_reward_coef)
    whiten = verl_whiten if peer == "verl" else openrlhf_whiten
    np.testing.assert_allclose(
        adv, whiten(reference.returns_to_go(token_rewards, mask, 1.0), mask), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "peer, expected", [("verl", verl_reinforce_pp_baseline), ("openrlhf", openrlhf_reinforce_pp_baseline)]
)
def test_reinforce_plus_plus_baseline_matches_each_peer(peer, expected):
    rewards, mask, logp, ref_logp, _ = _batch(4)
    method = dataclasses.replace(algorithms.REINFORCE_PP, subtract_group_mean=True).matching(peer)
    adv, _, _ = algorithms.compute_advantages(method, rewards, mask, group_size=G, logp=logp, ref_logp=ref_logp)
    np.testing.assert_allclose(
        adv, expected(rewards, mask, logp, ref_logp, method.kl_reward_coef), rtol=1e-5, atol=1e-6
    )


# --- Losses: values and gradients ----------------------------------------------------------


def _loss_batch(seed, *, empty_row=True):
    """Multi-turn masks with gaps, an empty row, and reference log-probs far enough from
    the policy's that verl's k3 clamp binds on some tokens."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(P * G, T)) - 0.05
    old_logp = logp + rng.normal(0.0, 0.3, size=logp.shape)
    ref_logp = logp + rng.normal(0.0, 2.0, size=logp.shape)
    mask = rng.random(logp.shape) < 0.7
    mask[:, 0] = True
    mask[3] = not empty_row
    advantages = rng.normal(size=P * G)
    return logp, old_logp, ref_logp, mask, advantages


@pytest.mark.parametrize("peer", ["trl", "verl"])  # OpenRLHF's KL loss is a token mean whatever the objective's
@pytest.mark.parametrize("preset", ["grpo", "dr-grpo"])
def test_grpo_losses_match_each_peer_in_value_and_gradient(peer, preset):
    """TRL counts an empty row in B (it has none here); verl counts only non-empty ones."""
    logp, old_logp, ref_logp, mask, advantages = _loss_batch(5, empty_row=peer == "verl")
    method = dataclasses.replace(algorithms.get(preset), kl_coef=0.1).matching(peer)
    kl = {
        "verl": verl_low_var_kl,  # verl's default KL loss
        "trl": lambda lp, ref: reference.kl_estimate(lp, ref, "k3"),
    }[peer]
    agg = method.agg if method.agg != "token-sum-norm" else "verl-seq-mean-token-sum-norm"
    assert (agg == "verl-seq-mean-token-sum-norm") == (peer == "verl" and preset == "dr-grpo")
    assert any(abs(reference.kl_estimate(a, b, "k3")) > 10 for a, b in zip(logp[mask], ref_logp[mask]))
    f32 = {
        name: jnp.asarray(x, jnp.float32)
        for name, x in dict(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages).items()
    }
    assert_matches_reference(
        lambda lp: algorithms.policy_loss(
            method, lp, f32["old_logp"], f32["advantages"], mask, ref_logp=f32["ref_logp"], max_len=T
        ),
        lambda lp: peer_grpo_loss(
            lp, old_logp, advantages, mask, ref_logp, 0.1, kl, agg, T, clip_ratio_c=3.0 if peer == "verl" else None
        ),
        jnp.asarray(logp, jnp.float32),
    )


@pytest.mark.parametrize("preset", ["grpo", "dr-grpo", "dapo", "ppo", "reinforce++"])
def test_verl_applies_its_dual_clip_to_the_token_level_clipped_surrogate(preset):
    """matching("verl") gives verl's actor loss, dual clip (c = 3) included, on a batch where
    it binds (tokens with A < 0 whose ratio passed 3); the same preset without it differs."""
    logp, old_logp, ref_logp, mask, _ = _loss_batch(6, empty_row=True)
    rng = np.random.default_rng(6)
    old_logp = logp + rng.normal(0.0, 1.0, size=logp.shape)  # ratios far from 1, some past 3
    base = algorithms.get(preset)
    advantages = rng.normal(size=P * G) if base.advantage == "grpo" else rng.normal(size=(P * G, T))
    method = base.matching("verl")
    assert method.dual_clip == 3.0 and base.dual_clip is None
    per_token_adv = advantages[:, None] if advantages.ndim == 1 else advantages
    assert np.any(mask & (per_token_adv < 0) & (np.exp(logp - old_logp) > 3.0))  # the dual clip binds
    kl_coef = method.kl_coef
    agg = method.agg if method.agg != "token-sum-norm" else "verl-seq-mean-token-sum-norm"
    f32 = {
        name: jnp.asarray(x, jnp.float32)
        for name, x in dict(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages).items()
    }
    ref = f32["ref_logp"] if kl_coef > 0 else None

    def verl_loss(lp, clip_ratio_c=3.0):
        return peer_grpo_loss(
            lp,
            old_logp,
            advantages,
            mask,
            ref_logp,
            kl_coef,
            verl_low_var_kl,
            agg,
            T,
            eps_low=method.eps_low,
            eps_high=method.eps_high or method.eps_low,
            clip_ratio_c=clip_ratio_c,
        )

    assert_matches_reference(
        lambda lp: algorithms.policy_loss(
            method, lp, f32["old_logp"], f32["advantages"], mask, ref_logp=ref, max_len=T
        ),
        verl_loss,
        jnp.asarray(logp, jnp.float32),
    )
    without, _ = algorithms.policy_loss(
        dataclasses.replace(method, dual_clip=None),
        jnp.asarray(logp, jnp.float32),
        f32["old_logp"],
        f32["advantages"],
        mask,
        ref_logp=ref,
        max_len=T,
    )
    np.testing.assert_allclose(without, verl_loss(logp.astype(np.float32).astype(np.float64), None), rtol=2e-5)
    assert abs(float(without) - verl_loss(logp.astype(np.float32).astype(np.float64))) > 1e-3


def test_verl_caps_gspos_sequence_log_ratio_at_10():
    """matching("verl") gives verl's GSPO loss: a response whose mean log-ratio is 12, with
    A < 0, weighs e^10, not e^12, and its tokens get no gradient."""
    logp, old_logp, _, mask, advantages = _loss_batch(7, empty_row=True)
    old_logp[0] = logp[0] - 12.0
    advantages[0] = -1.0
    method = algorithms.GSPO.matching("verl")
    assert (method.log_ratio_cap, method.dual_clip) == (10.0, None)
    f32 = {name: jnp.asarray(x, jnp.float32) for name, x in dict(old_logp=old_logp, advantages=advantages).items()}
    x = jnp.asarray(logp, jnp.float32)

    def loss_fn(lp, method=method):
        return algorithms.policy_loss(method, lp, f32["old_logp"], f32["advantages"], mask)

    def verl_loss(lp):
        return verl_gspo_loss(lp, old_logp, advantages, mask, method.eps_low, method.eps_high)

    # The loss is ~1e3: a step of 1e-4 keeps the difference quotient's rounding small.
    assert_matches_reference(
        loss_fn, verl_loss, x, reference_grad=reference.finite_difference_grad(verl_loss, np.asarray(x), h=1e-4)
    )
    (capped, _), capped_grad = jax.value_and_grad(loss_fn, has_aux=True)(x)
    (default, _), default_grad = jax.value_and_grad(lambda lp: loss_fn(lp, algorithms.GSPO), has_aux=True)(x)
    np.testing.assert_array_equal(np.asarray(capped_grad)[0], 0.0)
    assert np.all(np.asarray(default_grad)[0][mask[0]] > 0)
    np.testing.assert_allclose(float(default) - float(capped), (np.exp(12.0) - np.exp(10.0)) / (P * G - 1), rtol=1e-4)


def test_matching_names_the_peers_and_keeps_the_rest():
    with pytest.raises(ValueError, match=r"`library` must be one of 'trl', 'verl', 'openrlhf'; got 'tunix'"):
        algorithms.GRPO.matching("tunix")
    for peer in PEERS:
        matched = algorithms.GSPO.matching(peer)
        assert (matched.name, matched.objective, matched.eps_low, matched.eps_high, matched.ratio_level) == (
            algorithms.GSPO.name,
            "ppo_clip",
            algorithms.GSPO.eps_low,
            algorithms.GSPO.eps_high,
            "sequence",
        )
    assert algorithms.PPO.matching("trl") == algorithms.PPO  # TRL's matching covers GRPO (and RLOO, ours already)
    # The dual clip and the log-ratio cap: verl's only, where verl's actor has them.
    for name, preset in algorithms.PRESETS.items():
        for peer in ("trl", "openrlhf"):
            matched = preset.matching(peer)
            assert (matched.dual_clip, matched.log_ratio_cap) == (None, objectives.LOG_RATIO_LIMIT), (name, peer)
        verl = preset.matching("verl")
        token_surrogate = preset.objective == "ppo_clip" and preset.ratio_level == "token" and preset.update == "optax"
        assert verl.dual_clip == (3.0 if token_surrogate else None), name
        assert verl.log_ratio_cap == (10.0 if preset.ratio_level == "sequence" else 20.0), name
    assert dataclasses.replace(algorithms.GRPO, dual_clip=5.0).matching("verl").dual_clip == 5.0  # kept as set
