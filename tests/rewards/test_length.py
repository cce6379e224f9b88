"""Length shaping: DAPO's soft overlong punishment (array and reward-function forms) and
the linear length penalty, against the paper's equation and plain-Python references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.rewards.length import length_penalty, overlong_penalty, soft_overlong_punishment
from tests import reference


def test_overlong_penalty_matches_dapo_equation():
    lengths = jnp.array([10, 16, 17, 18, 20, 21])
    got = overlong_penalty(lengths, max_len=20, buffer=4, penalty=1.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match=r"`buffer` must be an integer in \[1, max_len=20\]; got 21"):
        overlong_penalty(lengths, max_len=20, buffer=21)


def test_overlong_penalty_under_jit_matches_the_reference():
    lengths = np.arange(0, 26)
    # Lengths and penalty traced; max_len and buffer are static (they are validated).
    jitted = jax.jit(functools.partial(overlong_penalty, max_len=20, buffer=7))
    got = jitted(jnp.asarray(lengths, jnp.int32), penalty=jnp.float32(0.7))
    assert got.dtype == jnp.float32 and got.shape == lengths.shape
    np.testing.assert_allclose(got, reference.overlong_penalty(lengths, max_len=20, buffer=7, penalty=0.7), rtol=1e-6)


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=16),
    st.integers(1, 30),
    st.data(),
    st.floats(0.0, 2.0),
)
def test_soft_overlong_punishment_matches_the_reference(lengths, max_len, data, penalty):
    buffer = data.draw(st.integers(1, max_len))
    expected = reference.overlong_penalty(lengths, max_len=max_len, buffer=buffer, penalty=penalty)
    # The reward function counts tokens: a completion of n ids (EOS included) has length n.
    completion_ids = [list(range(n)) for n in lengths]
    rewards = soft_overlong_punishment(
        completion_ids=completion_ids, max_completion_length=max_len, buffer=buffer, penalty=penalty
    )
    assert all(type(r) is float for r in rewards)
    np.testing.assert_allclose(rewards, expected, rtol=1e-6, atol=1e-6)


def test_soft_overlong_punishment_hand_worked():
    completion_ids = [[1] * n for n in (6, 7, 9, 10, 11)] + [np.arange(8)]
    got = soft_overlong_punishment(completion_ids=completion_ids, max_completion_length=10, buffer=4, penalty=0.5)
    assert got == pytest.approx([0.0, -0.125, -0.375, -0.5, -0.5, -0.25])
    assert soft_overlong_punishment(completion_ids=[], max_completion_length=10, buffer=4) == []


def test_length_penalty_hand_worked():
    got = length_penalty(completion_ids=[[0] * n for n in (0, 5, 10, 11, 15, 20, 30)], target_length=10, scale=0.5)
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.25, -0.5, -1.0])
    assert all(r == 0.0 and str(r) == "0.0" for r in got[:3])  # +0.0, not -0.0


@given(st.lists(st.integers(0, 100), max_size=8), st.integers(1, 50), st.floats(0.0, 3.0))
def test_length_penalty_matches_its_equation(lengths, target, scale):
    got = length_penalty(completion_ids=[[0] * n for n in lengths], target_length=target, scale=scale)
    expected = [-scale * max(0, n - target) / target for n in lengths]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: soft_overlong_punishment(completion_ids=[[1]], max_completion_length=10, buffer=0),
            ValueError,
            r"soft_overlong_punishment: `buffer` must be an integer in \[1, max_completion_length=10\]; got 0",
        ),
        (
            lambda: soft_overlong_punishment(completion_ids=[[1]], max_completion_length=10, buffer=11),
            ValueError,
            "got 11",
        ),
        (
            lambda: soft_overlong_punishment(completion_ids=[[1]], max_completion_length=0, buffer=1),
            ValueError,
            "`max_completion_length` must be an integer >= 1; got 0",
        ),
        (
            lambda: soft_overlong_punishment(completion_ids=[[1]], max_completion_length=10, buffer=2, penalty=-1),
            ValueError,
            "`penalty` must be a finite number >= 0; got -1",
        ),
        (
            lambda: soft_overlong_punishment(completion_ids="abc", max_completion_length=10, buffer=2),
            TypeError,
            "`completion_ids` must be a list of token-id lists",
        ),
        (
            lambda: soft_overlong_punishment(completion_ids=[3], max_completion_length=10, buffer=2),
            TypeError,
            r"completion_ids\[0\] is int",
        ),
        (
            lambda: length_penalty(completion_ids=[[1]], target_length=0),
            ValueError,
            "length_penalty: `target_length` must be an integer >= 1; got 0",
        ),
        (
            lambda: length_penalty(completion_ids=[[1]], target_length=4, scale=float("nan")),
            ValueError,
            "`scale` must be a finite number >= 0; got nan",
        ),
    ],
)
def test_wrong_options_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
