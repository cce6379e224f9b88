r"""Calling reward functions the way TRL does, and combining their results.

A reward function is called with keyword arguments only:

.. code-block:: python

    fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
       trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)

every data argument a list of length ``B`` in rollout order, each dataset column repeated
to line up with the ``G`` completions of its prompt, so a function written for TRL's
``GRPOTrainer`` (``def accuracy(completions, answer, **kwargs)``) works unchanged. As
TRL's, ``trainer_state`` says where training is (:class:`TrainerState`: ``global_step``,
``max_steps``, ``epoch``), ``log_metric(name, value)`` logs a scalar (the step's metric
``name``, the mean of the values logged) and ``log_extra(column, values)`` a column of
``B`` values beside the completions (``samples.jsonl``). It
returns ``B`` numbers, where ``None`` means "does not apply". The reward is the weighted
sum over the functions that apply,

.. math::
    r_i = \sum_{j:\ r_{ij} \neq \text{None}} w_j \, r_{ij},

(0 where none applies, as TRL's ``nansum``) and each function's logged mean leaves out
its ``None`` entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The arguments every reward function receives; no dataset column may take these names."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerState:
    """Where training is, as a reward function reads it from TRL's ``trainer_state`` (the
    fields of ``transformers.TrainerState`` TRL's rewards use), for curricula."""

    global_step: int = 0
    """Train steps completed: the step being scored is ``global_step`` (0-based)."""
    max_steps: int = 0
    """The steps the run trains for (0 outside a run: an evaluation on its own)."""
    epoch: float = 0.0
    """Passes over the train split so far (prompts drawn / its size); 0 for a task
    without a fixed size (an endless generator)."""


class _BadLog(TypeError):
    """A reward function called ``log_metric`` or ``log_extra`` with what they do not take."""


class _Log:
    """Collects what reward functions log through ``log_metric`` and ``log_extra``."""

    def __init__(self, batch: int):
        self.batch = batch
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar for the step's metric ``name`` (values averaged)."""
        if not isinstance(name, str) or not name:
            raise _BadLog(f"log_metric: `name` must be a non-empty str; got {name!r:.80}.")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
            raise _BadLog(f"log_metric({name!r}, ...): `value` must be a finite number; got {value!r:.80}.")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's ``log_extra``: a column of one value per completion beside the completions."""
        if not isinstance(column, str) or not column:
            raise _BadLog(f"log_extra: `column` must be a non-empty str; got {column!r:.80}.")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != self.batch:
            raise _BadLog(
                f"log_extra({column!r}, ...): `values` must be a list of one value per completion ({self.batch}); "
                f"got {type(values).__name__}{f' of {len(values)}' if isinstance(values, Sequence) else ''}."
            )
        self.extra[column] = list(values)  # logged again: the last values


ON_ERROR = ("raise", "zero")
"""What a reward function that raises does to the run: stop it, or score the batch's
rows 0 for that function (counted in ``RewardResult.errors``)."""


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not ``B`` finite numbers or
    None. ``function`` is the reward function, ``phase`` what called it (set by
    :func:`called_in`: "the rollout of train step 3", ...), shown before the message."""

    function: Any = None
    phase: str | None = None

    def __str__(self) -> str:
        message = super().__str__()
        return message if self.phase is None else f"In {self.phase}: {message[:1].lower()}{message[1:]}"


@contextlib.contextmanager
def called_in(phase: str):
    """Names ``phase`` in a :class:`RewardFunctionError` raised by the body (the innermost
    name wins): ``with called_in(f"the rollout of train step {step}"): ...``."""
    try:
        yield
    except RewardFunctionError as error:
        if error.phase is None:
            error.phase = phase
        raise


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or, in TRL's conversational format (a list
    of messages, ``[{"role": "assistant", "content": text}]``), the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        f"A completion must be a str or a list of chat messages ending in {{'role': ..., 'content': "
        f"str}}; got {completion!r:.80}."
    )


def reward_name(fn: Any) -> str:
    """The name a reward function is logged under: its ``__name__``, through
    ``functools.partial``; an object's class name otherwise."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def reward_names(fns: Sequence[Any]) -> list[str]:
    """Distinct names for ``fns``: repeated names get ``_2``, ``_3``, ... suffixes."""
    names, seen = [], {}
    for fn in fns:
        name = reward_name(fn)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """What :func:`compute_rewards` returns."""

    total: np.ndarray  # [B] float32: sum_j w_j r_ij over the functions that apply
    values: dict[str, np.ndarray]  # name -> [B] float32, NaN where the function returned None
    errors: dict[str, int]  # name -> rows scored 0 because the function raised (on_error="zero")
    logged: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # log_metric: name -> values
    extra: dict[str, list] = dataclasses.field(default_factory=dict)  # log_extra: column -> [B] values

    @property
    def unscored(self) -> np.ndarray:
        """``[B]`` bool: the rows no function applies to (each returned None), scored 0."""
        return (
            np.all(np.isnan(np.stack(list(self.values.values()))), axis=0)
            if self.values
            else np.zeros(self.total.shape, bool)
        )

    def means(self) -> dict[str, float]:
        """Each function's mean over the rows it applies to (NaN if none)."""
        return {
            name: float(np.mean(v[~np.isnan(v)])) if (~np.isnan(v)).any() else float("nan")
            for name, v in self.values.items()
        }


def _example(index: int, prompts: Sequence[Any], completions: Sequence[str], first_row: int = 0) -> str:
    """``row i (prompt ..., completion ...)``, each shortened to 80 characters."""
    prompt, completion = (
        repr(x if len(str(x)) <= 80 else str(x)[:77] + "...") for x in (prompts[index], completions[index])
    )
    return f"row {first_row + index} (prompt {prompt}, completion {completion})"


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _checked(name: str, returned: Any, batch: int, prompts, completions, *, first_row: int = 0) -> np.ndarray:
    """``[B]`` float32 with NaN for None; raises RewardFunctionError naming the function
    and the first bad row."""
    if not isinstance(returned, (Sequence, np.ndarray)) and hasattr(returned, "__array__"):
        returned = np.asarray(returned)  # a jax.Array, a torch tensor
    if isinstance(returned, np.ndarray) and returned.ndim != 1:
        raise RewardFunctionError(
            f"Reward function {name!r} must return {batch} numbers; got an array of shape {list(returned.shape)}."
        )
    if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, (Sequence, np.ndarray)):
        raise RewardFunctionError(
            f"Reward function {name!r} must return a list of {batch} numbers or None; got {type(returned).__name__}."
        )
    if len(returned) != batch:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(returned)} values for {batch} "
            f"completions; it must return one per completion."
        )
    values = np.empty(batch, np.float32)
    for row, value in enumerate(returned):
        if value is None:
            values[row] = np.nan
            continue
        if isinstance(value, (np.generic, np.ndarray)) and np.shape(value) == ():
            value = value.item()  # NumPy scalars; bools count as 0 / 1
        try:
            number = float(value) if isinstance(value, numbers.Real) else None  # Fraction, ...
        except OverflowError:  # an int past float64's range
            number = float("inf")
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value!r} ({type(value).__name__}) at "
                f"{_example(row, prompts, completions, first_row)}; it must return numbers or None."
            )
        if not np.isfinite(number) or abs(number) > _FLOAT32_MAX:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value} at "
                f"{_example(row, prompts, completions, first_row)}; rewards must be finite float32 "
                f"numbers (|r| <= {_FLOAT32_MAX:.3g}; return None where the function does not apply)."
            )
        values[row] = number
    return values


def compute_rewards(
    reward_fns: Sequence[Any],
    weights: Sequence[float],
    *,
    prompts: Sequence[Any],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    on_error: str = "raise",
    first_row: int = 0,
    trainer_state: TrainerState | None = None,
) -> RewardResult:
    """Calls each reward function in TRL's convention and combines the results.

    Args:
      reward_fns, weights: the functions and one weight each.
      prompts, completions, completion_ids: ``[B]`` each, in rollout order.
      columns: name -> ``[B]`` values, already repeated per completion.
      on_error: ``"raise"`` (default) or ``"zero"``, see :data:`ON_ERROR`.
      first_row: the number of the first row in error messages (a part of a larger batch).
      trainer_state: passed to the functions (default: ``TrainerState()``, step 0 of 0).

    What the functions log comes back in ``logged`` (``log_metric``) and ``extra``
    (``log_extra``; a column logged twice keeps its last values).

    Raises:
      RewardFunctionError: a function raised (with ``on_error="raise"``; the original
        exception is its ``__cause__``), or returned the wrong count, a non-number, NaN or
        inf (always: a function that returns garbage is a bug, not a bad example).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"`on_reward_error` must be one of {ON_ERROR}; got {on_error!r}.")
    batch = len(completions)
    if clash := sorted(set(columns) & set(ARGUMENTS)):
        raise ValueError(
            f"Dataset columns {clash} clash with the reward functions' own arguments {ARGUMENTS}; rename them."
        )
    arguments = dict(
        columns,
        prompts=list(prompts),
        completions=list(completions),
        completion_ids=[list(ids) for ids in completion_ids],
    )
    log = _Log(batch)
    context = dict(trainer_state=trainer_state or TrainerState(), log_extra=log.log_extra, log_metric=log.log_metric)
    values, errors = {}, {}
    for name, fn in zip(reward_names(reward_fns), reward_fns, strict=True):
        try:
            try:
                returned = fn(**arguments, **context)
                values[name] = _checked(name, returned, batch, prompts, completions, first_row=first_row)
            except RewardFunctionError:
                raise
            except _BadLog as error:  # a misuse of log_metric / log_extra, not a bad example
                raise RewardFunctionError(f"Reward function {name!r}: {error}") from None
            except Exception:
                # Which rows raise? One call per row names the example, and scores the others.
                values[name], errors[name] = _row_by_row(name, fn, arguments, batch, on_error, first_row, context)
        except RewardFunctionError as error:
            error.function = fn
            raise
    if batch and values and all(np.isnan(v).all() for v in values.values()):
        warnings.warn(
            f"Every reward function returned None for every completion ({', '.join(values)}): each reward "
            "is 0 and the batch teaches nothing. None means 'does not apply'; check that the functions "
            "read the columns they need (the `reward_unscored` metric counts such rows).",
            stacklevel=2,
        )
    weighted = [w * np.nan_to_num(v, nan=0.0) for w, v in zip(weights, values.values(), strict=True)]
    with np.errstate(over="ignore"):
        total = np.sum(weighted, axis=0, dtype=np.float32)
    if not np.isfinite(total).all():
        row = int(np.flatnonzero(~np.isfinite(total))[0])
        raise RewardFunctionError(
            f"The weighted sum of the rewards overflows float32 at "
            f"{_example(row, prompts, completions, first_row)}; scale the rewards or weights."
        )
    return RewardResult(
        total=total,
        values=values,
        errors={name: count for name, count in errors.items() if count},
        logged=log.metrics,
        extra=log.extra,
    )


def _row_by_row(
    name: str, fn: Any, arguments: dict[str, list], batch: int, on_error: str, first_row: int, context: dict
) -> tuple[np.ndarray, int]:
    """``fn`` called on one row at a time, after it raised on the whole batch: ``[B]``
    values (0 where it raises) and the count of rows that raised. Its ``log_extra`` calls
    then log nothing (they would log one value a call)."""
    context = dict(context, log_extra=lambda column, values: None)
    prompts, completions = arguments["prompts"], arguments["completions"]
    values, failed = np.zeros(batch, np.float32), 0
    for row in range(batch):
        try:
            returned = fn(**{key: column[row : row + 1] for key, column in arguments.items()}, **context)
        except Exception as error:
            if on_error == "raise":
                raise RewardFunctionError(
                    f"Reward function {name!r} raised {type(error).__name__}: {error} at "
                    f"{_example(row, prompts, completions, first_row)}. Fix the function, or set "
                    f"on_reward_error='zero' (--train.on-reward-error zero) to score such completions 0 "
                    f"(counted in the `reward_errors` metric)."
                ) from error
            failed += 1
            continue
        values[row] = _checked(
            name, returned, 1, prompts[row : row + 1], completions[row : row + 1], first_row=first_row + row
        )[0]
    if not failed and on_error == "raise":  # each row alone works; the batch does not
        raise RewardFunctionError(
            f"Reward function {name!r} raised on the batch of {batch} completions but not on "
            f"any one of them alone; it must accept lists of any length."
        )
    return values, failed
