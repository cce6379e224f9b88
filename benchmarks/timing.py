"""The benchmarks' one timer: warm up once (compilation, allocators), then the median."""

import time

import jax
import numpy as np


def median_seconds(fn, *args, repeats: int = 20) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls, after one untimed call.
    Results are waited for with ``jax.block_until_ready`` (a no-op for non-JAX values)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
