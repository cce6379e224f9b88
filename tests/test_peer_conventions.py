"""``Algorithm.matching(peer)`` against loop implementations of TRL's, verl's and OpenRLHF's
published formulas, written here from their definitions (README, "Matching TRL, verl and
OpenRLHF"), in float64: advantages on batches with ties, a group of equal rewards and an
empty row, and losses (values and gradients) on masks with gaps."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms
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
    rewards[G:2 * G] = 0.5  # a group of equal rewards
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
        group = [float(r) for r in rewards[p * G:(p + 1) * G]]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return np.array(out)


def leave_one_out(rewards):
    """Every peer's RLOO: R_i - the mean of the group's other rewards."""
    out = []
    for p in range(P):
        group = [float(r) for r in rewards[p * G:(p + 1) * G]]
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
        group = scores[(i // G) * G:(i // G + 1) * G]
        out[i, mask[i]] = scores[i] - group.mean()
    return verl_whiten(out, mask)


def openrlhf_reinforce_pp_baseline(rewards, mask, logp, ref_logp, coef):
    """OpenRLHF: the group mean of R alone subtracted, then R at the last token less the KL
    at each, returns to go (gamma 1), whitened over the batch's tokens."""
    centered = np.array([float(r) - rewards[(i // G) * G:(i // G + 1) * G].astype(np.float64).mean()
                         for i, r in enumerate(rewards)])
    token_rewards = kl_token_rewards(centered, mask, logp, ref_logp, coef)
    return openrlhf_whiten(reference.returns_to_go(token_rewards, mask, 1.0), mask)


def verl_low_var_kl(logp, ref_logp):
    log_ratio = min(max(ref_logp - logp, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1.0, -10.0), 10.0)


def peer_grpo_loss(logp, old_logp, advantages, mask, ref_logp, beta, kl, agg, max_len):
    """-min(rho A, clip(rho) A) + beta * kl(logp, ref) per token, aggregated: a loop."""
    per = np.zeros(logp.shape)
    for i, t in np.ndindex(logp.shape):
        rho = math.exp(logp[i, t] - old_logp[i, t])
        a = advantages[i]
        per[i, t] = -min(rho * a, min(max(rho, 0.8), 1.2) * a) + beta * kl(logp[i, t], ref_logp[i, t])
    if agg == "verl-seq-mean-token-sum-norm":  # the sum over the batch over the padded length
        return float((per * mask).sum()) / max_len
    return reference.aggregate(per, mask, agg, max_len)


# --- Advantages ----------------------------------------------------------------------------

@pytest.mark.parametrize("peer, eps", [("trl", 1e-4), ("verl", 1e-6), ("openrlhf", 1e-9)])
def test_grpo_advantages_match_each_peer(peer, eps):
    rewards, mask, *_ = _batch()
    adv, _, _ = algorithms.compute_advantages(algorithms.GRPO.matching(peer), rewards, mask, group_size=G)
    np.testing.assert_allclose(adv, group_normalised(rewards, eps), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(adv)[G:2 * G] == 0)  # equal rewards: exactly 0


@pytest.mark.parametrize("peer", PEERS)
def test_rloo_advantages_match_each_peer(peer):
    rewards, mask, *_ = _batch(1)
    adv, _, _ = algorithms.compute_advantages(algorithms.RLOO.matching(peer), rewards, mask, group_size=G)
    np.testing.assert_allclose(adv, leave_one_out(rewards), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("peer, whiten", [("verl", verl_whiten), ("openrlhf", openrlhf_whiten)])
def test_ppo_gae_advantages_match_each_peer(peer, whiten):
    rewards, mask, logp, ref_logp, values = _batch(2)
    method = algorithms.PPO.matching(peer)
    adv, returns, _ = algorithms.compute_advantages(method, rewards, mask, group_size=G, logp=logp,
                                                    ref_logp=ref_logp, values=values.astype(np.float32))
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
    np.testing.assert_allclose(adv, whiten(reference.returns_to_go(token_rewards, mask, 1.0), mask),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("peer, expected", [("verl", verl_reinforce_pp_baseline),
                                            ("openrlhf", openrlhf_reinforce_pp_baseline)])
def test_reinforce_plus_plus_baseline_matches_each_peer(peer, expected):
    rewards, mask, logp, ref_logp, _ = _batch(4)
    method = dataclasses.replace(algorithms.REINFORCE_PP, subtract_group_mean=True).matching(peer)
    adv, _, _ = algorithms.compute_advantages(method, rewards, mask, group_size=G, logp=logp, ref_logp=ref_logp)
    np.testing.assert_allclose(adv, expected(rewards, mask, logp, ref_logp, method.kl_reward_coef),
                               rtol=1e-5, atol=1e-6)


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
    kl = {"verl": verl_low_var_kl,  # verl's default KL loss
          "trl": lambda lp, ref: reference.kl_estimate(lp, ref, "k3")}[peer]
    agg = method.agg if method.agg != "token-sum-norm" else "verl-seq-mean-token-sum-norm"
    assert (agg == "verl-seq-mean-token-sum-norm") == (peer == "verl" and preset == "dr-grpo")
    assert any(abs(reference.kl_estimate(a, b, "k3")) > 10 for a, b in zip(logp[mask], ref_logp[mask]))
    f32 = {name: jnp.asarray(x, jnp.float32) for name, x in
           dict(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages).items()}
    assert_matches_reference(
        lambda lp: algorithms.policy_loss(method, lp, f32["old_logp"], f32["advantages"], mask,
                                          ref_logp=f32["ref_logp"], max_len=T),
        lambda lp: peer_grpo_loss(lp, old_logp, advantages, mask, ref_logp, 0.1, kl, agg, T),
        jnp.asarray(logp, jnp.float32))


def test_matching_names_the_peers_and_keeps_the_rest():
    with pytest.raises(ValueError, match=r"`library` must be one of 'trl', 'verl', 'openrlhf'; got 'tunix'"):
        algorithms.GRPO.matching("tunix")
    for peer in PEERS:
        matched = algorithms.GSPO.matching(peer)
        assert (matched.name, matched.objective, matched.eps_low, matched.eps_high, matched.ratio_level) == (
            algorithms.GSPO.name, "grpo", algorithms.GSPO.eps_low, algorithms.GSPO.eps_high, "sequence")
    assert algorithms.PPO.matching("trl") == algorithms.PPO  # TRL's matching covers GRPO (and RLOO, ours already)
