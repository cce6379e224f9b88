"""Test configuration: 8 simulated CPU devices, strict rank promotion and a session-wide
persistent compilation cache for every test."""

import os
import shutil
import signal
import tempfile

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache is on, as `training.train` turns it on for users: in a
# fresh directory per test session, shared by the xdist workers (they inherit the
# controller's environment) and the subprocesses tests start, so that a program compiled
# by one test is loaded by the next that builds the same. Removed at the end of the session.
if "JAXRL_LLM_COMPILATION_CACHE" not in os.environ:
    os.environ["JAXRL_LLM_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxrl_llm-test-xla-cache-")
    _SESSION_CACHE = os.environ["JAXRL_LLM_COMPILATION_CACHE"]

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# A suite started in the background of a non-interactive shell (`make test &`) inherits
# SIGINT ignored, and so would the subprocesses it starts; the interrupt tests send real SIGINTs.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

from jaxrl_llm import compilation_cache  # noqa: E402

compilation_cache.enable()


# Compilation makes the first example of a jitted property slow; deadlines would flake.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_unconfigure(config):
    if "_SESSION_CACHE" in globals() and not hasattr(config, "workerinput"):  # the process that made it
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
