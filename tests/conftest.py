"""Test configuration: 8 simulated CPU devices and strict rank promotion for every test."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `training.train` turns on JAX's persistent compilation cache; tests compile afresh (the
# tests of the cache, and of runs restarted in subprocesses, give it directories of their own).
os.environ.setdefault("JAXRL_LLM_COMPILATION_CACHE", "off")

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# Compilation makes the first example of a jitted property slow; deadlines would flake.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
