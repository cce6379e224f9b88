"""TRPO: conjugate gradient, Fisher-vector products and the natural-gradient step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm import kl, objectives, trpo


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12))
def test_conjugate_gradient_matches_solve_on_random_spd_systems(seed, n):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(n, n))
    a = (m @ m.T + n * np.eye(n)).astype(np.float32)  # well conditioned SPD
    b = rng.normal(size=n).astype(np.float32)
    x = jax.jit(lambda b: trpo.conjugate_gradient(lambda v: a @ v, b, iters=n + 5, tol=1e-12))(b)
    np.testing.assert_allclose(x, np.linalg.solve(a.astype(np.float64), b), rtol=2e-4, atol=2e-5)


def test_conjugate_gradient_on_pytrees_and_iteration_budget():
    rng = np.random.default_rng(0)
    blocks = {"w": rng.normal(size=(3, 3)), "b": rng.normal(size=(2, 2))}
    spd = {k: (v @ v.T + 3 * np.eye(len(v))).astype(np.float32) for k, v in blocks.items()}
    rhs = {"w": rng.normal(size=3).astype(np.float32), "b": rng.normal(size=2).astype(np.float32)}

    def matvec(v):  # block-diagonal operator on a dict pytree
        return {k: spd[k] @ v[k] for k in v}

    x = trpo.conjugate_gradient(matvec, rhs, iters=10)
    for k in rhs:
        np.testing.assert_allclose(x[k], np.linalg.solve(spd[k], rhs[k]), rtol=1e-4, atol=1e-5)
    # One iteration is steepest descent from 0: x = (r.r / r.Ar) r.
    x1 = trpo.conjugate_gradient(matvec, rhs, iters=1)
    r_dot_r = sum(float(rhs[k] @ rhs[k]) for k in rhs)
    r_a_r = sum(float(rhs[k] @ spd[k] @ rhs[k]) for k in rhs)
    for k in rhs:
        np.testing.assert_allclose(x1[k], r_dot_r / r_a_r * rhs[k], rtol=1e-5)


def softmax_policy_kl(old_logits, state_weights):
    """Mean over states of KL(pi_old(.|s) || softmax(theta_s)): a tabular softmax policy."""

    def kl_fn(params):
        per_state = kl.categorical(old_logits[None], params["logits"][None])[0]  # [S]
        return jnp.sum(state_weights * per_state)

    return kl_fn


def test_fisher_vector_product_matches_explicit_fisher_of_a_softmax_policy():
    """For pi = softmax(theta_s), the Fisher at theta_old is block diagonal with blocks
    w_s (diag(p_s) - p_s p_s^T)."""
    rng = np.random.default_rng(1)
    num_states, num_actions, damping = 3, 5, 0.1
    old_logits = rng.normal(size=(num_states, num_actions)).astype(np.float32)
    weights = np.full(num_states, 1.0 / num_states, np.float32)
    probs = np.exp(old_logits - old_logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    fisher = np.zeros((num_states * num_actions,) * 2)
    for s in range(num_states):
        block = slice(s * num_actions, (s + 1) * num_actions)
        fisher[block, block] = weights[s] * (np.diag(probs[s]) - np.outer(probs[s], probs[s]))

    fvp = trpo.fisher_vector_product(softmax_policy_kl(old_logits, weights), {"logits": old_logits}, damping=damping)
    for _ in range(3):
        v = rng.normal(size=(num_states, num_actions)).astype(np.float32)
        got = jax.jit(fvp)({"logits": v})["logits"]
        expected = (fisher + damping * np.eye(len(fisher))) @ v.ravel()
        np.testing.assert_allclose(np.asarray(got).ravel(), expected, rtol=1e-4, atol=1e-6)


def make_bandit(seed, *, cubic=0.0, num_states=4, num_actions=6, batch=64):
    """A contextual bandit, a softmax policy and a sampled batch.

    The policy's logits are ``base + u + cubic * u**3`` in the parameters ``u`` (0 at the
    old policy): with ``cubic > 0`` the KL grows faster than TRPO's quadratic model
    predicts, as it can in a neural network, so a full step can overshoot.
    """
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(num_states, num_actions)).astype(np.float32)
    states = rng.integers(0, num_states, size=batch)
    old_probs = np.exp(base) / np.exp(base).sum(-1, keepdims=True)
    actions = np.array([rng.choice(num_actions, p=old_probs[s]) for s in states])
    rewards = rng.normal(size=(num_states, num_actions)).astype(np.float32)
    advantages = rewards[states, actions] - np.mean(rewards[states, actions])
    mask = np.ones((batch, 1), np.float32)

    def logits_fn(params):
        u = params["u"]
        return (base + u + cubic * u**3)[states][:, None]  # [batch, 1, A]

    def logp_fn(params):
        logp_all = jax.nn.log_softmax(logits_fn(params)[:, 0])  # [batch, A]
        return jnp.take_along_axis(logp_all, actions[:, None], axis=-1)  # [batch, 1]

    old_params = {"u": np.zeros_like(base)}
    old_logp, old_logits = logp_fn(old_params), logits_fn(old_params)

    def surrogate_fn(params):  # -E[rho A]: PPO's surrogate with an unbounded clip range
        return objectives.ppo_clip(logp_fn(params), old_logp, advantages, mask, eps_low=None)[0]

    def kl_fn(params):  # mean KL(pi_old || pi) over the batch's states
        return jnp.mean(kl.categorical(old_logits, logits_fn(params)))

    return old_params, surrogate_fn, kl_fn


@pytest.mark.parametrize("max_kl", [0.001, 0.01, 0.05])
@pytest.mark.parametrize("damping", [1e-3, 0.1])
def test_natural_gradient_step_respects_kl_and_improves_the_surrogate(max_kl, damping):
    params, surrogate_fn, kl_fn = make_bandit(2)
    step = jax.jit(
        lambda p: trpo.natural_gradient_step(p, surrogate_fn=surrogate_fn, kl_fn=kl_fn, max_kl=max_kl, damping=damping)
    )
    new_params, info = step(params)
    assert bool(info["accepted"])
    kl_value = float(kl_fn(new_params))
    improvement = float(surrogate_fn(params) - surrogate_fn(new_params))
    assert 0 < kl_value <= max_kl
    assert improvement > 0
    np.testing.assert_allclose(info["kl"], kl_value, rtol=1e-4)
    np.testing.assert_allclose(info["improvement"], improvement, rtol=1e-4)
    # With little damping and a small radius the quadratic model is accurate: the step
    # lands near the trust region's boundary (damping shrinks it, by design).
    if damping < 0.01 and max_kl <= 0.01:
        assert kl_value > 0.8 * max_kl


def test_natural_gradient_step_backtracks_when_the_full_step_overshoots():
    params, surrogate_fn, kl_fn = make_bandit(3, cubic=3.0)
    max_kl, coef = 0.5, 0.5
    new_params, info = trpo.natural_gradient_step(
        params,
        surrogate_fn=surrogate_fn,
        kl_fn=kl_fn,
        max_kl=max_kl,
        damping=1e-3,
        backtrack_coef=coef,
        max_backtracks=20,
    )
    backtracks = int(info["backtracks"])
    assert bool(info["accepted"]) and backtracks >= 1
    assert float(kl_fn(new_params)) <= max_kl
    # Independently: the full step (undo the coef**k shrink) violates the bound.
    full_step = jax.tree.map(lambda new, old: old + (new - old) / coef**backtracks, new_params, params)
    assert float(kl_fn(full_step)) > max_kl


def test_natural_gradient_step_rejects_and_returns_old_params_when_nothing_qualifies():
    params, surrogate_fn, kl_fn = make_bandit(3, cubic=3.0)
    new_params, info = trpo.natural_gradient_step(
        params, surrogate_fn=surrogate_fn, kl_fn=kl_fn, max_kl=0.5, damping=1e-3, max_backtracks=0
    )
    assert not bool(info["accepted"])
    assert int(info["backtracks"]) == 1 and float(info["step_size"]) == 0.0
    np.testing.assert_array_equal(new_params["u"], params["u"])


def test_natural_gradient_step_at_a_stationary_point_keeps_params():
    params, _, kl_fn = make_bandit(4)
    new_params, info = trpo.natural_gradient_step(params, surrogate_fn=lambda p: jnp.float32(1.0), kl_fn=kl_fn)
    assert not bool(info["accepted"]) and float(info["grad_norm"]) == 0.0
    assert np.all(np.isfinite(new_params["u"]))
    np.testing.assert_array_equal(new_params["u"], params["u"])


def test_natural_gradient_direction_solves_the_fisher_system():
    """The accepted step is a positive multiple of -(F + lambda I)^{-1} g."""
    params, surrogate_fn, kl_fn = make_bandit(5)
    damping = 0.1
    new_params, info = trpo.natural_gradient_step(
        params, surrogate_fn=surrogate_fn, kl_fn=kl_fn, max_kl=0.01, damping=damping, cg_iters=60
    )
    flat = lambda p: np.asarray(p["u"], np.float64).ravel()  # noqa: E731
    grad = flat(jax.grad(surrogate_fn)(params))
    hessian = jax.hessian(lambda x: kl_fn({"u": x.reshape(params["u"].shape)}))(flat(params).astype(np.float32))
    natural = -np.linalg.solve(np.asarray(hessian, np.float64) + damping * np.eye(len(grad)), grad)
    step = flat(new_params) - flat(params)
    cosine = step @ natural / np.linalg.norm(step) / np.linalg.norm(natural)
    assert cosine > 0.999


def test_bad_hyperparameters_are_refused():
    params, surrogate_fn, kl_fn = make_bandit(6)
    with pytest.raises(ValueError, match="`max_kl` must be a finite number > 0; got 0.0"):
        trpo.natural_gradient_step(params, surrogate_fn=surrogate_fn, kl_fn=kl_fn, max_kl=0.0)
    with pytest.raises(ValueError, match=r"`backtrack_coef` must be in \(0.0, 1.0\); got 1.0"):
        trpo.natural_gradient_step(params, surrogate_fn=surrogate_fn, kl_fn=kl_fn, backtrack_coef=1.0)
    with pytest.raises(ValueError, match="`iters` must be an integer >= 1; got 0"):
        trpo.conjugate_gradient(lambda v: v, jnp.ones(2), iters=0)


def test_natural_gradient_step_on_bfloat16_params_keeps_dtype_and_bound():
    params, surrogate_fn, kl_fn = make_bandit(7)
    params = {"u": jnp.zeros_like(params["u"], jnp.bfloat16)}

    def surrogate_bf16(p):
        return surrogate_fn({"u": p["u"].astype(jnp.float32)})

    def kl_bf16(p):
        return kl_fn({"u": p["u"].astype(jnp.float32)})

    new_params, info = jax.jit(
        lambda p: trpo.natural_gradient_step(p, surrogate_fn=surrogate_bf16, kl_fn=kl_bf16, max_kl=0.01)
    )(params)
    assert new_params["u"].dtype == jnp.bfloat16
    assert bool(info["accepted"]) and float(kl_bf16(new_params)) <= 0.01
    assert float(surrogate_bf16(new_params)) < float(surrogate_bf16(params))


def test_conjugate_gradient_counts_only_real_iterations_when_it_stalls():
    state = trpo._conjugate_gradient(lambda v: jnp.zeros_like(v), jnp.ones(3), iters=10, tol=0.0)
    assert bool(state.stalled) and int(state.iteration) == 0
    np.testing.assert_array_equal(state.x, 0.0)
