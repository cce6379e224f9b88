"""The method presets: validation, dispatch, and agreement with the parts they name."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages, algorithms, kl, objectives, ops
from tests import reference
from tests.test_objectives import make_batch


def test_all_eleven_presets_exist_and_are_frozen():
    assert set(algorithms.PRESETS) == {
        "pg", "reinforce-baseline", "rloo", "ppo", "trpo", "grpo", "dr-grpo", "dapo", "gspo", "cispo", "reinforce++"
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        algorithms.GRPO.kl_coef = 0.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(advantage="ppo"), "`advantage` must be one of 'reinforce', 'batch_mean_baseline'"),
        (dict(agg="mean"), "`agg` must be one of 'token-mean'"),
        (dict(kl_coef=-1.0), "`kl_coef` must be >= 0; got -1.0"),
        (dict(num_iterations=0), "`num_iterations` must be an integer >= 1; got 0"),
        (dict(dual_clip=3.0), "`dual_clip` applies to objective='ppo_clip' only"),
        (dict(objective="ppo_clip", ratio_level="sequence"), "needs objective='grpo'"),
        (dict(update="trpo", num_iterations=2), "`num_iterations` must be 1"),
        (dict(baseline_decay=1.0), r"`baseline_decay` must be in \[0, 1\) or None"),
    ],
)
def test_bad_configs_say_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(algorithms.GRPO, **changes)


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match="Unknown algorithm 'ppo2'; known: pg, reinforce-baseline, rloo"):
        algorithms.get("ppo2")


def test_sequence_advantages_dispatch_to_the_named_estimator():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 4)).astype(np.float32)
    flat = rewards.reshape(-1)
    cases = {
        "pg": flat,
        "rloo": reference.rloo(rewards).reshape(-1),
        "grpo": reference.grpo_advantages(rewards, 1e-6, 0, "group").reshape(-1),
        "dr-grpo": reference.grpo_advantages(rewards, 0.0, 0, "none").reshape(-1),
        "reinforce++": (flat - flat.mean()) / (flat.std() + 1e-6),
    }
    for name, expected in cases.items():
        got, _ = algorithms.sequence_advantages(algorithms.get(name), rewards)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="uses GAE"):
        algorithms.sequence_advantages(algorithms.PPO, rewards)


def test_running_baseline_uses_the_mean_from_before_the_batch():
    state = advantages.running_mean_init()
    first = jnp.array([[1.0, 3.0]])
    adv, state = algorithms.sequence_advantages(algorithms.REINFORCE_BASELINE, first, state)
    np.testing.assert_allclose(adv, [1.0, 3.0])  # b = 0 before any data
    adv, state = algorithms.sequence_advantages(algorithms.REINFORCE_BASELINE, jnp.array([[4.0, 0.0]]), state)
    np.testing.assert_allclose(adv, [2.0, -2.0])  # b = 2, the first batch's mean
    np.testing.assert_allclose(state.mean, 0.9 * 2.0 + 0.1 * 2.0)


def test_policy_loss_kl_term_equals_objectives_grpo_with_beta():
    """Two code paths for GRPO + beta KL (algorithms adds it, objectives.grpo has it)."""
    b = make_batch(1)
    for agg in ops.AGGREGATION_MODES:
        method = dataclasses.replace(algorithms.GRPO, agg=agg, kl_coef=0.04, kl_estimator="k2")
        loss, metrics = algorithms.policy_loss(
            method, b["logp"], b["old_logp"], b["advantages"], b["mask"], ref_logp=b["ref_logp"], max_len=6
        )
        direct, direct_metrics = objectives.grpo(
            b["logp"], b["old_logp"], b["advantages"], b["mask"], ref_logp=b["ref_logp"], beta=0.04, kl="k2",
            agg=agg, max_len=6,
        )
        np.testing.assert_allclose(loss, direct, rtol=1e-6)
        np.testing.assert_allclose(metrics["kl"], direct_metrics["kl"], rtol=1e-6)


def test_policy_loss_adds_kl_and_entropy_to_any_objective():
    b = make_batch(2)
    entropy = np.abs(b["logp"])
    method = dataclasses.replace(algorithms.RLOO, kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = algorithms.policy_loss(
        method, b["logp"], b["old_logp"], b["advantages"], b["mask"], ref_logp=b["ref_logp"], entropy=entropy
    )
    per_token_kl = np.asarray(kl.k3(b["logp"], b["ref_logp"]))
    expected = (
        reference.policy_gradient(b["logp"], b["advantages"], b["mask"], "seq-mean-token-sum")
        + 0.1 * reference.aggregate(per_token_kl, b["mask"], "seq-mean-token-sum")
        - 0.01 * reference.aggregate(entropy, b["mask"], "seq-mean-token-sum")
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert {"kl", "entropy", "loss"} <= set(metrics)
    with pytest.raises(ValueError, match="pass `ref_logp`"):
        algorithms.policy_loss(method, b["logp"], b["old_logp"], b["advantages"], b["mask"], entropy=entropy)


def test_trpo_preset_surrogate_is_the_unclipped_importance_ratio():
    b = make_batch(3, ratio_noise=1.0)
    loss, metrics = algorithms.policy_loss(algorithms.TRPO, b["logp"], b["old_logp"], b["advantages"], b["mask"])
    rho = np.exp(b["logp"] - b["old_logp"])
    expected = reference.aggregate(-rho * b["advantages"][:, None], b["mask"], "token-mean")
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0


def test_overlong_penalty_matches_dapo_equation():
    lengths = jnp.array([10, 16, 17, 18, 20, 21])
    got = algorithms.overlong_penalty(lengths, max_len=20, buffer=4, penalty=1.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match=r"`buffer` must be an integer in \[1, max_len=20\]; got 21"):
        algorithms.overlong_penalty(lengths, max_len=20, buffer=21)
