r"""Length shaping: rewards that depend on how many tokens a completion has.

* :func:`overlong_penalty` — DAPO's soft overlong punishment on a ``[B]`` array of
  lengths (jit-able: ``experiments/toy_digits.py`` adds it to its rewards);
* :func:`soft_overlong_punishment` — the same, as a reward function in TRL's convention
  (see :mod:`jaxrl_llm.rewards.combine`), counting the tokens of ``completion_ids``: the
  trainer adds it to DAPO's rewards (:func:`jaxrl_llm.training.collect.collect_batch`);
* :func:`length_penalty` — a linear penalty for the tokens beyond a target length.

A completion's length is its number of valid tokens, the final EOS included when it
has one: ``len(completion_ids[i])`` equals the sampler's ``lengths[i]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def overlong_penalty(lengths: jax.Array, *, max_len: int, buffer: int, penalty: float = 1.0) -> jax.Array:
    r"""DAPO's soft overlong punishment, added to the reward (Yu et al., 2025, eq. 13).

    .. math::
        R_{\text{length}}(y) = \begin{cases}
          0 & |y| \le L_{max} - L_{cache} \\
          \frac{(L_{max} - L_{cache}) - |y|}{L_{cache}} \cdot p & L_{max} - L_{cache} < |y| \le L_{max} \\
          -p & |y| > L_{max}
        \end{cases}

    Args:
      lengths: ``[B]`` completion lengths in tokens.
      max_len: :math:`L_{max}`, the token limit.
      buffer: :math:`L_{cache}`, the length of the soft zone (``0 < buffer <= max_len``).
      penalty: :math:`p`, the penalty at the limit.

    Returns:
      ``[B]`` float32 penalties in ``[-p, 0]``.
    """
    if not (isinstance(buffer, int) and 0 < buffer <= max_len):
        raise ValueError(f"overlong_penalty: `buffer` must be an integer in [1, max_len={max_len}]; got {buffer!r}.")
    lengths = jnp.asarray(lengths).astype(jnp.float32)
    soft_start = max_len - buffer
    ramp = (soft_start - lengths) / buffer * penalty
    return jnp.where(lengths <= soft_start, 0.0, jnp.where(lengths <= max_len, ramp, -penalty))


def _lengths(fn: str, completion_ids: object) -> np.ndarray:
    if isinstance(completion_ids, str) or not isinstance(completion_ids, Sequence | np.ndarray):
        raise TypeError(
            f"{fn}: `completion_ids` must be a list of token-id lists (one per completion); "
            f"got {type(completion_ids).__name__}."
        )
    lengths = []
    for i, ids in enumerate(completion_ids):
        if isinstance(ids, str) or not hasattr(ids, "__len__"):
            raise TypeError(
                f"{fn}: `completion_ids` must hold lists of token ids; completion_ids[{i}] is {type(ids).__name__}."
            )
        lengths.append(len(ids))
    return np.asarray(lengths, dtype=np.int64)


def _positive_int(fn: str, name: str, value: object) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{fn}: `{name}` must be an integer >= 1; got {value!r}.")
    return value


def _non_negative(fn: str, name: str, value: object) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{fn}: `{name}` must be a finite number >= 0; got {value!r}.")
    return float(value)


def soft_overlong_punishment(
    *,
    completion_ids: Sequence[Sequence[int]],
    max_completion_length: int,
    buffer: int,
    penalty: float = 1.0,
    **kwargs: Any,
) -> list[float]:
    r"""DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) as a reward function.

    .. math::
        r_i = \begin{cases}
          0 & |y_i| \le L_{max} - L_{cache} \\
          \frac{(L_{max} - L_{cache}) - |y_i|}{L_{cache}} \cdot p & L_{max} - L_{cache} < |y_i| \le L_{max} \\
          -p & |y_i| > L_{max}
        \end{cases}

    with :math:`|y_i|` = ``len(completion_ids[i])``, the completion's tokens including its
    final EOS when it has one (the sampler's ``lengths``). Computed by
    :func:`overlong_penalty`; TRL's ``get_soft_overlong_punishment(max_completion_len,
    soft_punish_cache)`` is the case ``p = 1``.

    Args:
      completion_ids: ``B`` lists of the valid completion token ids.
      max_completion_length: :math:`L_{max}`, the token limit (an integer >= 1).
      buffer: :math:`L_{cache}`, the length of the soft zone, in ``[1, max_completion_length]``.
      penalty: :math:`p`, the penalty at the limit (a finite number >= 0).

    Returns:
      ``B`` floats in ``[-p, 0]`` (float32 values).
    """
    del kwargs
    fn = "soft_overlong_punishment"
    _positive_int(fn, "max_completion_length", max_completion_length)
    if not (isinstance(buffer, int) and not isinstance(buffer, bool) and 0 < buffer <= max_completion_length):
        raise ValueError(
            f"{fn}: `buffer` must be an integer in [1, max_completion_length={max_completion_length}]; got {buffer!r}."
        )
    penalty = _non_negative(fn, "penalty", penalty)
    lengths = _lengths(fn, completion_ids)
    if not len(lengths):
        return []
    return np.asarray(overlong_penalty(lengths, max_len=max_completion_length, buffer=buffer, penalty=penalty)).tolist()


def length_penalty(
    *,
    completion_ids: Sequence[Sequence[int]],
    target_length: int,
    scale: float = 1.0,
    **kwargs: Any,
) -> list[float]:
    r"""A linear penalty for the tokens beyond a target length; none up to it.

    .. math::
        r_i = -s \cdot \frac{\max(0,\ |y_i| - L)}{L}

    with :math:`|y_i|` = ``len(completion_ids[i])`` (final EOS included), so a completion
    twice the target length gets :math:`-s`. Unlike :func:`soft_overlong_punishment` it is
    not bounded below: use it to push towards concise answers, not to guard a hard limit.

    Args:
      completion_ids: ``B`` lists of the valid completion token ids.
      target_length: :math:`L`, the length up to which there is no penalty (an integer >= 1).
      scale: :math:`s`, the penalty per :math:`L` extra tokens (a finite number >= 0).

    Returns:
      ``B`` floats, each ``<= 0``.
    """
    del kwargs
    fn = "length_penalty"
    target_length = _positive_int(fn, "target_length", target_length)
    scale = _non_negative(fn, "scale", scale)
    return [0.0 - scale * max(0, int(n) - target_length) / target_length for n in _lengths(fn, completion_ids)]


__all__ = ["length_penalty", "overlong_penalty", "soft_overlong_punishment"]
