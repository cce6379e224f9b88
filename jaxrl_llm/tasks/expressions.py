r"""Arithmetic: "Solve 12 + 7 * 3", answered with the exact integer.

The textbook example of RL post-training (``Prompt: Solve 2 + 2``) as a task: expressions
of ``num_operands`` non-negative integers of ``digits`` digits joined by ``operators``
(``+``, ``-``, ``*``), evaluated with Python's precedence (``*`` first, then ``+`` and
``-`` left to right; results may be negative). The test split is ``test_size``
*distinct* expressions drawn from ``test_seed``, so every seed of a run evaluates on the
same problems. The train split is unbounded and held out from the test split: example
``i`` is drawn from ``(seed, i)``, drawing again while it is a test expression.

.. code-block:: python

    task = arithmetic(tokenizer=tokenizer, digits=(1, 2), operators=("+", "-", "*"))
    task.examples("test", np.arange(2), seed=0).columns
    # {'expression': ['37 - 4 * 9', ...], 'answer': ['1', ...], 'solution': ['1', ...]}

Columns: ``expression``, ``answer`` (the result as a string, what the default reward
compares against) and ``solution`` (the completion :meth:`TextTask.demonstrations` teaches:
the answer alone). The default reward is
:func:`jaxrl_llm.rewards.text.exact_match` on the completion's last number.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import transformers

from jaxrl_llm.rewards.text import exact_match
from jaxrl_llm.tasks.base import RewardFn
from jaxrl_llm.tasks.text import TextTask, format_fields, task_options

OPERATORS = ("+", "-", "*")
"""The operators :func:`arithmetic` can use."""

MAX_DIGITS = 18
"""The widest operand (operands are drawn as 64-bit integers)."""

_TRAIN, _TEST = 0, 1  # stream tags: train and test draws never share a generator state


def _range(name: str, value: Any, *, low: int, high: int | None = None) -> tuple[int, int]:
    """``value`` (an int or an inclusive ``(lo, hi)`` pair) as ``(lo, hi)`` within ``[low, high]``."""
    pair = (value, value) if isinstance(value, numbers.Integral) else value
    bound = f"{low}..{high}" if high is not None else f">= {low}"
    if not (
        isinstance(pair, Sequence)
        and len(pair) == 2
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair)
        and low <= pair[0] <= pair[1]
        and (high is None or pair[1] <= high)
    ):
        raise ValueError(
            f"arithmetic: `{name}` must be an int or an inclusive range (lo, hi) with lo <= hi, "
            f"each {bound}; got {value!r}."
        )
    return int(pair[0]), int(pair[1])


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """The value of ``operands[0] operators[0] operands[1] ...`` with ``*`` binding tighter
    than ``+`` and ``-`` (Python's precedence), in exact integers."""
    total, term = 0, operands[0]
    sign = 1
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            term *= value
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), value
    return total + sign * term


class ArithmeticSource:
    """The procedural source of :func:`arithmetic`: ``source(split, index, seed) -> record``."""

    def __init__(
        self,
        *,
        num_operands: tuple[int, int],
        digits: tuple[int, int],
        operators: tuple[str, ...],
        test_size: int | None,
        test_seed: int,
    ):
        self.num_operands, self.digits, self.operators = num_operands, digits, operators
        self.test_seed = test_seed
        space = self.space_size()
        if test_size is None:
            test_size = min(100, space // 5)
        if test_size >= space:
            raise ValueError(
                f"arithmetic: test_size={test_size} leaves none of the {space} distinct expressions of "
                f"these settings to train on; lower it or widen `digits`/`num_operands`/`operators`."
            )
        rng = np.random.default_rng((test_seed, _TEST))
        seen: dict[str, dict[str, str]] = {}
        while len(seen) < test_size:
            record = self._draw(rng)
            seen.setdefault(record["expression"], record)
        self.test = list(seen.values())
        self.test_expressions = frozenset(seen)

    def space_size(self) -> int:
        """The number of distinct expressions."""
        lo, hi = self.digits
        values = 10**hi - (10 ** (lo - 1) if lo > 1 else 0)  # operands of lo..hi digits
        return sum(
            values**n * len(self.operators) ** (n - 1) for n in range(self.num_operands[0], self.num_operands[1] + 1)
        )

    def _draw(self, rng: np.random.Generator) -> dict[str, str]:
        count = int(rng.integers(self.num_operands[0], self.num_operands[1] + 1))
        operands = []
        for width in rng.integers(self.digits[0], self.digits[1] + 1, size=count):
            low = 10 ** (int(width) - 1) if width > 1 else 0
            operands.append(int(rng.integers(low, 10 ** int(width))))
        ops = [self.operators[int(k)] for k in rng.integers(0, len(self.operators), size=count - 1)]
        expression = " ".join([str(operands[0])] + [f"{op} {value}" for op, value in zip(ops, operands[1:])])
        answer = str(evaluate(operands, ops))
        return {"expression": expression, "answer": answer, "solution": answer}

    def __call__(self, split: str, index: int, seed: int) -> dict[str, str]:
        if split == "test":
            return dict(self.test[index])
        rng = np.random.default_rng((seed, _TRAIN, index))
        while (record := self._draw(rng))["expression"] in self.test_expressions:
            pass  # held out: draw again
        return record

    def __repr__(self) -> str:
        return (
            f"ArithmeticSource(num_operands={self.num_operands}, digits={self.digits}, "
            f"operators={self.operators}, test_size={len(self.test)}, test_seed={self.test_seed})"
        )


def arithmetic(
    *,
    tokenizer: transformers.PreTrainedTokenizerBase,
    num_operands: int | tuple[int, int] = 2,
    digits: int | tuple[int, int] = 1,
    operators: Sequence[str] = ("+",),
    test_size: int | None = None,
    test_seed: int = 1234,
    prompt_format: str = "Solve {expression}",
    system_prompt: str | None = None,
    reward_fns: RewardFn | Sequence[RewardFn] | None = None,
    **settings: Any,
) -> TextTask:
    """The arithmetic task (see the module docstring).

    Args:
      tokenizer: any tokenizer, e.g. :func:`jaxrl_llm.tasks.char_tokenizer.build_char_tokenizer` over the characters
        of the prompts, or a chat model's.
      num_operands: operands per expression, ``n`` or an inclusive range ``(lo, hi)``
        drawn uniformly; at least 2.
      digits: digits per operand, ``d`` or an inclusive range ``(lo, hi)``: each operand
        draws its width uniformly, then a value of exactly that many digits (one-digit
        operands include 0), so wide and narrow operands are equally common. At most
        :data:`MAX_DIGITS`.
      operators: drawn uniformly per position, from :data:`OPERATORS`.
      test_size: distinct expressions in the test split, held out from training (fewer
        than there are); default: a fifth of them, at most 100.
      test_seed: seeds the test split.
      prompt_format: the prompt, a format string over the columns; must use
        ``{expression}``. ``"{expression} ="`` suits a tiny model with a character
        tokenizer.
      system_prompt: see :class:`TextTask`.
      reward_fns: default ``(exact_match,)``: 1 when the completion's last number equals
        the answer (:func:`jaxrl_llm.rewards.text.exact_match`).
      **settings: other :class:`TextTask` options (``reward_weights``, ``chat_template``,
        ``chat_template_kwargs``, ``plain_template``, ``eos_ids``, ``pad_id``,
        ``checkpoint``, ``stop_strings``).
    """
    settings = task_options("arithmetic", settings)
    if "prompt" in settings:
        raise TypeError("arithmetic: the prompt is `prompt_format` (a format string using '{expression}').")
    num_operands = _range("num_operands", num_operands, low=2)
    digits = _range("digits", digits, low=1, high=MAX_DIGITS)
    if isinstance(operators, str) or not isinstance(operators, Sequence) or not operators:
        raise ValueError(
            f"arithmetic: `operators` must be a non-empty tuple drawn from {OPERATORS}; got {operators!r}."
        )
    if bad := [op for op in operators if op not in OPERATORS]:
        raise ValueError(f"arithmetic: unknown operator(s) {bad!r}; allowed: {', '.join(OPERATORS)}.")
    operators = tuple(dict.fromkeys(operators))
    if test_size is not None and not (
        isinstance(test_size, numbers.Integral) and not isinstance(test_size, bool) and test_size >= 0
    ):
        raise ValueError(
            f"arithmetic: `test_size` must be an int >= 0 (or None: a fifth of the expressions, at "
            f"most 100); got {test_size!r}."
        )
    if not (isinstance(test_seed, numbers.Integral) and test_seed >= 0):
        raise ValueError(f"arithmetic: `test_seed` must be an int >= 0; got {test_seed!r}.")
    if (
        not isinstance(prompt_format, str)
        or "{" not in prompt_format
        or ("expression" not in format_fields(prompt_format, what="`prompt_format`"))
    ):
        raise ValueError(
            f"arithmetic: `prompt_format` must be a format string using '{{expression}}', e.g. "
            f"'Solve {{expression}}'; got {prompt_format!r}."
        )
    source = ArithmeticSource(
        num_operands=num_operands, digits=digits, operators=operators, test_size=test_size, test_seed=int(test_seed)
    )
    return TextTask(
        tokenizer=tokenizer,
        reward_fns=(exact_match,) if reward_fns is None else reward_fns,
        example=source,
        sizes={"train": None, "test": len(source.test)},
        prompt=prompt_format,
        system_prompt=system_prompt,
        **settings,
    )


__all__ = ["MAX_DIGITS", "OPERATORS", "ArithmeticSource", "arithmetic", "evaluate"]
