"""Objectives against float64 Python-loop references: loss, gradient and metrics.

Gradients are checked against central finite differences of the reference loss, so
the library's autodiff (stop-gradients included) is checked against the equation.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm import objectives, ops
from tests import reference

MODES = ops.AGGREGATION_MODES
B, T = 4, 5


def make_batch(seed, *, per_token_advantages=False, ratio_noise=0.3):
    """Random log-probs, old log-probs off by noise (ratios around 1, some clipped),
    right-padded masks of random length and one fully masked row."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(B, T)) - 0.05
    old_logp = logp + rng.normal(0.0, ratio_noise, size=(B, T))
    ref_logp = logp + rng.normal(0.0, 0.3, size=(B, T))
    adv_shape = (B, T) if per_token_advantages else (B,)
    advantages = rng.normal(size=adv_shape)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    mask[2] = 0.0
    return {
        k: v.astype(np.float32)
        for k, v in dict(logp=logp, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, mask=mask).items()
    }


def surrogate_with_kl(
    logp, old_logp, advantages, mask, *, ref_logp, beta, kl="k3", agg="seq-mean-token-mean", max_len=None, **surrogate
):
    """GRPO's loss as the library composes it: the clipped surrogate plus the KL penalty,
    aggregated alike (what :func:`jaxrl_llm.algorithms.policy_loss` does)."""
    loss, metrics = objectives.ppo_clip(logp, old_logp, advantages, mask, agg=agg, max_len=max_len, **surrogate)
    penalty, kl_metrics = objectives.kl_penalty(logp, ref_logp, mask, coef=beta, estimator=kl, agg=agg, max_len=max_len)
    return loss + penalty, {**metrics, **kl_metrics}


def assert_matches_reference(loss_fn, reference_fn, x, *, reference_grad=None):
    """``loss_fn(x) -> (loss, metrics)`` in JAX vs ``reference_fn(x) -> float`` in float64."""
    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(x)
    np.testing.assert_allclose(loss, reference_fn(np.asarray(x, np.float64)), rtol=2e-5, atol=2e-6)
    expected_grad = reference_grad if reference_grad is not None else reference.finite_difference_grad(reference_fn, x)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=2e-6)
    assert all(np.isfinite(v) for v in metrics.values())
    return metrics


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("per_token", [False, True])
def test_policy_gradient(agg, per_token):
    b = make_batch(0, per_token_advantages=per_token)
    assert_matches_reference(
        lambda lp: objectives.policy_gradient(lp, b["advantages"], b["mask"], agg=agg, max_len=8),
        lambda lp: reference.policy_gradient(lp, b["advantages"], b["mask"], agg, 8),
        b["logp"],
    )


def test_policy_gradient_reports_the_ratio_to_the_sampling_policy_without_using_it():
    b = make_batch(2, ratio_noise=0.5)

    def loss(lp, old_logp=None):
        return objectives.policy_gradient(lp, b["advantages"], b["mask"], old_logp=old_logp)

    (plain, _), plain_grad = jax.value_and_grad(loss, has_aux=True)(b["logp"])
    (with_old, metrics), with_old_grad = jax.value_and_grad(loss, has_aux=True)(b["logp"], b["old_logp"])
    np.testing.assert_array_equal(with_old, plain)
    np.testing.assert_array_equal(with_old_grad, plain_grad)
    ratio = np.exp(b["logp"] - b["old_logp"])[b["mask"] > 0]
    np.testing.assert_allclose(
        [metrics["ratio_min"], metrics["ratio_mean"], metrics["ratio_max"]],
        [ratio.min(), ratio.mean(), ratio.max()],
        rtol=1e-5,
    )
    np.testing.assert_allclose(metrics["approx_kl"], np.mean(ratio - 1 - np.log(ratio)), rtol=1e-4)
    assert metrics["clip_fraction"] == 0


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("eps_high, dual_clip", [(None, None), (0.28, None), (None, 1.5), (0.28, 3.0)])
def test_ppo_clip(agg, eps_high, dual_clip):
    b = make_batch(1, ratio_noise=0.5)
    metrics = assert_matches_reference(
        lambda lp: objectives.ppo_clip(
            lp, b["old_logp"], b["advantages"], b["mask"], eps_low=0.2, eps_high=eps_high, dual_clip=dual_clip, agg=agg
        ),
        lambda lp: reference.ppo_clip(
            lp, b["old_logp"], b["advantages"], b["mask"], 0.2, 0.2 if eps_high is None else eps_high, dual_clip, agg
        ),
        b["logp"],
    )
    # Metrics against NumPy over valid tokens.
    valid = b["mask"] > 0
    ratio = np.exp(b["logp"] - b["old_logp"])[valid]
    adv = np.broadcast_to(b["advantages"][:, None], (B, T))[valid]
    high = 1 + (0.2 if eps_high is None else eps_high)
    np.testing.assert_allclose(metrics["clip_fraction_low"], np.mean((ratio < 0.8) & (adv < 0)), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction_high"], np.mean((ratio > high) & (adv > 0)), rtol=1e-6)
    np.testing.assert_allclose(
        [metrics["ratio_min"], metrics["ratio_mean"], metrics["ratio_max"]],
        [ratio.min(), ratio.mean(), ratio.max()],
        rtol=1e-5,
    )
    np.testing.assert_allclose(metrics["approx_kl"], np.mean(ratio - 1 - np.log(ratio)), rtol=1e-4)


GRPO_CASES = [
    # (level, beta, kl, eps_high, per_token_advantages)
    ("token", 0.0, "k3", None, False),
    ("token", 0.1, "k3", None, False),
    ("token", 0.1, "k1", 0.28, True),
    ("token", 0.2, "k2", 0.28, False),
    ("token", 0.1, "abs", None, False),
    ("sequence", 0.0, "k3", None, False),
    ("sequence", 0.1, "k3", 0.28, False),
]


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("level, beta, kl, eps_high, per_token", GRPO_CASES)
def test_grpo_and_gspo_are_the_clipped_surrogate_plus_the_kl_penalty(agg, level, beta, kl, eps_high, per_token):
    b = make_batch(2, per_token_advantages=per_token)
    # GSPO's clip range is small; make some sequences clip on both sides.
    eps_low = 0.2 if level == "token" else 0.05
    high = eps_low if eps_high is None else eps_high
    metrics = assert_matches_reference(
        lambda lp: surrogate_with_kl(
            lp,
            b["old_logp"],
            b["advantages"],
            b["mask"],
            ref_logp=b["ref_logp"],
            beta=beta,
            kl=kl,
            eps_low=eps_low,
            eps_high=eps_high,
            ratio_level=level,
            agg=agg,
            max_len=7,
        ),
        lambda lp: reference.grpo(
            lp, b["old_logp"], b["advantages"], b["mask"], b["ref_logp"], beta, kl, eps_low, high, level, agg, 7
        ),
        b["logp"],
    )
    valid = b["mask"] > 0
    estimates = np.vectorize(lambda a, r: reference.kl_estimate(float(a), float(r), kl))(b["logp"], b["ref_logp"])
    np.testing.assert_allclose(metrics[f"kl_{kl}"], estimates[valid].mean(), rtol=1e-4)


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    b = make_batch(3)
    _, metrics = objectives.ppo_clip(b["logp"], b["old_logp"], b["advantages"], b["mask"], ratio_level="sequence")
    valid_rows = b["mask"].sum(1) > 0
    seq_ratio = np.exp(((b["logp"] - b["old_logp"]) * b["mask"]).sum(1)[valid_rows] / b["mask"].sum(1)[valid_rows])
    np.testing.assert_allclose(metrics["ratio_min"], seq_ratio.min(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], seq_ratio.max(), rtol=1e-5)


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("eps_low, eps_high", [(None, 0.28), (0.2, 0.2), (0.2, None)])
def test_cispo(agg, eps_low, eps_high):
    b = make_batch(4, ratio_noise=0.5)
    args = (b["old_logp"], b["advantages"], b["mask"])
    assert_matches_reference(
        lambda lp: objectives.cispo(lp, *args, eps_low=eps_low, eps_high=eps_high, agg=agg),
        lambda lp: reference.cispo(lp, *args, eps_low, eps_high, agg),
        b["logp"],
        reference_grad=reference.cispo_grad(b["logp"], *args, eps_low, eps_high, agg),
    )


def test_cispo_keeps_a_gradient_on_every_token_where_ppo_clips():
    b = make_batch(5, ratio_noise=1.0)
    mask = np.ones((B, T), np.float32)
    adv = np.abs(b["advantages"]) + 0.1  # all positive: PPO zeroes the gradient of ratio > 1.2
    cispo_grad = jax.grad(lambda lp: objectives.cispo(lp, b["old_logp"], adv, mask, eps_low=None, eps_high=0.2)[0])(
        b["logp"]
    )
    ppo_grad = jax.grad(lambda lp: objectives.ppo_clip(lp, b["old_logp"], adv, mask)[0])(b["logp"])
    clipped = np.exp(b["logp"] - b["old_logp"]) > 1.2
    assert clipped.any()
    assert np.all(np.asarray(ppo_grad)[clipped] == 0)
    assert np.all(np.asarray(cispo_grad) < 0)


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(agg, clip):
    rng = np.random.default_rng(6)
    b = make_batch(6)
    old_values = rng.normal(size=(B, T)).astype(np.float32)
    values = (old_values + rng.normal(0, 0.4, size=(B, T))).astype(np.float32)
    returns = rng.normal(size=(B, T)).astype(np.float32)
    metrics = assert_matches_reference(
        lambda v: objectives.value_loss(v, old_values, returns, b["mask"], clip=clip, agg=agg),
        lambda v: reference.value_loss(v, old_values, returns, b["mask"], clip, agg),
        values,
    )
    valid = b["mask"] > 0
    residual, target = (returns - values)[valid], returns[valid]
    np.testing.assert_allclose(metrics["explained_variance"], 1 - residual.var() / target.var(), rtol=1e-4)


def test_value_clip_fraction_counts_only_values_outside_the_band():
    # float32 values inside the band [old - c, old + c]: the clipped value is the value
    # itself, so no token is clipped (old + clip(v - old) can round an ulp away from v).
    rng = np.random.default_rng(11)
    old_values = rng.normal(0.0, 3.0, size=(64, 64)).astype(np.float32)
    values = (old_values + rng.uniform(-0.19, 0.19, size=(64, 64))).astype(np.float32)
    returns = rng.normal(0.0, 3.0, size=(64, 64)).astype(np.float32)
    mask = np.ones((64, 64), bool)
    _, metrics = objectives.value_loss(values, old_values, returns, mask, clip=0.2)
    assert float(metrics["value_clip_fraction"]) == 0.0
    # Outside the band, exactly the tokens whose clipped error is the larger count (float64).
    values = (old_values + rng.uniform(-0.6, 0.6, size=(64, 64))).astype(np.float32)
    _, metrics = objectives.value_loss(values, old_values, returns, mask, clip=0.2)
    v, old, r = (x.astype(np.float64) for x in (values, old_values, returns))
    clipped = np.clip(v, old - 0.2, old + 0.2)
    expected = np.mean((clipped - r) ** 2 > (v - r) ** 2)
    assert 0.1 < expected < 0.5
    np.testing.assert_allclose(float(metrics["value_clip_fraction"]), expected, atol=2 / 64**2)


def test_entropy_bonus_rewards_entropy():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(B, T, 6)).astype(np.float32)
    mask = make_batch(7)["mask"]

    def reference_loss(z):
        logp = reference.log_softmax(z)
        return -0.01 * reference.aggregate(-np.sum(np.exp(logp) * logp, -1), mask, "token-mean")

    def loss_fn(z):
        return objectives.entropy_bonus(ops.entropy(z), mask, coef=0.01)

    assert_matches_reference(loss_fn, reference_loss, logits)


# --- The spec's clip and ratio examples ------------------------------------------------


@pytest.mark.parametrize(
    "p_old, p_new, advantage, ratio, clipped_ratio",
    [(0.4, 0.6, 1.0, 1.5, 1.2), (0.5, 0.3, -1.0, 0.6, 0.8), (0.5, 0.5, 1.0, 1.0, 1.0), (0.5, 0.3, 1.0, 0.6, 0.8)],
)
def test_spec_clip_and_ratio_examples(p_old, p_new, advantage, ratio, clipped_ratio):
    """rho = pi/pi_old (1.5: 50% more likely; 0.8: 20% less likely) and
    clip(1.5, 0.8, 1.2) = 1.2, clip(0.6, 0.8, 1.2) = 0.8, clip(1.0, 0.8, 1.2) = 1.0.
    The last case is PPO's pessimism: with A > 0 a ratio below the range is not lifted."""
    logp, old_logp = jnp.log(jnp.array([[p_new]])), jnp.log(jnp.array([[p_old]]))
    adv, mask = jnp.array([advantage]), jnp.ones((1, 1))
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: objectives.ppo_clip(lp, old_logp, adv, mask, eps_low=0.2), has_aux=True
    )(logp)
    np.testing.assert_allclose(metrics["ratio_mean"], ratio, rtol=1e-6)
    np.testing.assert_allclose(loss, -min(ratio * advantage, clipped_ratio * advantage), rtol=1e-6)
    gradient_removed = clipped_ratio * advantage < ratio * advantage
    assert float(metrics["clip_fraction"]) == float(gradient_removed)
    np.testing.assert_allclose(grad, 0.0 if gradient_removed else -ratio * advantage, rtol=1e-6)


# --- Invariants ----------------------------------------------------------------------------


RATIO_OBJECTIVES = {
    "ppo_clip": functools.partial(objectives.ppo_clip, eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    "grpo": functools.partial(objectives.ppo_clip, eps_low=0.2),
    "grpo_kl": None,  # needs ref_logp; built in the test
    "gspo": functools.partial(objectives.ppo_clip, ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
    "gspo_dual_clip": functools.partial(objectives.ppo_clip, ratio_level="sequence", dual_clip=3.0, log_ratio_cap=10.0),
    "cispo": functools.partial(objectives.cispo, eps_low=None, eps_high=0.28),
}


@given(
    seed=st.integers(0, 2**31 - 1),
    agg=st.sampled_from(MODES),
    name=st.sampled_from(sorted(RATIO_OBJECTIVES)),
    per_token=st.booleans(),
)
def test_at_ratio_one_the_gradient_is_the_policy_gradient(seed, agg, name, per_token):
    """At logp == old_logp (mu = 1, first step) every clipped/weighted objective has the
    policy-gradient gradient with the same aggregation; GRPO's k3 KL adds nothing when
    the policy equals the reference."""
    b = make_batch(seed, per_token_advantages=per_token and not name.startswith("gspo"))
    objective = RATIO_OBJECTIVES[name] or functools.partial(surrogate_with_kl, ref_logp=b["logp"], beta=0.5)
    grad = jax.grad(lambda lp: objective(lp, b["logp"], b["advantages"], b["mask"], agg=agg, max_len=6)[0])(b["logp"])
    pg_grad = jax.grad(lambda lp: objectives.policy_gradient(lp, b["advantages"], b["mask"], agg=agg, max_len=6)[0])(
        b["logp"]
    )
    np.testing.assert_allclose(grad, pg_grad, rtol=1e-5, atol=1e-7)
    _, metrics = objective(b["logp"], b["logp"], b["advantages"], b["mask"], agg=agg)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0


ALL_OBJECTIVES = {
    "policy_gradient": lambda b, lp, agg: objectives.policy_gradient(lp, b["advantages"], b["mask"], agg=agg),
    "ppo_clip": lambda b, lp, agg: objectives.ppo_clip(
        lp, b["old_logp"], b["advantages"], b["mask"], agg=agg, dual_clip=2.0
    ),
    "grpo": lambda b, lp, agg: surrogate_with_kl(
        lp, b["old_logp"], b["advantages"], b["mask"], ref_logp=b["ref_logp"], beta=0.1, agg=agg
    ),
    "gspo": lambda b, lp, agg: objectives.ppo_clip(
        lp, b["old_logp"], b["advantages"], b["mask"], ratio_level="sequence", agg=agg
    ),
    "cispo": lambda b, lp, agg: objectives.cispo(
        lp, b["old_logp"], b["advantages"], b["mask"], eps_low=0.2, eps_high=0.2, agg=agg
    ),
}


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("name", sorted(ALL_OBJECTIVES))
def test_fully_masked_sequence_contributes_nothing(name, agg):
    """A padding row, even holding garbage (-inf log-probs), changes neither the loss nor
    the other rows' gradients, and puts no NaN anywhere."""
    b = make_batch(8)
    keep = b["mask"].sum(1) > 0
    trimmed = {k: v[keep] for k, v in b.items()}
    padded = dict(b)
    padded["logp"] = b["logp"].copy()
    padded["logp"][~keep] = -np.inf
    padded["old_logp"] = b["old_logp"].copy()
    padded["old_logp"][~keep] = np.nan
    loss, grad = jax.value_and_grad(lambda lp: ALL_OBJECTIVES[name](padded, lp, agg)[0])(padded["logp"])
    trimmed_loss, trimmed_grad = jax.value_and_grad(lambda lp: ALL_OBJECTIVES[name](trimmed, lp, agg)[0])(
        trimmed["logp"]
    )
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss, trimmed_loss, rtol=1e-5)
    np.testing.assert_allclose(grad[keep], trimmed_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(grad[~keep], 0.0)
    _, metrics = ALL_OBJECTIVES[name](padded, jnp.asarray(padded["logp"]), agg)
    assert all(np.isfinite(v) for v in metrics.values()), metrics


def test_old_and_reference_log_probs_and_advantages_get_no_gradient():
    b = make_batch(9)

    def loss(old_logp, ref_logp, adv):
        return surrogate_with_kl(b["logp"], old_logp, adv, b["mask"], ref_logp=ref_logp, beta=0.1)[0]

    grads = jax.grad(loss, argnums=(0, 1, 2))(b["old_logp"], b["ref_logp"], b["advantages"])
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


# --- Errors ----------------------------------------------------------------------------------


def test_errors_name_the_argument_and_expected_shape():
    b = make_batch(10)
    with pytest.raises(
        ValueError, match=r"`advantages` must have shape \[B\] = \[4\].*or \[B, T\] = \[4, 5\].*got \[3\]"
    ):
        objectives.ppo_clip(b["logp"], b["old_logp"], np.zeros(3, np.float32), b["mask"])
    with pytest.raises(ValueError, match=r"`old_logp` must have the shape of `logp`, \[4, 5\]; got \[4, 4\]"):
        objectives.ppo_clip(b["logp"], b["old_logp"][:, :4], b["advantages"], b["mask"])
    with pytest.raises(ValueError, match=r"`logp` must have shape \[B, T\]; got shape \[20\]"):
        objectives.policy_gradient(b["logp"].ravel(), b["advantages"], b["mask"])
    with pytest.raises(ValueError, match="`ratio_level` must be one of 'token', 'sequence'; got 'seq'"):
        objectives.ppo_clip(b["logp"], b["old_logp"], b["advantages"], b["mask"], ratio_level="seq")
    for cap in (0.0, 25.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"`log_ratio_cap` must be in \(0.0, 20.0\]; got"):
            objectives.ppo_clip(b["logp"], b["old_logp"], b["advantages"], b["mask"], log_ratio_cap=cap)
    with pytest.raises(ValueError, match="`eps_low` must be a finite number >= 0; got -0.1"):
        objectives.ppo_clip(b["logp"], b["old_logp"], b["advantages"], b["mask"], eps_low=-0.1)
    with pytest.raises(ValueError, match=r"`dual_clip` must be in \(1.0, inf\); got 0.5"):
        objectives.ppo_clip(b["logp"], b["old_logp"], b["advantages"], b["mask"], dual_clip=0.5)
    with pytest.raises(ValueError, match="`agg` must be one of"):
        objectives.cispo(b["logp"], b["old_logp"], b["advantages"], b["mask"], eps_low=0.2, eps_high=0.2, agg="sum")
    with pytest.raises(TypeError, match="`logp` must be a floating-point array"):
        objectives.policy_gradient(np.zeros((B, T), np.int32), b["advantages"], b["mask"])


# --- Numerical safety (from review) -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_OBJECTIVES))
@pytest.mark.parametrize("advantage", [1.0, -1.0, 0.0])
def test_extreme_log_ratios_give_finite_loss_and_gradient(name, advantage):
    """A token 99 nats more likely than under pi_old (e^99 overflows float32) saturates
    at the log-ratio limit instead of turning the gradient into NaN."""
    b = make_batch(11)
    b["old_logp"] = b["logp"].copy()
    b["old_logp"][0, 0] = b["logp"][0, 0] - 99.0
    b["old_logp"][1, 0] = b["logp"][1, 0] + 99.0
    b["ref_logp"] = b["logp"] - 99.0
    b["advantages"] = np.full_like(b["advantages"], advantage)
    b["mask"] = np.ones_like(b["mask"])
    (loss, metrics), grad = jax.value_and_grad(lambda lp: ALL_OBJECTIVES[name](b, lp, "token-mean"), has_aux=True)(
        b["logp"]
    )
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), (loss, grad)
    assert all(np.isfinite(v) for v in metrics.values())


def clipped_surrogate_loop(
    logp, old_logp, advantages, mask, *, eps_low, eps_high, dual_clip, level, cap, agg, max_len=None
):
    """float64 loop: r = exp of the token's log-ratio (``level="token"``) or of its sequence's
    mean log-ratio, clamped to [-20, cap]; -min(r A, clip(r) A), and for A < 0 at most -c A."""
    logp, old_logp, mask = (np.asarray(x, np.float64) for x in (logp, old_logp, mask))
    adv = reference.per_token(advantages, logp.shape)
    per = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        seq_log_ratio = sum((logp[i, t] - old_logp[i, t]) * mask[i, t] for t in range(logp.shape[1])) / max(
            mask[i].sum(), 1.0
        )
        for t in range(logp.shape[1]):
            log_ratio = logp[i, t] - old_logp[i, t] if level == "token" else seq_log_ratio
            rho = math.exp(min(max(log_ratio, -20.0), cap))
            a = adv[i, t]
            objective = min(rho * a, reference.clip(rho, 1 - eps_low, 1 + eps_high) * a)
            if dual_clip is not None and a < 0:
                objective = max(objective, dual_clip * a)
            per[i, t] = -objective
    return reference.aggregate(per, mask, agg, max_len)


@pytest.mark.parametrize("agg", MODES)
def test_dual_clip_at_the_sequence_level_bounds_the_sequence_ratio(agg):
    """A response with A < 0 whose sequence ratio s exceeds c loses -c A and gets no gradient;
    one with 1 + eps < s < c keeps -s A."""
    b = make_batch(12)
    valid = b["mask"] > 0
    b["mask"][0] = b["mask"][1] = 1.0
    b["old_logp"][0] = b["logp"][0] - np.log(5.0)  # s = 5 > c = 3
    b["old_logp"][1] = b["logp"][1] - np.log(2.0)  # 1.2 < s = 2 < 3
    b["advantages"][:2] = [-1.0, -0.5]
    loss_fn = functools.partial(
        objectives.ppo_clip,
        old_logp=b["old_logp"],
        advantages=b["advantages"],
        mask=b["mask"],
        ratio_level="sequence",
        dual_clip=3.0,
        agg=agg,
        max_len=7,
    )
    metrics = assert_matches_reference(
        loss_fn,
        lambda lp: clipped_surrogate_loop(
            lp,
            b["old_logp"],
            b["advantages"],
            b["mask"],
            eps_low=0.2,
            eps_high=0.2,
            dual_clip=3.0,
            level="sequence",
            cap=20.0,
            agg=agg,
            max_len=7,
        ),
        b["logp"],
    )
    _, grad = jax.value_and_grad(lambda lp: loss_fn(lp)[0])(b["logp"])
    np.testing.assert_array_equal(np.asarray(grad)[0], 0.0)
    assert np.all(np.asarray(grad)[1] != 0.0)
    valid = b["mask"] > 0
    seq_ratio = np.exp(((b["logp"] - b["old_logp"]) * b["mask"]).sum(1) / np.maximum(b["mask"].sum(1), 1))
    bound = np.broadcast_to(((b["advantages"] < 0) & (seq_ratio > 3.0))[:, None], valid.shape)
    np.testing.assert_allclose(metrics["dual_clip_fraction"], bound[valid].mean(), rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_log_ratio_cap_binds_past_it(level, agg):
    """A response 12 nats a token more likely than under pi_old, with A < 0 (the unclipped
    branch): capped at 10 its ratio is e^10 and its tokens get no gradient; the default clamp
    (20) leaves e^12 and a gradient."""
    b = make_batch(13)
    b["mask"][0] = 1.0
    b["old_logp"][0] = b["logp"][0] - 12.0
    b["advantages"][0] = -1.0
    results = {}
    for cap in (10.0, objectives.LOG_RATIO_LIMIT):

        def loss_fn(lp, cap=cap):
            return objectives.ppo_clip(
                lp, b["old_logp"], b["advantages"], b["mask"], ratio_level=level, log_ratio_cap=cap, agg=agg
            )

        def reference_loss(lp, cap=cap):
            return clipped_surrogate_loop(
                lp,
                b["old_logp"],
                b["advantages"],
                b["mask"],
                eps_low=0.2,
                eps_high=0.2,
                dual_clip=None,
                level=level,
                cap=cap,
                agg=agg,
            )

        # The loss is ~1e4 here: a step of 1e-4 keeps the difference quotient's rounding small.
        metrics = assert_matches_reference(
            loss_fn,
            reference_loss,
            b["logp"],
            reference_grad=reference.finite_difference_grad(reference_loss, b["logp"], h=1e-4),
        )
        np.testing.assert_allclose(metrics["ratio_max"], np.exp(min(cap, 12.0)), rtol=1e-5)
        results[cap] = jax.value_and_grad(lambda lp, f=loss_fn: f(lp)[0])(b["logp"])
    (capped, capped_grad), (default, default_grad) = results[10.0], results[objectives.LOG_RATIO_LIMIT]
    assert float(default) > float(capped) + 1e3
    np.testing.assert_array_equal(np.asarray(capped_grad)[0], 0.0)
    assert np.all(np.asarray(default_grad)[0] > 0)  # -e^12 * A / n: pushes the token down
    np.testing.assert_array_equal(np.asarray(capped_grad)[1:], np.asarray(default_grad)[1:])


@pytest.mark.parametrize("agg", ops.AGGREGATION_MODES)
@pytest.mark.parametrize("estimator, clamp", [("k3", None), ("k1", None), ("abs", None), ("k3", 0.05)])
def test_kl_penalty_is_the_aggregated_clamped_estimate_and_reports_the_unclamped_mean(agg, estimator, clamp):
    """Against a float64 loop: loss, gradient (finite differences through the loop) and metric."""
    b = make_batch(4, ratio_noise=1.0)
    logp, ref_logp, mask = (np.asarray(b[k], np.float64) for k in ("logp", "ref_logp", "mask"))

    def loop_loss(lp):
        per_token = np.zeros_like(lp)
        for i, t in np.ndindex(lp.shape):
            value = reference.kl_estimate(lp[i, t], ref_logp[i, t], estimator)
            per_token[i, t] = value if clamp is None else min(max(value, -clamp), clamp)
        return 0.3 * reference.aggregate(per_token, mask, agg, max_len=7)

    def loss_fn(lp):
        return objectives.kl_penalty(
            lp, b["ref_logp"], b["mask"], coef=0.3, estimator=estimator, clamp=clamp, agg=agg, max_len=7
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(b["logp"], jnp.float32))
    np.testing.assert_allclose(loss, loop_loss(logp), rtol=1e-5, atol=1e-7)
    step = 1e-6
    for i, t in zip(*np.nonzero(mask)):
        bumped = logp.copy()
        bumped[i, t] += step
        lowered = logp.copy()
        lowered[i, t] -= step
        np.testing.assert_allclose(
            grad[i, t], (loop_loss(bumped) - loop_loss(lowered)) / (2 * step), rtol=1e-3, atol=1e-5
        )
    np.testing.assert_array_equal(np.asarray(grad)[mask == 0], 0.0)
    unclamped = np.vectorize(lambda a, r: reference.kl_estimate(float(a), float(r), estimator))(logp, ref_logp)
    assert set(metrics) == {f"kl_{estimator}"}
    np.testing.assert_allclose(metrics[f"kl_{estimator}"], unclamped[mask > 0].mean(), rtol=1e-5)
    if clamp is not None:
        assert np.any(unclamped[mask > 0] > clamp)  # the clamp binds somewhere, and those tokens have no gradient
        np.testing.assert_array_equal(np.asarray(grad)[(mask > 0) & (unclamped > clamp)], 0.0)


def test_a_kl_penalty_of_coefficient_zero_is_reported_only():
    """No gradient through it: a non-finite reference log-prob at a valid token reaches the
    metric, not the loss."""
    b = make_batch(6)
    ref_logp = jnp.asarray(b["ref_logp"]).at[0, 0].set(jnp.inf)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: objectives.kl_penalty(lp, ref_logp, b["mask"], coef=0.0, estimator="k1"), has_aux=True
    )(jnp.asarray(b["logp"]))
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert not np.isfinite(metrics["kl_k1"])


def test_kl_penalty_refuses_bad_settings():
    b = make_batch(5)
    with pytest.raises(ValueError, match=r"`estimator` must be one of 'k1', 'k2', 'k3', 'abs'"):
        objectives.kl_penalty(b["logp"], b["ref_logp"], b["mask"], coef=0.1, estimator="k4")
    with pytest.raises(ValueError, match=r"`clamp` must be"):
        objectives.kl_penalty(b["logp"], b["ref_logp"], b["mask"], coef=0.1, clamp=0.0)
    with pytest.raises(ValueError, match=r"`coef` must be"):
        objectives.kl_penalty(b["logp"], b["ref_logp"], b["mask"], coef=-0.1)
