"""Argument checks shared by the public functions.

Every check here reads only static information (shapes, dtypes, Python numbers), so it
runs once at trace time and costs nothing inside ``jax.jit``. Messages name the function,
the argument, what was expected and what was received.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def floating(fn: str, name: str, x: jax.Array) -> jax.Array:
    """Returns ``x`` as an array, requiring a floating dtype."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: `{name}` must be a floating-point array; got dtype {x.dtype}.")
    return x


def integer(fn: str, name: str, x: jax.Array) -> jax.Array:
    """Returns ``x`` as an array, requiring an integer dtype (token ids)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: `{name}` must be an integer array of token ids; got dtype {x.dtype}.")
    return x


def rank(fn: str, name: str, x: jax.Array, ndim: int, layout: str) -> None:
    """Requires ``x.ndim == ndim``; ``layout`` names the axes, e.g. ``"[B, T]"``."""
    if x.ndim != ndim:
        raise ValueError(f"{fn}: `{name}` must have shape {layout}; got shape {_fmt(x.shape)}.")


def same_shape(fn: str, name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> None:
    """Requires ``x.shape == ref.shape``."""
    if x.shape != ref.shape:
        raise ValueError(
            f"{fn}: `{name}` must have the shape of `{ref_name}`, {_fmt(ref.shape)}; "
            f"got {_fmt(x.shape)}."
        )


def mask(fn: str, x: jax.Array, ref_name: str, ref: jax.Array, name: str = "mask") -> jax.Array:
    """Validates a ``[B, T]`` validity mask (bool or 0/1 numbers) against ``ref``."""
    x = jnp.asarray(x)
    same_shape(fn, name, x, ref_name, ref)
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.number)):
        raise TypeError(f"{fn}: `{name}` must be boolean or numeric; got dtype {x.dtype}.")
    return x


def per_sequence_or_token(fn: str, name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> jax.Array:
    """Broadcasts ``x`` of shape ``[B]`` or ``[B, T]`` to ``ref``'s ``[B, T]``."""
    x = floating(fn, name, x)
    batch, length = ref.shape
    if x.shape == (batch,):
        return jnp.broadcast_to(x[:, None], (batch, length))
    if x.shape == (batch, length):
        return x
    raise ValueError(
        f"{fn}: `{name}` must have shape [B] = {_fmt((batch,))} (one value per sequence) or "
        f"[B, T] = {_fmt((batch, length))} (one per token), matching `{ref_name}`; "
        f"got {_fmt(x.shape)}."
    )


def is_number(value: object) -> bool:
    """True for Python / NumPy scalars, which can be checked eagerly (not tracers)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def nonnegative(fn: str, name: str, value: object) -> None:
    """Requires ``value >= 0`` when it is a concrete number (traced values pass through)."""
    if is_number(value) and not value >= 0:  # `not >=` also catches NaN.
        raise ValueError(f"{fn}: `{name}` must be >= 0; got {value}.")


def positive(fn: str, name: str, value: object) -> None:
    """Requires ``value > 0`` when it is a concrete number (traced values pass through)."""
    if is_number(value) and not value > 0:
        raise ValueError(f"{fn}: `{name}` must be > 0; got {value}.")


def in_range(fn: str, name: str, value: object, low: float, high: float, *, closed: str = "[]") -> None:
    """Requires ``value`` in an interval; ``closed`` is one of ``"[]", "[)", "(]", "()"``."""
    if not is_number(value):
        return
    lo_ok = value >= low if closed[0] == "[" else value > low
    hi_ok = value <= high if closed[1] == "]" else value < high
    if not (lo_ok and hi_ok):
        raise ValueError(f"{fn}: `{name}` must be in {closed[0]}{low}, {high}{closed[1]}; got {value}.")


def one_of(fn: str, name: str, value: object, allowed: Collection[object]) -> None:
    """Requires ``value`` to be one of ``allowed``."""
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{fn}: `{name}` must be one of {choices}; got {value!r}.")


def positive_int(fn: str, name: str, value: object) -> None:
    """Requires a Python int >= 1."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{fn}: `{name}` must be an integer >= 1; got {value!r}.")


def nonnegative_int(fn: str, name: str, value: object) -> None:
    """Requires a Python int >= 0."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{fn}: `{name}` must be an integer >= 0; got {value!r}.")
