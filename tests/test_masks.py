"""Every function that takes a validity mask reads it as a selection, never as weights.

A mask is bool, or numbers that are all 0 or 1: a concrete mask with any other value
(2, 0.5, -1, a uint8 255) is refused; under ``jit`` a numeric mask is read as ``!= 0``.
"""

import jax
import numpy as np
import pytest

from jaxrl_llm import advantages, objectives

B, T = 4, 5
RNG = np.random.default_rng(0)
LOGP = (RNG.normal(size=(B, T)) * 0.3 - 1.0).astype(np.float32)
OLD_LOGP = (LOGP + RNG.normal(size=(B, T)) * 0.3).astype(np.float32)
VALUES = RNG.normal(size=(B, T)).astype(np.float32)
REWARDS = RNG.normal(size=(B,)).astype(np.float32)
VALID = np.arange(T)[None, :] < np.array([[5], [3], [1], [4]])  # right-padded completions

CALLERS = {
    "ppo_clip": lambda m: objectives.ppo_clip(LOGP, OLD_LOGP, REWARDS, m),
    "grpo": lambda m: objectives.ppo_clip(LOGP, OLD_LOGP, REWARDS, m, agg="seq-mean-token-mean"),
    "policy_gradient": lambda m: objectives.policy_gradient(LOGP, REWARDS, m),
    "value_loss": lambda m: objectives.value_loss(VALUES, VALUES * 0.5, VALUES + 1.0, m, clip=0.2),
    "entropy_bonus": lambda m: objectives.entropy_bonus(-LOGP, m, coef=0.01),
    "gae": lambda m: advantages.gae(VALUES, VALUES * 0.5, m),
    "reinforce_plus_plus": lambda m: advantages.reinforce_plus_plus(REWARDS, m),
}


@pytest.mark.parametrize("name", sorted(CALLERS))
@pytest.mark.parametrize("dtype, bad", [(np.float32, 2.0), (np.float32, 0.5), (np.uint8, 255), (np.float32, -1.0)])
def test_a_concrete_mask_other_than_0_1_is_refused(name, dtype, bad):
    mask = VALID.astype(dtype)
    mask[1, 0] = bad
    with pytest.raises(ValueError, match=r"must be boolean or 0/1; got values \[" + str(mask[1, 0])):
        CALLERS[name](mask)


@pytest.mark.parametrize("name", sorted(CALLERS))
@pytest.mark.parametrize("dtype, one", [(np.float32, 2.0), (np.uint8, 255), (np.float32, -1.0)])
def test_under_jit_a_numeric_mask_selects_like_the_bool_mask(name, dtype, one):
    numeric = np.where(VALID & (np.arange(T)[None, :] % 2 == 0), one, VALID).astype(dtype)  # mixes 1 and `one`
    jitted = jax.jit(CALLERS[name])
    expected = jitted(VALID)
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6), jitted(numeric), expected
    )
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6), CALLERS[name](VALID), expected
    )


def test_a_negative_mask_entry_cannot_put_the_mean_ratio_above_the_max():
    """Read as a weight, the -1 would cancel a token in the normaliser: mean 2, max 1."""
    logp = np.full((2, 4), -1.0, np.float32)  # ratio 1 everywhere
    mask = np.array([[1, 1, -1, 0], [0, 0, 0, 0]], np.float32)
    _, metrics = jax.jit(lambda m: objectives.ppo_clip(logp, logp, np.ones(2, np.float32), m))(mask)
    assert float(metrics["ratio_mean"]) == float(metrics["ratio_max"]) == 1.0
