"""The method presets: validation, dispatch, and agreement with the parts they name."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages, algorithms, kl, ops
from jaxrl_llm.runs import config as run_config
from tests import reference
from tests.test_objectives import make_batch


def test_all_eleven_presets_exist_and_are_frozen():
    assert set(algorithms.PRESETS) == {
        "pg",
        "reinforce-baseline",
        "rloo",
        "ppo",
        "trpo",
        "grpo",
        "dr-grpo",
        "dapo",
        "gspo",
        "cispo",
        "reinforce++",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        algorithms.GRPO.kl_coef = 0.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(advantage="ppo"), "`advantage` must be one of 'reinforce', 'batch_mean_baseline'"),
        (dict(agg="mean"), "`agg` must be one of 'token-mean'"),
        (dict(kl_coef=-1.0), "`kl_coef` must be a finite number >= 0; got -1.0"),
        (dict(num_iterations=0), "`num_iterations` must be an integer >= 1; got 0"),
        (dict(objective="cispo", dual_clip=3.0), "`dual_clip` applies to objective='ppo_clip' only"),
        (
            dict(objective="cispo", ratio_level="sequence"),
            r"`ratio_level='sequence'` \(GSPO\) needs objective='ppo_clip'",
        ),
        (dict(objective="clipped"), "`objective` must be one of 'policy_gradient', 'ppo_clip', 'cispo'; got 'clipped'"),
        (dict(log_ratio_cap=0.0), r"`log_ratio_cap` must be in \(0, 20.0\]; got 0.0"),
        (dict(log_ratio_cap=25.0), r"`log_ratio_cap` must be in \(0, 20.0\]; got 25.0"),
        (dict(log_ratio_cap=float("inf")), "`log_ratio_cap` must be a finite number; got inf"),
        (dict(objective="cispo", log_ratio_cap=10.0), "`log_ratio_cap` applies to objective='ppo_clip' only"),
        (dict(update="trpo", num_iterations=2), "`num_iterations` must be 1"),
        (dict(baseline_decay=1.0), r"`baseline_decay` must be in \[0, 1\) or None"),
        (dict(kl_coef=float("inf")), "`kl_coef` must be a finite number; got inf"),
        (dict(kl_coef=float("nan")), "`kl_coef` must be a finite number; got nan"),
        (dict(eps_high=float("inf")), "`eps_high` must be a finite number; got inf"),
        (dict(update="trpo", max_kl=float("inf")), "`max_kl` must be a finite number; got inf"),
        (dict(value_clip=float("inf")), "`value_clip` must be a finite number; got inf"),
        (dict(kl_coef="0.1"), "`kl_coef` must be a finite number; got '0.1'"),
        (dict(kl_clamp=0.0), "`kl_clamp` must be > 0 or None; got 0.0"),
        (dict(kl_clamp=float("inf")), "`kl_clamp` must be a finite number; got inf"),
        (dict(kl_estimator="low_var_kl"), "`kl_estimator` must be one of 'k1', 'k2', 'k3', 'abs'"),
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
    }
    for name, expected in cases.items():
        got, _ = algorithms.sequence_advantages(algorithms.get(name), rewards)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
    # REINFORCE with the batch-mean baseline instead of the running one.
    batch_mean = dataclasses.replace(algorithms.REINFORCE_BASELINE, advantage="batch_mean_baseline")
    got, _ = algorithms.sequence_advantages(batch_mean, rewards)
    np.testing.assert_allclose(got, flat - flat.mean(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="uses GAE"):
        algorithms.sequence_advantages(algorithms.PPO, rewards)
    with pytest.raises(ValueError, match=r"uses REINFORCE\+\+, whose advantages are per token"):
        algorithms.sequence_advantages(algorithms.REINFORCE_PP, rewards)


def test_running_baseline_uses_the_mean_from_before_the_batch():
    state = advantages.running_mean_init()
    first = jnp.array([[1.0, 3.0]])
    adv, state = algorithms.sequence_advantages(algorithms.REINFORCE_BASELINE, first, state)
    np.testing.assert_allclose(adv, [1.0, 3.0])  # b = 0 before any data
    adv, state = algorithms.sequence_advantages(algorithms.REINFORCE_BASELINE, jnp.array([[4.0, 0.0]]), state)
    np.testing.assert_allclose(adv, [2.0, -2.0])  # b = 2, the first batch's mean
    np.testing.assert_allclose(state.mean, 0.9 * 2.0 + 0.1 * 2.0)


def test_a_batch_with_a_non_finite_reward_leaves_the_running_baseline_unchanged():
    state = algorithms.sequence_advantages(
        algorithms.REINFORCE_BASELINE, jnp.array([[1.0, 3.0]]), advantages.running_mean_init()
    )[1]
    for bad in (jnp.nan, jnp.inf):
        adv, after = algorithms.sequence_advantages(algorithms.REINFORCE_BASELINE, jnp.array([[bad, 0.0]]), state)
        assert not np.isfinite(adv[0])  # the update will skip this batch
        np.testing.assert_array_equal(after.mean, state.mean)
        np.testing.assert_array_equal(after.count, state.count)


@pytest.mark.parametrize("agg", ops.AGGREGATION_MODES)
@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_policy_loss_of_grpo_with_beta_is_deepseekmaths_objective(preset, agg):
    """The clipped surrogate plus beta times the KL estimate, per token, aggregated once
    (Shao et al., 2024, eq. 3), against the float64 loop; GSPO with its sequence ratio."""
    b = make_batch(1)
    method = dataclasses.replace(algorithms.get(preset), agg=agg, kl_coef=0.04, kl_estimator="k2")
    loss, metrics = algorithms.policy_loss(
        method, b["logp"], b["old_logp"], b["advantages"], b["mask"], ref_logp=b["ref_logp"], max_len=6
    )
    expected = reference.grpo(
        b["logp"],
        b["old_logp"],
        b["advantages"],
        b["mask"],
        b["ref_logp"],
        0.04,
        "k2",
        method.eps_low,
        method.eps_high or method.eps_low,
        method.ratio_level,
        agg,
        6,
    )
    np.testing.assert_allclose(loss, expected, rtol=2e-5, atol=1e-7)
    estimates = np.vectorize(lambda a, r: reference.kl_estimate(float(a), float(r), "k2"))(b["logp"], b["ref_logp"])
    np.testing.assert_allclose(metrics["kl_k2"], estimates[b["mask"] > 0].mean(), rtol=1e-5)
    assert "kl" not in metrics  # one name for one number: the estimator's


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
    assert {"kl_k3", "entropy", "loss"} <= set(metrics)
    with pytest.raises(ValueError, match="pass `ref_logp`"):
        algorithms.policy_loss(method, b["logp"], b["old_logp"], b["advantages"], b["mask"], entropy=entropy)


def test_trpo_preset_surrogate_is_the_unclipped_importance_ratio():
    b = make_batch(3, ratio_noise=1.0)
    loss, metrics = algorithms.policy_loss(algorithms.TRPO, b["logp"], b["old_logp"], b["advantages"], b["mask"])
    rho = np.exp(b["logp"] - b["old_logp"])
    expected = reference.aggregate(-rho * b["advantages"][:, None], b["mask"], "token-mean")
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0


def test_old_objective_names_become_the_current_one():
    """``objective="grpo"`` (the clipped surrogate's second name) still loads, as ``ppo_clip``:
    from Python, from a config file's ``[algorithm]`` table, from a run directory's stored
    config (which must still resume) and from ``--algorithm.objective``."""
    assert algorithms.OBJECTIVE_ALIASES == {"grpo": "ppo_clip"}
    for preset in (algorithms.GRPO, algorithms.DR_GRPO, algorithms.DAPO, algorithms.GSPO):
        assert preset.objective == "ppo_clip"
        assert dataclasses.replace(preset, objective="grpo") == preset
    old = algorithms.Algorithm(
        name="old-gspo", advantage="grpo", objective="grpo", ratio_level="sequence", agg="seq-mean-token-mean"
    )
    assert old.objective == "ppo_clip" and old.ratio_level == "sequence"
    assert dataclasses.replace(algorithms.PPO, objective="ppo_clip") == algorithms.PPO

    config = run_config.from_dict({"method": "gspo", "algorithm": {"objective": "grpo"}})
    assert config.algorithm == algorithms.GSPO
    stored = run_config.to_dict(run_config.RunConfig(method="dr-grpo", algorithm=algorithms.DR_GRPO))
    stored["algorithm"]["objective"] = "grpo"  # a config.json written before the rename
    assert run_config.from_dict(json.loads(json.dumps(stored))).algorithm == algorithms.DR_GRPO


def test_the_old_objective_name_is_accepted_on_the_command_line(tmp_path):
    from jaxrl_llm import cli

    _, config = cli.parse_train(
        ["--run-dir", str(tmp_path / "run"), "--method", "dapo", "--algorithm.objective", "grpo"]
    )
    assert config.algorithm == algorithms.DAPO


def _kl_reward_batch(seed=0, num_prompts=3, group=4, length=5):
    rng = np.random.default_rng(seed)
    batch = num_prompts * group
    lengths = rng.integers(1, length + 1, size=batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    rewards = rng.normal(size=batch).astype(np.float32)
    logp, ref_logp, values = (rng.normal(size=(batch, length)).astype(np.float32) for _ in range(3))
    return rewards, mask, logp, ref_logp, values


# (std_ddof, eps_placement): the library's default, verl's masked_whiten, OpenRLHF's normalisation.
WHITENING = [(0, "std"), (1, "variance"), (0, "variance_floor")]


@pytest.mark.parametrize("ddof, eps_placement", WHITENING)
def test_compute_advantages_ppo_is_whitened_gae_on_kl_penalised_token_rewards(ddof, eps_placement):
    rewards, mask, logp, ref_logp, values = _kl_reward_batch()
    method = dataclasses.replace(algorithms.PPO, std_ddof=ddof, eps_placement=eps_placement)
    adv, returns, _ = algorithms.compute_advantages(
        method, rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp, values=values
    )
    token_rewards = reference.kl_penalised_token_rewards(rewards, mask, logp, ref_logp, method.kl_reward_coef)
    expected_adv, expected_returns = reference.gae(token_rewards, values, mask, method.gamma, method.lam)
    np.testing.assert_allclose(
        adv, reference.whiten(expected_adv, mask, ddof=ddof, eps_placement=eps_placement), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(returns, expected_returns, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ddof, eps_placement", WHITENING)
@pytest.mark.parametrize("subtract_group_mean", [False, True])
def test_compute_advantages_reinforce_pp_is_the_whitened_return_to_go(subtract_group_mean, ddof, eps_placement):
    rewards, mask, logp, ref_logp, _ = _kl_reward_batch(seed=1)
    method = dataclasses.replace(
        algorithms.REINFORCE_PP, subtract_group_mean=subtract_group_mean, std_ddof=ddof, eps_placement=eps_placement
    )
    adv, returns, _ = algorithms.compute_advantages(method, rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp)
    scores = rewards.astype(np.float64).reshape(3, 4)
    if subtract_group_mean:
        scores = scores - scores.mean(1, keepdims=True)
    token_rewards = reference.kl_penalised_token_rewards(scores.ravel(), mask, logp, ref_logp, method.kl_reward_coef)
    expected = reference.whiten(
        reference.returns_to_go(token_rewards, mask, 1.0),
        mask,
        eps=method.advantage_eps,
        ddof=ddof,
        eps_placement=eps_placement,
    )
    assert returns is None and adv.shape == mask.shape
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)
    # One estimator for every coefficient: no jump when it leaves 0.
    at_zero, _, _ = algorithms.compute_advantages(
        dataclasses.replace(method, kl_reward_coef=0.0), rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp
    )
    near_zero, _, _ = algorithms.compute_advantages(
        dataclasses.replace(method, kl_reward_coef=1e-9), rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp
    )
    np.testing.assert_allclose(near_zero, at_zero, atol=1e-6)


def test_compute_advantages_sequence_estimators_pay_the_summed_kl_penalty():
    rewards, mask, logp, ref_logp, _ = _kl_reward_batch(seed=2)
    method = dataclasses.replace(algorithms.RLOO, kl_reward_coef=0.1)
    adv, returns, _ = algorithms.compute_advantages(method, rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp)
    penalised = rewards - 0.1 * np.sum(np.where(mask, logp - ref_logp, 0.0), axis=1)
    np.testing.assert_allclose(adv, reference.rloo(penalised.reshape(3, 4)).ravel(), rtol=1e-5, atol=1e-5)
    # Without a KL coefficient it is exactly sequence_advantages.
    plain, _, _ = algorithms.compute_advantages(algorithms.GRPO, rewards, mask, group_size=4)
    np.testing.assert_array_equal(plain, algorithms.sequence_advantages(algorithms.GRPO, rewards.reshape(3, 4))[0])


def test_compute_advantages_names_what_is_missing():
    rewards, mask, logp, ref_logp, _ = _kl_reward_batch()
    with pytest.raises(ValueError, match="uses GAE: pass the critic's `values`"):
        algorithms.compute_advantages(algorithms.PPO, rewards, mask, group_size=4, logp=logp, ref_logp=ref_logp)
    with pytest.raises(ValueError, match="kl_reward_coef=0.01 > 0: pass `logp` and `ref_logp`"):
        algorithms.compute_advantages(algorithms.REINFORCE_PP, rewards, mask, group_size=4)
    with pytest.raises(ValueError, match=r"`rewards` must have shape \[B\] with B = 12"):
        algorithms.compute_advantages(algorithms.GRPO, rewards[:5], mask, group_size=4)
