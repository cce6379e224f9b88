"""Argument checks shared by the public functions.

Most checks read only static information (shapes, dtypes, Python numbers), so they run
once at trace time and cost nothing inside ``jax.jit``. The few that read array *values*
(:func:`mask`, :func:`token_ids`, :func:`left_padded`) run only on concrete arrays (NumPy,
or an eager ``jax.Array``: reading one is a device-to-host copy) and skip tracers, so
under ``jit`` they add nothing to the compiled function either. Messages name the
function, the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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
        raise ValueError(f"{fn}: `{name}` must have the shape of `{ref_name}`, {_fmt(ref.shape)}; got {_fmt(x.shape)}.")


def host_values(x: object) -> np.ndarray | None:
    """``x``'s values as a NumPy array when they are known now, else ``None``.

    Concrete: NumPy arrays, Python numbers and lists, and eager ``jax.Array``s (copied to
    the host). ``None``: tracers (inside ``jit``, ``grad``, ``vmap``, ...) and arrays not
    fully addressable from this process.
    """
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def _listed(values: np.ndarray, limit: int = 6) -> str:
    """Sorted distinct ``values`` as ``[a, b, ...]``, at most ``limit`` of them."""
    distinct = np.unique(values).tolist()
    return "[" + ", ".join(map(str, distinct[:limit])) + (", ...]" if len(distinct) > limit else "]")


def nonempty(fn: str, name: str, x: jax.Array, need: str, *, axes: Sequence[int] | None = None) -> None:
    """Requires ``x`` to have at least one element (along ``axes``, default all); ``need``
    says what is needed, e.g. ``"at least one sequence and one token"``."""
    sizes = x.shape if axes is None else [x.shape[a] for a in axes]
    if 0 in sizes:
        raise ValueError(f"{fn}: `{name}` is empty, shape {_fmt(x.shape)}: need {need}.")


def mask(fn: str, x: jax.Array, ref_name: str, ref: jax.Array, name: str = "mask") -> jax.Array:
    """Validates a validity mask of ``ref``'s shape and returns it as a bool array.

    Bool masks pass as they are. A numeric mask must hold only 0 and 1: when its values
    are concrete (NumPy, or an eager ``jax.Array``) any other value (2, 0.5, -1, a uint8
    255, NaN) raises ``ValueError``; a traced mask (under ``jit``) cannot be read and is
    taken as ``mask != 0``, so a stray value there still never reweights anything.
    """
    array = jnp.asarray(x)
    same_shape(fn, name, array, ref_name, ref)
    if array.dtype == jnp.bool_:
        return array
    if not jnp.issubdtype(array.dtype, jnp.number):
        raise TypeError(f"{fn}: `{name}` must be boolean or numeric; got dtype {array.dtype}.")
    host = host_values(x)
    if host is not None:
        bad = host[(host != 0) & (host != 1)]
        if bad.size:
            raise ValueError(f"{fn}: `{name}` must be boolean or 0/1; got values {_listed(bad)}.")
    return array != 0


def token_ids(fn: str, name: str, x: object, vocab_size: int) -> None:
    """Requires every id of a concrete integer array ``x`` (padding included) to be in
    ``[0, vocab_size)``. Traced ids (under ``jit``) are not checked here: the caller
    documents what an out-of-range id does there. Pass the caller's original argument, so
    that a NumPy array is read where it is, without a round trip through the device."""
    host = host_values(x)
    if host is None or not np.issubdtype(host.dtype, np.integer):
        return
    bad = host[(host < 0) | (host >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"{fn}: `{name}` must hold token ids in [0, {vocab_size}) (the vocabulary); got {_listed(bad)}."
        )


def left_padded(fn: str, name: str, x: jax.Array) -> None:
    """Requires each row of a concrete ``[B, S]`` mask to be padding, then real tokens: no
    pad after a real token (right padding, or a hole). A traced mask is not checked."""
    host = host_values(x)
    if host is None:
        return
    host = host.astype(bool)
    pad_after_real = host[:, :-1] & ~host[:, 1:]  # [B, S - 1]: a real token, then a pad
    if pad_after_real.any():
        row, column = np.argwhere(pad_after_real)[0]
        raise ValueError(
            f"{fn}: `{name}` row {row} has padding at position {column + 1}, after a real token: prompts must be "
            f"left-padded, padding first and then the prompt (with a Hugging Face tokenizer, set "
            f'`tokenizer.padding_side = "left"`).'
        )


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


def finite_number(fn: str, name: str, value: object) -> None:
    """Requires a finite real number (a Python or NumPy scalar, not a bool): for configs,
    whose fields are never traced."""
    if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{fn}: `{name}` must be a finite number; got {value!r}.")


def nonnegative(fn: str, name: str, value: object) -> None:
    """Requires a finite ``value >= 0`` when it is a concrete number (traced values pass through)."""
    if is_number(value) and not 0 <= value < math.inf:  # `not` also catches NaN.
        raise ValueError(f"{fn}: `{name}` must be a finite number >= 0; got {value}.")


def positive(fn: str, name: str, value: object) -> None:
    """Requires a finite ``value > 0`` when it is a concrete number (traced values pass through)."""
    if is_number(value) and not 0 < value < math.inf:
        raise ValueError(f"{fn}: `{name}` must be a finite number > 0; got {value}.")


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


MAX_SEED = 2**63 - 1
"""The largest seed ``jax.random.key`` takes (a C long)."""


def seed(fn: str, name: str, value: object) -> None:
    """Requires an integer seed in ``[0, MAX_SEED]``."""
    nonnegative_int(fn, name, value)
    if value > MAX_SEED:
        raise ValueError(f"{fn}: `{name}` must be an integer in [0, 2**63 - 1]; got {value!r}.")
