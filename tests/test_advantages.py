"""Advantage estimators: the spec's worked examples, loop references and invariants."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxrl_llm import advantages
from tests import reference


def reward_groups(min_group=2, max_group=6, max_prompts=4):
    shapes = st.tuples(st.integers(1, max_prompts), st.integers(min_group, max_group))
    return shapes.flatmap(
        lambda shape: hnp.arrays(np.float32, shape, elements=st.floats(-10, 10, width=32, allow_nan=False))
    )


# --- The spec's worked examples --------------------------------------------------------


def test_spec_rloo_example():
    """R = [1.0, 0.8, 0.2, 0.0]: b_1 = 0.333, A_1 = 0.667, b_3 = 0.6, A_3 = -0.4."""
    rewards = jnp.array([[1.0, 0.8, 0.2, 0.0]])
    adv = np.asarray(advantages.rloo(rewards))[0]
    baselines = np.asarray(rewards)[0] - adv
    np.testing.assert_allclose(baselines[0], 0.333, atol=5e-4)
    np.testing.assert_allclose(adv[0], 0.667, atol=5e-4)
    np.testing.assert_allclose(baselines[2], 0.6, atol=1e-6)
    np.testing.assert_allclose(adv[2], -0.4, atol=1e-6)


def test_spec_grpo_example():
    """R = [1, 1, 0, 0]: mu_G = 0.5, sigma_G = 0.5 (population std), so A = [1, 1, -1, -1]."""
    rewards = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    adv = advantages.grpo(rewards, eps=0.0)
    np.testing.assert_allclose(adv, [[1.0, 1.0, -1.0, -1.0]], rtol=1e-6)
    # mu_G and sigma_G recovered from the centred (scale="none") and scaled advantages.
    centred = advantages.grpo(rewards, scale="none")
    np.testing.assert_allclose(np.asarray(rewards) - centred, 0.5)
    np.testing.assert_allclose(centred / adv, 0.5, rtol=1e-6)


def test_spec_baseline_example():
    """b = 0.6: R = 0.9 gives 0.3, R = 0.2 gives -0.4."""
    np.testing.assert_allclose(advantages.baseline(jnp.array([0.9, 0.2]), 0.6), [0.3, -0.4], rtol=1e-6)


def test_sample_std_convention_of_trl_verl_tunix():
    rewards = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    sample_std = np.std([1, 1, 0, 0], ddof=1)
    np.testing.assert_allclose(
        advantages.grpo(rewards, eps=0.0, ddof=1), [[0.5, 0.5, -0.5, -0.5]] / sample_std, rtol=1e-6
    )


# --- Loop references -------------------------------------------------------------------


@given(reward_groups())
def test_rloo_matches_leave_one_out_loop(rewards):
    np.testing.assert_allclose(advantages.rloo(rewards), reference.rloo(rewards), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scale", advantages.GROUP_SCALES)
@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_matches_loop(scale, ddof):
    rng = np.random.default_rng(ddof)
    rewards = rng.normal(size=(5, 4)).astype(np.float32)
    rewards[1] = 0.3  # one group with identical rewards
    got = jax.jit(lambda r: advantages.grpo(r, eps=1e-6, ddof=ddof, scale=scale))(rewards)
    np.testing.assert_allclose(got, reference.grpo_advantages(rewards, 1e-6, ddof, scale), rtol=1e-5, atol=1e-6)


# --- Invariants --------------------------------------------------------------------------


@given(reward_groups(), st.sampled_from(advantages.GROUP_SCALES), st.sampled_from([0, 1]))
def test_grpo_groups_have_zero_mean_and_no_nans(rewards, scale, ddof):
    adv = np.asarray(advantages.grpo(rewards, ddof=ddof, scale=scale))
    assert np.all(np.isfinite(adv))
    spread = np.max(np.abs(rewards - rewards.mean(axis=1, keepdims=True))) + 1.0
    np.testing.assert_allclose(adv.mean(axis=1) / spread, 0.0, atol=1e-5)


@given(
    reward_groups(),
    st.floats(0.125, 8.0, width=32),
    st.floats(-5.0, 5.0, width=32),
    st.sampled_from(["group", "batch"]),
)
def test_grpo_is_invariant_to_positive_affine_reward_maps(rewards, a, b, scale):
    spread = np.std(rewards, axis=1 if scale == "group" else None)
    assume(np.min(spread) > 0.1)  # the eps in (sigma + eps) matters only for tiny sigma
    adv = advantages.grpo(rewards, scale=scale)
    transformed = advantages.grpo(a * rewards + b, scale=scale)
    np.testing.assert_allclose(transformed, adv, atol=1e-3)


@given(st.integers(1, 4), st.integers(1, 6), st.floats(-100, 100, width=32), st.sampled_from(advantages.GROUP_SCALES))
def test_identical_rewards_give_zero_advantages(num_prompts, group, value, scale):
    adv = advantages.grpo(jnp.full((num_prompts, group), value), scale=scale)
    np.testing.assert_array_equal(adv, np.zeros((num_prompts, group)))
    if group >= 2:
        np.testing.assert_array_equal(advantages.rloo(jnp.full((num_prompts, group), value)), 0.0)


@given(reward_groups())
def test_rloo_groups_sum_to_zero_and_equal_scaled_centred_rewards(rewards):
    adv = np.asarray(advantages.rloo(rewards))
    group = rewards.shape[1]
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-3)
    np.testing.assert_allclose(adv, group / (group - 1) * (rewards - rewards.mean(axis=1, keepdims=True)), atol=1e-4)


def test_reinforce_and_batch_mean_baseline():
    rewards = jnp.array([1, 0, 3], jnp.int32)  # integer rewards are promoted, not truncated
    np.testing.assert_array_equal(advantages.reinforce(rewards), [1.0, 0.0, 3.0])
    assert advantages.reinforce(rewards).dtype == jnp.float32
    np.testing.assert_allclose(advantages.batch_mean_baseline(rewards), [-1 / 3, -4 / 3, 5 / 3], rtol=1e-6)
    np.testing.assert_allclose(advantages.baseline(jnp.array([1.0, 2.0]), jnp.array([0.5, 0.5])), [0.5, 1.5])


def test_running_mean_baseline_cumulative_and_exponential():
    batches = [np.array([1.0, 3.0]), np.array([5.0]), np.array([0.0, 0.0, 6.0])]
    state = advantages.running_mean_init()
    assert float(state.mean) == 0.0
    seen = []
    for batch in batches:
        state = jax.jit(advantages.running_mean_update)(state, batch)
        seen.extend(batch)
        np.testing.assert_allclose(state.mean, np.mean(seen), rtol=1e-6)
    assert int(state.count) == 6

    state, expected = advantages.running_mean_init(), None
    for batch in batches:
        state = advantages.running_mean_update(state, batch, decay=0.9)
        expected = batch.mean() if expected is None else 0.9 * expected + 0.1 * batch.mean()
        np.testing.assert_allclose(state.mean, expected, rtol=1e-6)


@pytest.mark.parametrize("subtract_group_mean", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_whitens_returns_to_go_over_the_batch_tokens(subtract_group_mean, gamma):
    rng = np.random.default_rng(0)
    rewards = rng.normal(2.0, 3.0, size=(3, 4)).astype(np.float32)  # [P, G]
    lengths = rng.integers(1, 6, size=12)
    lengths[5] = 0  # a padding row: left out of the statistics
    mask = np.arange(5)[None, :] < lengths[:, None]  # [B, T]
    penalty = rng.normal(0.0, 0.1, size=(12, 5)).astype(np.float32)
    adv = jax.jit(
        lambda r, m, k: advantages.reinforce_plus_plus(
            r, m, kl_penalty=k, gamma=gamma, eps=0.0, subtract_group_mean=subtract_group_mean
        )
    )(rewards, mask, penalty)
    scores = rewards.astype(np.float64)
    if subtract_group_mean:
        scores = scores - scores.mean(axis=1, keepdims=True)
    token_rewards = np.zeros((12, 5))
    for i, length in enumerate(lengths):
        token_rewards[i, :length] = -penalty[i, :length]
        if length:
            token_rewards[i, length - 1] += scores.ravel()[i]
    expected = reference.whiten(reference.returns_to_go(token_rewards, mask, gamma), mask, eps=0.0)
    assert adv.shape == (12, 5)
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)


def test_reinforce_plus_plus_is_continuous_as_the_kl_penalty_goes_to_zero():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=8).astype(np.float32)
    mask = np.arange(6)[None, :] < rng.integers(1, 7, size=8)[:, None]
    k1 = rng.normal(size=(8, 6)).astype(np.float32)
    without = np.asarray(advantages.reinforce_plus_plus(rewards, mask))
    for coef in (1e-9, 1e-6):
        with_penalty = np.asarray(advantages.reinforce_plus_plus(rewards, mask, kl_penalty=coef * k1))
        np.testing.assert_allclose(with_penalty, without, atol=20 * coef + 1e-6)
    # Without a penalty every token of a response carries its reward, whitened over tokens.
    per_token = np.broadcast_to(rewards[:, None], mask.shape)
    np.testing.assert_allclose(without, reference.whiten(per_token, mask, eps=1e-6), rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_of_equal_rewards_is_zero():
    mask = np.ones((5, 3), bool)
    np.testing.assert_array_equal(advantages.reinforce_plus_plus(jnp.full(5, 1.8471311), mask), np.zeros((5, 3)))
    np.testing.assert_array_equal(
        advantages.reinforce_plus_plus(jnp.full((2, 3), 1.8471311), np.ones((6, 3), bool), subtract_group_mean=True),
        0.0,
    )


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0), (1.0, 1.0)])
def test_gae_matches_python_loop_with_padding_and_holes(gamma, lam):
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(4, 7)).astype(np.float32)
    values = rng.normal(size=(4, 7)).astype(np.float32)
    mask = np.ones((4, 7), np.float32)
    mask[1, 4:] = 0  # right padding
    mask[2, [1, 2, 5]] = 0  # holes: e.g. tool-output tokens that are not actions
    mask[3] = 0  # an empty row
    adv, ret = jax.jit(lambda r, v, m: advantages.gae(r, v, m, gamma=gamma, lam=lam))(rewards, values, mask)
    expected_adv, expected_ret = reference.gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, expected_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, expected_ret, rtol=1e-5, atol=1e-5)


def test_gae_with_lambda_one_and_zero_values_is_the_return_to_go():
    rewards = jnp.array([[0.0, 0.0, 1.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    adv, ret = advantages.gae(rewards, jnp.zeros((1, 4)), mask, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(adv, [[0.25, 0.5, 1.0, 0.0]])
    np.testing.assert_allclose(ret, adv)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"rloo: needs at least 2 responses per prompt.*\[3, 1\]"):
        advantages.rloo(jnp.ones((3, 1)))
    with pytest.raises(ValueError, match=r"`rewards` must have shape \[P, G\]"):
        advantages.grpo(jnp.ones(4))
    with pytest.raises(ValueError, match="`scale` must be one of 'group', 'batch', 'none'; got 'global'"):
        advantages.grpo(jnp.ones((2, 2)), scale="global")
    with pytest.raises(ValueError, match="`ddof` must be < the number of rewards"):
        advantages.grpo(jnp.ones((2, 1)), ddof=1)
    with pytest.raises(ValueError, match=r"`b` must be a scalar or have the shape of `rewards`, \[3\]; got \[2\]"):
        advantages.baseline(jnp.ones(3), jnp.ones(2))
    with pytest.raises(ValueError, match=r"`lam` must be in \[0.0, 1.0\]; got 1.5"):
        advantages.gae(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2)), lam=1.5)
    with pytest.raises(ValueError, match=r"`decay` must be in \[0.0, 1.0\)"):
        advantages.running_mean_update(advantages.running_mean_init(), jnp.ones(2), decay=1.0)


def test_zero_eps_with_constant_groups_gives_zero_not_nan():
    constant = jnp.full((2, 4), 1.0)
    for scale in ("group", "batch"):
        np.testing.assert_array_equal(advantages.grpo(constant, eps=0.0, scale=scale), 0.0)
    np.testing.assert_array_equal(advantages.reinforce_plus_plus(constant, np.ones((8, 2), bool), eps=0.0), 0.0)
    mixed = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0]])
    adv = advantages.grpo(mixed, eps=0.0)
    np.testing.assert_array_equal(adv[0], 0.0)
    np.testing.assert_allclose(adv[1], [-1.2247449, 0.0, 1.2247449], rtol=1e-6)


def test_a_nan_reward_propagates_instead_of_becoming_a_zero_advantage():
    rewards = jnp.array([[1.0, jnp.nan, 0.0], [1.0, 1.0, 1.0]])
    for adv in (
        advantages.rloo(rewards),
        advantages.grpo(rewards),
        advantages.grpo(rewards, scale="none"),
        advantages.reinforce_plus_plus(rewards, np.ones((6, 2), bool)).reshape(2, 3, 2),
    ):
        assert np.isnan(np.asarray(adv)[0]).all()


def test_reinforce_plus_plus_baseline_takes_verls_group_mean_of_the_penalised_sequence_return():
    rng = np.random.default_rng(3)
    rewards = rng.normal(1.0, 2.0, size=(3, 4)).astype(np.float32)  # [P, G]
    lengths = rng.integers(1, 7, size=12)
    lengths[6] = 0  # a padding row
    mask = np.arange(6)[None, :] < lengths[:, None]
    penalty = rng.normal(0.0, 0.2, size=(12, 6)).astype(np.float32)

    def verl_form(kl_penalty, gamma=1.0):
        return np.asarray(
            advantages.reinforce_plus_plus(
                rewards,
                mask,
                kl_penalty=kl_penalty,
                gamma=gamma,
                eps=1e-8,
                subtract_group_mean=True,
                group_mean_of="sequence_return",
                ddof=1,
                eps_placement="variance",
            )
        )

    # verl's formula itself: tests/test_peer_conventions.py. Here: no return to go (gamma unused), every valid
    # token of a row carries one value, and without a penalty the two forms agree.
    np.testing.assert_allclose(verl_form(penalty, gamma=0.5), verl_form(penalty))
    for row, length in zip(verl_form(penalty), lengths):
        np.testing.assert_array_equal(row[:length], row[0])
    openrlhf = functools.partial(
        advantages.reinforce_plus_plus,
        rewards,
        mask,
        eps=1e-8,
        subtract_group_mean=True,
        ddof=1,
        eps_placement="variance",
    )
    # The forms differ on an empty row even then (verl's sum of its token rewards is 0, not R).
    assert np.abs(verl_form(None) - np.asarray(openrlhf())).max() > 1e-2
    mask[6, 0] = True
    np.testing.assert_allclose(verl_form(None), openrlhf(), rtol=1e-5, atol=1e-6)
    assert np.abs(verl_form(penalty) - np.asarray(openrlhf(kl_penalty=penalty))).max() > 1e-2
    with pytest.raises(ValueError, match=r"`group_mean_of` must be one of 'reward', 'sequence_return'"):
        advantages.reinforce_plus_plus(rewards, mask, subtract_group_mean=True, group_mean_of="return")
