r"""Settings of the host process that JAX's CPU backend runs faster with; applied explicitly.

.. code-block:: python

    from jaxrl_llm import host
    host.reuse_freed_memory()  # first, before JAX's first computation
    import jax ...

``jaxrl-llm train`` / ``eval`` (so ``make run``), ``experiments/compare_methods.py``,
``experiments/calculator_tools.py``, notebooks 02 and 04 and ``benchmarks/grpo_step.py`` call
it; importing the library never changes the process. :func:`full_collections_deferred` is
scoped instead: :func:`jaxrl_llm.training.train` runs its steps under it, and ``jaxrl-llm``
its commands; the settings are back as they were when the block ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from collections.abc import Iterator

# mallopt(3) parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # bytes; mallopt takes an int


def reuse_freed_memory() -> bool:
    """Makes glibc's ``malloc`` keep freed memory for reuse. Returns whether it applied.

    XLA's CPU backend allocates the temporaries of each execution as one block, on a
    worker thread: 184 MB for the update of ``benchmarks/grpo_step.py``. glibc serves a
    block over 64 MB in a thread's arena with a fresh ``mmap`` and unmaps it when freed,
    so every train step faults the whole block in again, a page at a time (there: about
    47,000 page faults and 60 ms of kernel time per update). With one arena, no ``mmap``
    for large blocks and no trimming of the heap, a freed block is reused by the next
    step. The cost: the process keeps its peak heap instead of returning it to the OS.

    Process-wide, and it only reaches threads that have not allocated yet: call it
    before JAX starts its CPU backend (the first computation). A no-op returning
    ``False`` where the C library is not glibc (macOS, musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


FULL_COLLECTION_THRESHOLD = 1000
"""Generation-1 collections between two full ones under :func:`full_collections_deferred`
(CPython's default: 10)."""


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """CPython's full (generation 2) garbage collections deferred while the block runs: the
    third threshold raised to :data:`FULL_COLLECTION_THRESHOLD` (CPython's default: 10).

    Tracing and lowering a program build hundreds of thousands of Python objects, and JAX
    keeps many of them (its caches), so full collections come due while a program is built
    and each walks the whole heap, imported modules included (timings in
    ``docs/performance.md``). The younger generations go on being collected and reference
    counting frees everything else at once; only cyclic garbage that has aged into
    generation 2 waits longer, and train steps leave next to none. On exit the third
    threshold is put back as it was (the first two are left as the block leaves them);
    blocks nest, and belong to one thread. A Python whose collector has no third threshold
    (3.14's incremental one) ignores it.
    """
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, max(old, FULL_COLLECTION_THRESHOLD))
    try:
        yield
    finally:
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, old)
