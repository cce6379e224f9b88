"""The test harness itself: what conftest.py promises every test."""

import jax
import jax.numpy as jnp
import pytest


def test_eight_simulated_cpu_devices():
    assert jax.device_count() == 8
    assert all(d.platform == "cpu" for d in jax.devices())


def test_implicit_rank_promotion_raises():
    with pytest.raises(ValueError, match="rank_promotion"):
        jnp.ones((2, 3)) + jnp.ones((3,))
