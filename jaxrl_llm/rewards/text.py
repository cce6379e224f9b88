r"""Reward functions on decoded text, in TRL's convention.

Every function here is called with keyword arguments only,

.. code-block:: python

    rewards = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

where ``completions`` are the ``B`` decoded completions in rollout order and each
dataset column (``answer``, ...) is a list aligned with them. It returns ``B`` floats,
``None`` where the reward does not apply (a row without a reference answer). Arguments a
function does not use are ignored (``**kwargs``), and its options are keyword
arguments, so ``functools.partial(exact_match, extract="boxed")`` is a reward function
too. The reference answer is the ``answer`` column.

* :func:`exact_match` — the extracted answer equals the reference, after normalization;
* :func:`math_equivalence` — the extracted answer is mathematically equal to the
  reference (``math_verify``: fractions, decimals, percentages, radicals, LaTeX, sets,
  expressions);
* :func:`format_reward` — the completion matches a pattern, or has the required
  ``<tag>...</tag>`` blocks in order.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Literal

from jaxrl_llm.rewards import extraction
from jaxrl_llm.rewards.combine import completion_text

_NUMBER_RE = re.compile(rf"[-+]?{extraction.UNSIGNED_NUMBER}")
_WHITESPACE_RE = re.compile(r"\s+")
_MATCH_MODES = ("fullmatch", "search")


def _completions(fn: str, completions: object) -> list[str]:
    """The completions' texts (strings, or TRL's conversational message lists)."""
    if isinstance(completions, str) or not isinstance(completions, Sequence):
        raise TypeError(
            f"{fn}: `completions` must be a list of decoded completions (str); got {type(completions).__name__}."
        )
    texts = []
    for i, completion in enumerate(completions):
        try:
            texts.append(completion_text(completion))
        except TypeError:
            raise TypeError(
                f"{fn}: `completions` must hold decoded strings (or TRL's lists of chat messages); "
                f"completions[{i}] is {type(completion).__name__}."
            ) from None
    return texts


def _column(fn: str, name: str, values: object, completions: Sequence[str]) -> Sequence[Any]:
    if isinstance(values, str) or not hasattr(values, "__len__") or not hasattr(values, "__getitem__"):
        raise TypeError(
            f"{fn}: `{name}` must be a list aligned with `completions` (one per completion); "
            f"got {type(values).__name__}."
        )
    if len(values) != len(completions):
        raise ValueError(f"{fn}: `{name}` must have one entry per completion ({len(completions)}); got {len(values)}.")
    return values


def _as_number(text: str) -> Fraction | None:
    """``text``'s exact value if it is one number (``-1,000.5``, ``.5``, ``1/2``), else ``None``."""
    numerator, slash, denominator = text.partition("/")
    if not _NUMBER_RE.fullmatch(numerator) or (slash and not _NUMBER_RE.fullmatch(denominator)):
        return None
    value = Fraction(numerator.replace(",", ""))
    if slash:
        divisor = Fraction(denominator.replace(",", ""))
        if divisor == 0:
            return None
        value /= divisor
    return value


def normalize_answer(text: str) -> str | Fraction:
    """The form :func:`exact_match` compares: ``text`` stripped, with whitespace runs
    collapsed to one space and case-folded; an exact :class:`~fractions.Fraction` when the
    result is a single number (signed, comma thousands groups, decimals, ``a/b``), so
    ``"1,000" == "1000"``, ``"3.0" == "3"``, ``"0.5" == "1/2"`` and ``"-0" == "0"``."""
    text = _WHITESPACE_RE.sub(" ", text.strip()).casefold()
    number = _as_number(text)
    return text if number is None else number


def exact_match(
    *,
    completions: Sequence[str],
    answer: Sequence[Any],
    extract: extraction.How = "last_number",
    normalize: bool = True,
    **kwargs: Any,
) -> list[float | None]:
    r"""1 where the completion's extracted answer equals the reference answer, else 0.

    .. math::
        r_i = \mathbb{1}\big[\, n(e(y_i)) = n(\mathrm{str}(a_i)) \,\big]

    with :math:`e` the extractor ``extract`` (see :func:`jaxrl_llm.rewards.extraction.extract`)
    and :math:`n` the normalization :func:`normalize_answer` (identity if not ``normalize``).

    Args:
      completions: ``B`` decoded completions.
      answer: ``B`` reference answers (any type: compared as ``str(a)``; ``None``: the
        row has no reference).
      extract: how to find the answer in a completion: ``"last_number"`` (default),
        ``"boxed"``, ``"boxed_or_last_number"``, ``"answer_tag"``, a compiled pattern, a
        callable, or ``None`` for the whole completion.
      normalize: compare :func:`normalize_answer` forms (default): strip, collapse
        whitespace, case-fold, and numbers by exact value (``"1,000" == "1000"``,
        ``"3.0" == "3"``, ``"0.5" == "1/2"``; but ``"0.333" != "1/3"`` and ``"50%"`` is
        not a number). ``False``: the strings must be identical.

    Returns:
      ``B`` floats: 1.0 or 0.0 (0.0 where nothing was extracted), ``None`` where the
      answer is ``None``.
    """
    del kwargs
    fn = "exact_match"
    completions = _completions(fn, completions)
    answer = _column(fn, "answer", answer, completions)
    find = extraction.extractor(extract, fn=fn, name="extract")
    if not isinstance(normalize, bool):
        raise TypeError(f"{fn}: `normalize` must be True or False; got {normalize!r}.")
    norm = normalize_answer if normalize else (lambda text: text)
    rewards: list[float | None] = []
    for text, reference in zip(completions, answer):
        if reference is None:
            rewards.append(None)
            continue
        found = find(text)
        rewards.append(float(found is not None and norm(found) == norm(str(reference))))
    return rewards


def _math_text(text: str) -> str:
    """Text for ``math_verify.parse``: a bare expression is wrapped in ``$...$`` so that its
    LaTeX extraction reads all of it; text with its own delimiters or box goes as it is."""
    if any(marker in text for marker in ("$", "\\(", "\\[", "\\boxed", "\\fbox")):
        return text
    return f"${text}$"


def math_equivalence(
    *,
    completions: Sequence[str],
    answer: Sequence[Any],
    extract: extraction.How | Literal["auto"] = "auto",
    timeout_seconds: int | None = 5,
    **kwargs: Any,
) -> list[float | None]:
    r"""1 where the completion's answer is mathematically equal to the reference, else 0.

    .. math::
        r_i = \mathbb{1}\big[\, \mathrm{verify}\big(\mathrm{parse}(a_i),\ \mathrm{parse}(e(y_i))\big) \,\big]

    with ``parse`` and ``verify`` from Hugging Face's ``math_verify`` (the grader of
    open-r1 and TRL's ``accuracy_reward``) and :math:`e` the extractor ``extract``. Both
    sides are parsed as LaTeX or plain expressions (a bare string is read as
    ``$...$``), then compared as SymPy objects: ``1/2``, ``0.5`` and ``\frac{1}{2}`` agree;
    so do ``\frac{\sqrt{2}}{2}`` and ``\sqrt{2}/2``, ``\{1,2\}`` and ``\{2,1\}``,
    ``x^2+2x+1`` and ``(x+1)^2``, ``3`` and ``3.0``, ``1,000`` and ``1000``, ``x=3`` and
    ``3``, ``\text{A}`` and ``a``. Floats agree to 6 decimals (``0.333333`` equals
    ``1/3``, ``0.33`` does not). A *reference* percentage matches both readings:
    gold ``50\%`` accepts ``50``, ``50\%`` and ``0.5``; gold ``0.5`` accepts ``50\%``
    (``math_verify``'s convention), but gold ``50`` does not accept ``0.5``. The last
    number drops a ``%``: an unboxed ``"50%"`` is read as ``50``. ``(1,2)``
    is an open interval, ``[1,2]`` a closed one. ``verify`` is not symmetric: the
    reference is the gold side.

    Timeouts: ``math_verify`` bounds parsing and comparison with ``signal.alarm``, which
    works only in the main thread. Called from the main thread, each parse and each
    comparison gets ``timeout_seconds`` (a prediction whose parse or comparison times out
    scores 0, a reference whose parse times out ``None``); the alarm replaces any
    ``SIGALRM`` handler of the caller for its duration and cancels a pending alarm.
    Called from any other thread, the timeouts are off (so it never raises
    ``math_verify``'s "signal only works in main thread" error); bound the time yourself
    there, e.g. by running the reward in a process pool. ``timeout_seconds=None`` turns
    them off everywhere.

    Args:
      completions: ``B`` decoded completions.
      answer: ``B`` reference answers (``str(a)``, LaTeX or plain; ``None``: no reference).
      extract: how to find the prediction in a completion. ``"auto"`` (default): the
        content of its last ``\boxed{}``; without one, the whole completion goes to
        ``math_verify.parse`` and its own extraction of the final LaTeX or plain answer
        (so ``"x = \frac{1}{2}"`` reads as 1/2, where the last number would be 2).
        ``None`` hands every completion to ``math_verify.parse`` (every ``\boxed{}``
        together). Otherwise an extractor of
        :func:`jaxrl_llm.rewards.extraction.extract`, e.g. ``"boxed_or_last_number"``.
      timeout_seconds: seconds allowed for each parse and each comparison in the main
        thread (an integer >= 1), or ``None`` for no timeout.

    Returns:
      ``B`` floats: 1.0 or 0.0 (0.0 where nothing was extracted), ``None`` where the
      answer is ``None`` or ``math_verify`` cannot parse it.
    """
    del kwargs
    fn = "math_equivalence"
    completions = _completions(fn, completions)
    answer = _column(fn, "answer", answer, completions)
    find = extraction.extractor("boxed" if extract == "auto" else extract, fn=fn, name="extract")
    if timeout_seconds is not None and not (
        isinstance(timeout_seconds, int) and not isinstance(timeout_seconds, bool) and timeout_seconds >= 1
    ):
        raise ValueError(
            f"{fn}: `timeout_seconds` must be an integer >= 1 (signal.alarm counts whole seconds) "
            f"or None; got {timeout_seconds!r}."
        )
    from math_verify import parse, verify  # imported on first use: sympy and antlr take a while

    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    golds: dict[str, list] = {}  # a group's G rows share one reference: parse it once
    rewards: list[float | None] = []
    for text, reference in zip(completions, answer):
        if reference is None:
            rewards.append(None)
            continue
        reference = str(reference)
        if reference not in golds:
            golds[reference] = parse(_math_text(reference), parsing_timeout=timeout)
        gold = golds[reference]
        if not gold:
            rewards.append(None)
            continue
        found = None if extract is None else find(text)
        if found is None and extract in (None, "auto"):  # the whole completion, to math_verify's own extraction
            prediction = parse(text, parsing_timeout=timeout)
        else:
            prediction = parse(_math_text(found), parsing_timeout=timeout) if found is not None else []
        rewards.append(float(bool(prediction) and verify(gold, prediction, timeout_seconds=timeout)))
    return rewards


def _tags_pattern(fn: str, tags: object, mode: str) -> re.Pattern:
    if isinstance(tags, str) or not isinstance(tags, Sequence) or not tags:
        raise ValueError(
            f"{fn}: `tags` must be a non-empty tuple of tag names, e.g. ('think', 'answer'); got {tags!r}."
        )
    blocks = []
    for tag in tags:
        extraction.check_tag_name(fn, "tags", tag)
        name = re.escape(tag)
        # The block's content may not open or close the same tag again.
        blocks.append(rf"<{name}>(?:(?!</?{name}>).)*</{name}>")
    if mode == "fullmatch":
        return re.compile(r"\s*" + r"\s*".join(blocks) + r"\s*", re.DOTALL)
    return re.compile(r".*?".join(blocks), re.DOTALL)


def format_reward(
    *,
    completions: Sequence[str],
    pattern: str | re.Pattern | None = None,
    tags: Sequence[str] | None = None,
    match: Literal["fullmatch", "search"] = "fullmatch",
    **kwargs: Any,
) -> list[float]:
    r"""1 where the completion has the required format, else 0. Give exactly one of
    ``pattern`` and ``tags``.

    .. math::
        r_i = \mathbb{1}\big[\, y_i \text{ matches the format} \,\big]

    Args:
      completions: ``B`` decoded completions.
      pattern: a regular expression. A ``str`` is compiled with ``re.DOTALL`` (``.``
        crosses lines, as completions span several); a compiled pattern keeps its flags.
      tags: tag names that must appear as ``<tag>...</tag>`` blocks in this order, e.g.
        ``("think", "answer")`` for ``<think>...</think>`` then ``<answer>...</answer>``.
        A block's content may be empty or span lines but may not contain its own tag
        again (``<think>a</think><think>b</think>`` is not one block).
      match: ``"fullmatch"`` (default): the whole completion must match ``pattern``
        (``re.fullmatch``), or consist of exactly the tag blocks in order with only
        whitespace around and between them; ``"search"``: the pattern may match anywhere
        (``re.search``), and the blocks appear in order with anything around and between.

    Returns:
      ``B`` floats, 1.0 or 0.0.
    """
    del kwargs
    fn = "format_reward"
    completions = _completions(fn, completions)
    if match not in _MATCH_MODES:
        raise ValueError(f"{fn}: `match` must be one of {', '.join(repr(m) for m in _MATCH_MODES)}; got {match!r}.")
    if (pattern is None) == (tags is None):
        raise ValueError(
            f"{fn}: give exactly one of `pattern` and `tags`; got {'both' if pattern is not None else 'neither'}."
        )
    if pattern is not None:
        compiled = extraction.compile_pattern(fn, "pattern", pattern, re.DOTALL)
    else:
        compiled = _tags_pattern(fn, tags, match)
    test = compiled.fullmatch if match == "fullmatch" else compiled.search
    return [float(test(text) is not None) for text in completions]


__all__ = ["exact_match", "format_reward", "math_equivalence", "normalize_answer"]
