"""Code-execution reward: run the completion's Python against the example's tests.

TRL's reward-function convention: called with keyword arguments only (``completions``,
the dataset's columns such as ``tests``, and whatever else the trainer passes, which is
ignored), returns one ``float`` per completion, or ``None`` where the reward does not
apply. Options are keyword arguments too, so ``functools.partial(code_execution,
timeout=5.0)`` is a reward function.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from jaxrl_llm.rewards.combine import completion_text
from jaxrl_llm.rewards.sandbox import SandboxLimits, run_many

__all__ = ["code_execution", "extract_code"]

_PYTHON_TAGS = frozenset({"python", "py", "python3", "py3"})


def extract_code(text: str) -> str:
    """The Python program in a completion.

    The last fenced block tagged as Python (```` ```python ````, ``py``, ``python3``);
    failing that, the last fenced block of any kind (```` ``` ```` untagged included);
    failing that, the whole text. A final fence left open (a completion cut off at the
    length limit) runs to the end of the text. The block is dedented.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    blocks = _fenced_blocks(text)
    if not blocks:
        return text
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    return textwrap.dedent((python or [code for _, code in blocks])[-1])


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each ```` ``` ```` block, in order."""
    blocks, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        line_end = text.find("\n", start)
        if line_end < 0:
            break  # a fence with nothing after it
        info = text[start + 3 : line_end]
        if "```" in info:  # inline ```code``` on one line: not a block
            pos = start + 3 + info.index("```") + 3
            continue
        end = text.find("```", line_end + 1)
        body = text[line_end + 1 :] if end < 0 else text[line_end + 1 : end]
        blocks.append(((info.split() or [""])[0].lower(), body))
        if end < 0:
            break
        pos = end + 3
    return blocks


def code_execution(
    *,
    completions: Sequence,
    tests: Sequence[str | None],
    timeout: float = 10.0,
    memory_mb: int = 1024,
    max_workers: int | None = None,
    **kwargs,
) -> list[float | None]:
    r"""1.0 when the completion's code passes the example's tests, else 0.0.

    .. math::

        r_i = \mathbb{1}\left[\texttt{extract\_code}(c_i) \text{ runs, then } t_i
              \text{ runs in its namespace to its end}\right]

    for completion :math:`c_i` and test snippet :math:`t_i` (Python, usually
    ``assert`` statements), ``r_i = None`` where :math:`t_i` is ``None`` (the example
    has no tests: the reward does not apply). Both run in
    :func:`jaxrl_llm.rewards.sandbox.run_python`'s sandbox: the tests in a process of
    their own, which calls the completion's functions across a channel that carries only
    data, so they compare values, never the completion's objects, and the verdict is
    theirs, not the program's word (its module docstring, "Tests"). An exception, a
    failed assert, a timeout, a broken resource limit, a crash, an output flood or an
    exit before the tests ended (``sys.exit(0)`` in the solution) all score 0.0. The
    ``B`` programs run in parallel on ``max_workers`` threads (default: the CPU count).

    Args:
      completions: ``[B]`` completion texts, or TRL conversational completions (lists
        of messages; the last message's ``content`` is used).
      tests: ``[B]`` test snippets or ``None``, a dataset column.
      timeout: wall-clock seconds per program; the CPU-time limit is its ceiling.
      memory_mb: address-space limit per process, MiB.
      max_workers: programs run at once.
      **kwargs: whatever else the trainer passes (``prompts``, ``completion_ids``,
        other dataset columns); ignored.

    Returns:
      ``[B]`` list of ``1.0``, ``0.0`` or ``None``.
    """
    del kwargs  # TRL passes prompts, completion_ids, trainer_state, other columns
    if isinstance(completions, str) or isinstance(tests, str):
        raise TypeError("completions and tests must be sequences (one entry per completion), not a single str")
    completions, tests = list(completions), list(tests)
    if len(completions) != len(tests):
        raise ValueError(f"completions and tests must have the same length, got {len(completions)} and {len(tests)}")
    for i, test in enumerate(tests):
        if test is not None and not isinstance(test, str):
            raise TypeError(f"tests[{i}] must be a str of Python test code or None, got {type(test).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    limits = SandboxLimits(timeout=float(timeout), cpu_seconds=max(1, math.ceil(timeout)), memory_mb=memory_mb)

    todo = [i for i, test in enumerate(tests) if test is not None]
    programs = [extract_code(completion_text(completions[i])) for i in todo]
    results = run_many(programs, tests=[tests[i] for i in todo], limits=limits, max_workers=max_workers)
    rewards: list[float | None] = [None] * len(tests)
    for i, result in zip(todo, results):
        rewards[i] = 1.0 if result.passed else 0.0
    return rewards
