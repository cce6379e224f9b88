"""Test configuration: 8 simulated CPU devices, strict rank promotion, a session-wide
persistent compilation cache and XLA's quick CPU code generation for every test; memory
handed back to the system after each test module."""

import ctypes
import ctypes.util
import gc
import importlib.metadata
import os
import shutil
import signal
import tempfile

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Quick CPU code generation for every test (and, through the environment, for every worker
# and subprocess the suite starts): LLVM's optimisation level 0 and, where XLA still has them
# (jaxlib before 0.11, so the pinned set), its classic elemental emitters for fusions instead
# of the MLIR fusion emitters, which take longer to compile. XLA's own HLO passes are
# unchanged, only the machine code is less tuned. The suite's programs are small and compiled
# once or a few times, so compiling is most of their cost: a file of train steps took 27 s
# instead of 60. XLA aborts on a flag it does not know, hence the version check. The test that
# reproduces a documented run, and the real model's notebook, drop the flags
# (default_codegen_environ) for the processes they start.
QUICK_CODEGEN_FLAGS = ("--xla_backend_optimization_level=0",)
if tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    QUICK_CODEGEN_FLAGS += ("--xla_cpu_use_fusion_emitters=false",)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [flag for flag in QUICK_CODEGEN_FLAGS if flag not in _flags])


def default_codegen_environ() -> dict[str, str]:
    """This process's environment without QUICK_CODEGEN_FLAGS: for a process that runs as a user's would."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in QUICK_CODEGEN_FLAGS]
    return dict(os.environ, XLA_FLAGS=" ".join(flags))


# JAX's persistent compilation cache is on, as `training.train` turns it on for users: in a
# fresh directory per test session, shared by the xdist workers (they inherit the
# controller's environment) and the subprocesses tests start, so that a program compiled
# by one test is loaded by the next that builds the same. Removed at the end of the session.
if "JAXRL_LLM_COMPILATION_CACHE" not in os.environ:
    os.environ["JAXRL_LLM_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxrl_llm-test-xla-cache-")
    _SESSION_CACHE = os.environ["JAXRL_LLM_COMPILATION_CACHE"]

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# A suite started in the background of a non-interactive shell (`make test &`) inherits
# SIGINT ignored, and so would the subprocesses it starts; the interrupt tests send real SIGINTs.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

from jaxrl_llm import compilation_cache, host  # noqa: E402

compilation_cache.enable()


# Compilation makes the first example of a jitted property slow; deadlines would flake.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_collection_modifyitems(config, items):
    """The modules with slow tests (``@pytest.mark.slow``: end-to-end runs) first, the smaller
    before the larger, then the others, the larger first, each module kept whole: ``make test``
    (``--dist loadscope --no-loadscope-reorder``) hands whole modules to its two workers in
    this order, so a module's fixtures are set up once, and the workers start on the long
    modules and finish together on small ones."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    sizes: dict = {}
    for item in items:
        sizes[item.module] = sizes.get(item.module, 0) + 1

    def order(item):
        slow = item.module in slow_modules
        # Slow modules with the fewest tests first (a single end-to-end experiment is the longest
        # item); then the others, the larger first, so that the small ones even out the end.
        return (not slow, sizes[item.module] if slow else -sizes[item.module], item.module.__name__)

    items.sort(key=order)


def pytest_collection_finish(session):
    """What exists once the tests are collected (the imported modules, the test items) stays
    for the session: ``gc.freeze`` moves it out of the garbage collector's sight, so a full
    collection walks only what the tests build since; and full collections are deferred, as
    ``training.train`` defers them while it runs (``host.full_collections_deferred``): each
    module's end still collects everything (``pytest_runtest_teardown``). Tracing and
    lowering, much of every test's time, are Python that builds objects by the hundred
    thousand (the suite's time with and without: docs/performance.md, "The test suite")."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, host.FULL_COLLECTION_THRESHOLD)


def pytest_unconfigure(config):
    if "_SESSION_CACHE" in globals() and not hasattr(config, "workerinput"):  # the process that made it
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


_LIBC_PATH = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_PATH) if _LIBC_PATH else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures are gone by then), drops JAX's
    in-memory compilations and has glibc return the freed pages. Each distinct program a
    module compiles stays in the cache of a module-level jitted function otherwise: three
    test modules left a worker at 3.6 GB, 0.9 GB after this; two workers reached 6 GB each
    over the suite. A later module that builds the same program loads it from the session's
    persistent cache."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        jax.clear_caches()
        gc.collect()
        if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
            _LIBC.malloc_trim(0)
