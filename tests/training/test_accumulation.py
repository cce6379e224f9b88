"""Gradient accumulation and the non-finite guard, each on its own: against the whole
batch's loss and gradient computed in one pass, and against a step taken by hand."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import ops
from jaxrl_llm.training import accumulation, optim


class Rows(NamedTuple):
    x: jax.Array  # [b, N] float32
    completion_mask: jax.Array  # [b, N] bool


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _loss(params, rows, mode):
    """A loss aggregated like the methods': ``agg(w x^2 + b x)`` over the rows' tokens."""
    per_token = params["w"] * rows.x**2 + params["b"] * rows.x
    return ops.aggregate(per_token, rows.completion_mask, mode=mode, max_len=rows.x.shape[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [2, 4])
def test_accumulated_gradients_equal_the_whole_batchs(mode, parts):
    rng = np.random.default_rng(0)
    rows = Rows(
        x=jnp.asarray(rng.normal(size=(8, 5)), jnp.float32), completion_mask=jnp.asarray(rng.random((8, 5)) < 0.7)
    )
    rows = rows._replace(completion_mask=rows.completion_mask.at[3].set(False))  # a padding row
    params = {"w": jnp.float32(0.7), "b": jnp.float32(-0.3)}
    loss, grads = jax.value_and_grad(_loss)(params, rows, mode)

    def value_and_grads(part, index):
        value, part_grads = jax.value_and_grad(_loss)(params, part, mode)
        return ((value, {"loss": value, "tokens": jnp.sum(part.completion_mask).astype(jnp.float32)}, part_grads),)

    parts_of = jax.tree.map(lambda leaf: leaf.reshape(parts, -1, *leaf.shape[1:]), rows)
    ((total, metrics, total_grads),) = accumulation.accumulate_gradients(
        value_and_grads, parts_of, completion_mask=rows.completion_mask, modes=(mode,), params=(params,)
    )
    np.testing.assert_allclose(total, loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(total_grads[name], grads[name], rtol=1e-5)


def test_each_micro_batch_is_given_its_index():
    # A loss and gradient that are the micro-batch's index: with two equal halves, token-mean
    # weights of 1/2 each give (0 + 1) / 2 (the index draws each part's own randomness).
    rows = Rows(x=jnp.zeros((4, 3), jnp.float32), completion_mask=jnp.ones((4, 3), bool))

    def value_and_grads(part, index):
        value = index.astype(jnp.float32)
        return ((value, {"loss": value}, {"w": value}),)

    parts_of = jax.tree.map(lambda leaf: leaf.reshape(2, -1, *leaf.shape[1:]), rows)
    ((total, _, grads),) = accumulation.accumulate_gradients(
        value_and_grads,
        parts_of,
        completion_mask=rows.completion_mask,
        modes=("token-mean",),
        params=({"w": jnp.float32(0)},),
    )
    assert float(total) == float(grads["w"]) == 0.5


def test_metrics_combine_as_min_max_loss_weights_and_token_weights():
    metrics = {
        "loss": jnp.array([1.0, 3.0]),
        "ratio_min": jnp.array([0.5, 0.2]),
        "ratio_max": jnp.array([2.0, 1.5]),
        "entropy": jnp.array([4.0, 8.0]),
    }
    combined = accumulation.combine_metrics(metrics, jnp.array([0.25, 0.75]), jnp.array([0.5, 0.5]))
    assert {name: float(value) for name, value in combined.items()} == pytest.approx(
        {
            "loss": 0.25 * 1.0 + 0.75 * 3.0,
            "ratio_min": 0.2,
            "ratio_max": 2.0,
            "entropy": 6.0,
        }
    )


def test_the_guard_takes_a_finite_step_and_leaves_everything_as_it_was_otherwise():
    optimizer = optax.adam(0.1)
    params = {"w": jnp.array([1.0, -2.0])}
    state = optimizer.init(params)
    grads = {"w": jnp.array([0.5, 0.25])}
    updates, expected_state = optimizer.update(grads, state, params)
    assert bool(optim.update_is_finite(optimizer, grads, state, params))
    stepped, stepped_state = optim.apply_update_if(jnp.bool_(True), optimizer, grads, state, params)
    np.testing.assert_allclose(stepped["w"], optax.apply_updates(params, updates)["w"], rtol=1e-6)  # in a cond: 1 ulp
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), stepped_state, expected_state)
    kept, kept_state = optim.apply_update_if(jnp.bool_(False), optimizer, grads, state, params)
    np.testing.assert_array_equal(kept["w"], params["w"])
    jax.tree.map(np.testing.assert_array_equal, kept_state, state)


@pytest.mark.parametrize("bad", ["grad", "rate"])
def test_the_guard_sees_a_step_that_would_leave_a_parameter_not_finite(bad):
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([jnp.inf, 0.25]) if bad == "grad" else jnp.array([0.5, 0.25])}
    optimizer = optax.sgd(jnp.inf if bad == "rate" else 0.1)  # finite gradients, a step of inf
    assert not bool(optim.update_is_finite(optimizer, grads, optimizer.init(params), params))
