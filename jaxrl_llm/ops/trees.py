"""Predicates over whole pytrees (params, gradients, optimizer states)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def all_finite(tree) -> jax.Array:
    """``[]`` bool: every floating-point entry of every leaf is finite (no NaN, no inf).

    Exact, unlike testing a global norm, which overflows to inf for large finite values.
    Integer and key leaves are ignored; a tree without floating leaves is finite.
    """
    checks = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)
