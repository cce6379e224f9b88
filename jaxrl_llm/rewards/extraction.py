r"""Answer extraction: the final answer of a completion, as a string, or ``None``.

Each extractor takes one decoded completion and returns the text of its final answer,
or ``None`` when the completion has none in that style. "Final" is always the *last*
occurrence: models restate, correct themselves and box their answer at the end.

* :func:`last_number` — the last number (``-3``, ``1,234``, ``3.5``, ``.5``, ``1/2``);
* :func:`boxed` — the content of the last ``\boxed{...}`` (or ``\fbox{...}``);
* :func:`boxed_or_last_number` — :func:`boxed`, else :func:`last_number`;
* :func:`answer_tag` — the content of the last ``<answer>...</answer>``;
* :func:`regex` — group 1 (else the whole match) of a pattern's last match;
* :func:`extract` — one of the above chosen by a ``how`` argument, the form the reward
  functions of :mod:`jaxrl_llm.rewards.text` take.

.. code-block:: python

    extract(r"so $x = \boxed{\frac{1}{2}}$", "boxed")      # '\\frac{1}{2}'
    extract("3 apples and 1,250 pears", "last_number")      # '1,250'
    extract("Answer: B", re.compile(r"Answer:\s*([A-D])"))  # 'B'
"""

from __future__ import annotations

import re
from collections.abc import Callable

# An unsigned decimal (also the numbers rewards.text reads): digits with optional thousands
# groups ("1,234" — groups of exactly three digits, so "1,23" is two numbers), an optional
# fraction part, or a bare ".5".
UNSIGNED_NUMBER = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+)"
# A minus sign belongs to the number unless it follows a word character or a closing
# bracket, where it is a binary minus: "5-3" ends in "3", "x = -3" in "-3".
_NUMBER_RE = re.compile(rf"(?:(?<![\w)\]}}])-)?{UNSIGNED_NUMBER}(?:/{UNSIGNED_NUMBER})?")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG_NAME_RE = re.compile(r"[A-Za-z_][\w.:-]*")

EXTRACTORS = ("last_number", "boxed", "boxed_or_last_number", "answer_tag")
"""The names :func:`extract` accepts as ``how``."""

How = str | re.Pattern | Callable[[str], "str | None"] | None
"""What :func:`extract` accepts: a name in :data:`EXTRACTORS`, a compiled pattern, a
callable ``text -> str | None``, or ``None`` (the whole text, stripped)."""


def _check_text(fn: str, text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{fn}: `text` must be a str (a decoded completion); got {type(text).__name__}.")
    return text


def last_number(text: str) -> str | None:
    r"""The last number in ``text``, as written (thousands separators kept), or ``None``.

    A number is an optional minus sign, digits with optional comma thousands groups, an
    optional decimal part, and an optional ``/`` denominator of the same form:

    ============================  ==============
    text                          last number
    ============================  ==============
    ``"x = -3."``                 ``"-3"``
    ``"5-3=2"``                   ``"2"``
    ``"total: 1,234.50 dollars"`` ``"1,234.50"``
    ``"half is 1/2"``             ``"1/2"``
    ``"1, 2, 3"``                 ``"3"``
    ``"50%"``                     ``"50"``
    ============================  ==============

    Conventions: a comma followed by exactly three digits is a thousands separator
    (``"1,000"`` is one thousand; ``"100,200"`` is one number, not two); a minus sign
    right after a word character or a closing bracket is subtraction, not a sign
    (``"5-3"`` ends in ``"3"``); a trailing full stop is not a decimal point; no
    exponents (``"1e5"`` ends in ``"5"``), no percent sign, no LaTeX (``\frac{1}{2}``
    ends in ``"2"``: use :func:`boxed`).
    """
    matches = _NUMBER_RE.findall(_check_text("last_number", text))
    return matches[-1] if matches else None


def _balanced(text: str, start: int) -> int | None:
    """The index of the ``}`` closing the group opened just before ``start``, or ``None``.
    A backslash escapes the next character, so ``\\{`` and ``\\}`` are literal braces."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def boxed(text: str) -> str | None:
    r"""The content of the last complete ``\boxed{...}`` or ``\fbox{...}``, stripped.

    Braces nest (``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``) and escaped braces are
    literal (``\boxed{\{1, 2\}}`` gives ``\{1, 2\}``). A box whose group never closes
    (a truncated completion) is skipped, so the last *complete* box counts; ``None``
    when there is none. Only braced boxes count (``\boxed 5`` does not).
    """
    text = _check_text("boxed", text)
    for match in reversed(list(_BOX_RE.finditer(text))):
        end = _balanced(text, match.end())
        if end is not None:
            return text[match.end() : end].strip()
    return None


def boxed_or_last_number(text: str) -> str | None:
    r""":func:`boxed` if ``text`` has a complete box, else :func:`last_number`."""
    found = boxed(text)
    return found if found is not None else last_number(text)


def answer_tag(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` (``<answer>...</answer>`` by default),
    stripped; ``None`` when there is none. Content spans lines; an unclosed tag does not
    count; the content is the shortest one (``<a>1</a><a>2</a>`` has two, the last is ``2``).
    """
    text = _check_text("answer_tag", text)
    check_tag_name("answer_tag", "tag", tag)
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def regex(text: str, pattern: str | re.Pattern) -> str | None:
    """Group 1 of the last match of ``pattern`` in ``text`` if it has groups, else the
    whole match; ``None`` when it does not match (or group 1 did not take part).

    The text is returned as matched, not stripped. A ``str`` pattern is compiled as is
    (no flags); pass a compiled pattern for flags such as ``re.DOTALL``.
    """
    text = _check_text("regex", text)
    pattern = compile_pattern("regex", "pattern", pattern)
    last = None
    for last in pattern.finditer(text):  # noqa: B007 (keeps the last match)
        pass
    if last is None:
        return None
    return last.group(1) if pattern.groups else last.group(0)


def compile_pattern(fn: str, name: str, pattern: object, flags: int = 0) -> re.Pattern:
    """``pattern`` compiled (a compiled one as it is); ``fn`` and ``name`` say whose argument it is in errors.

    Raises:
      TypeError: not a str or a compiled pattern.
      ValueError: not a valid regular expression.
    """
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"{fn}: `{name}` must be a str or a compiled re.Pattern; got {type(pattern).__name__}.")
    try:
        return re.compile(pattern, flags)
    except re.error as error:
        raise ValueError(f"{fn}: `{name}` is not a valid regular expression ({error}); got {pattern!r}.") from None


def check_tag_name(fn: str, name: str, tag: object) -> str:
    """``tag`` if it is an XML-style tag name (``answer``, ``think``); ``fn`` and ``name`` say whose argument it is.

    Raises:
      ValueError: it is not.
    """
    if not (isinstance(tag, str) and _TAG_NAME_RE.fullmatch(tag)):
        raise ValueError(
            f"{fn}: `{name}` must be a tag name such as 'answer' (letters, digits, '_', '-', '.', ':'); got {tag!r}."
        )
    return tag


def _strip(text: str) -> str:
    return text.strip()


def extractor(how: How, *, fn: str = "extract", name: str = "how") -> Callable[[str], str | None]:
    """The extractor ``how`` names, as a function ``text -> str | None``; ``fn`` and
    ``name`` say whose argument it is in error messages. See :func:`extract`."""
    if how is None:
        return _strip
    if isinstance(how, str):
        if how not in EXTRACTORS:
            allowed = ", ".join(repr(e) for e in EXTRACTORS)
            raise ValueError(
                f"{fn}: `{name}` must be one of {allowed}, a compiled re.Pattern, a callable or None; "
                f"got {how!r} (for a regular expression pass re.compile({how!r}))."
            )
        return globals()[how]
    if isinstance(how, re.Pattern):
        return lambda text: regex(text, how)
    if callable(how):

        def call(text: str) -> str | None:
            out = how(text)
            if out is not None and not isinstance(out, str):
                raise TypeError(
                    f"{fn}: the extractor `{name}`={how!r} must return a str or None; got {type(out).__name__}."
                )
            return out

        return call
    raise TypeError(
        f"{fn}: `{name}` must be one of {', '.join(repr(e) for e in EXTRACTORS)}, a compiled re.Pattern, "
        f"a callable or None; got {type(how).__name__}."
    )


def extract(text: str, how: How) -> str | None:
    r"""The final answer of ``text``, in the style ``how`` names.

    Args:
      text: one decoded completion.
      how: ``"last_number"``, ``"boxed"``, ``"boxed_or_last_number"`` or
        ``"answer_tag"`` (the functions of this module of those names); a compiled
        ``re.Pattern`` (:func:`regex`: group 1, else the whole last match); a callable
        ``text -> str | None``; or ``None``, the whole text, stripped. A plain ``str`` is
        always a name, never a pattern: an unknown one is an error, so a typo cannot
        silently become a regular expression.

    Returns:
      The answer's text, or ``None`` when ``text`` has none in that style.
    """
    return extractor(how)(_check_text("extract", text))


__all__ = [
    "EXTRACTORS",
    "How",
    "answer_tag",
    "boxed",
    "boxed_or_last_number",
    "extract",
    "extractor",
    "last_number",
    "regex",
]
