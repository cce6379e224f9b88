"""Answer extraction: hand-worked cases, and properties against texts built around a known answer."""

import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.rewards import extraction
from jaxrl_llm.rewards.text import normalize_answer

# Filler that holds no digit, brace, backslash, sign, dot, comma or slash, so that it
# cannot continue or create a number or a box.
FILLER = st.text(alphabet="abcxyz =:!?\n", max_size=12)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("x = -3.", "-3"),
        ("5-3=2", "2"),
        ("(x)-4", "4"),  # a minus after a closing bracket is subtraction
        ("so (-3)", "-3"),
        ("total: 1,234.50 dollars", "1,234.50"),
        ("1,000,000 ways", "1,000,000"),
        ("1, 2, 3", "3"),
        ("1,23", "23"),  # not a thousands group
        ("half is 1/2", "1/2"),
        ("-1/2", "-1/2"),
        ("about .5 cups", ".5"),
        ("v1.2.3", "3"),
        ("50%", "50"),
        ("1e5", "5"),
        (r"\frac{1}{2}", "2"),
        ("The answer is 42.\n", "42"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number_hand_worked(text, expected):
    assert extraction.last_number(text) == expected


@st.composite
def written_numbers(draw):
    """A number as a person would write it, and its exact value."""
    value = draw(st.integers(-(10**9), 10**9))
    decimals = draw(st.integers(0, 3))
    scaled = Fraction(value, 10**decimals)
    sign = "-" if value < 0 else ""
    whole, frac = divmod(abs(value), 10**decimals)
    whole_text = f"{whole:,}" if draw(st.booleans()) else str(whole)
    text = sign + whole_text + (f".{frac:0{decimals}d}" if decimals else "")
    return text, scaled


@given(st.lists(st.tuples(FILLER, written_numbers()), min_size=1, max_size=4), FILLER)
def test_last_number_finds_the_last_written_number(parts, tail):
    # Separate the numbers by a space so that "-" is a sign, not a subtraction.
    text = " ".join(filler + " " + number for filler, (number, _) in parts) + " " + tail
    last_text, last_value = parts[-1][1]
    assert extraction.last_number(text) == last_text
    assert normalize_answer(extraction.last_number(text)) == last_value


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then, correcting, \boxed{ 2 }", "2"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are literal
        (r"\boxed{\left\{ x \right\}}", r"\left\{ x \right\}"),
        (r"\boxed{3} and then \boxed{4", "3"),  # the last *complete* box
        (r"\fbox{7}", "7"),
        (r"\boxed {x^{2}}", "x^{2}"),
        (r"$\boxed{\sqrt{\frac{a}{b}}}$", r"\sqrt{\frac{a}{b}}"),
        (r"\boxed 5", None),
        (r"\boxedx{5}", None),
        ("nothing boxed", None),
    ],
)
def test_boxed_hand_worked(text, expected):
    assert extraction.boxed(text) == expected


# Brace-balanced LaTeX-ish content, built recursively.
BALANCED = st.recursive(
    st.text(alphabet="abx12+-^ ", max_size=5),
    lambda inner: st.builds(lambda a, b, c: a + "{" + b + "}" + c, inner, inner, inner),
    max_leaves=6,
)


@given(FILLER, BALANCED, BALANCED, FILLER)
def test_boxed_returns_the_last_boxes_balanced_content(before, first, content, after):
    text = before + r"\boxed{" + first + "} " + r"\boxed{" + content + "}" + after
    assert extraction.boxed(text) == content.strip()


def test_boxed_or_last_number_prefers_the_box():
    assert extraction.boxed_or_last_number(r"\boxed{7}, or 8") == "7"
    assert extraction.boxed_or_last_number("7, or 8") == "8"
    assert extraction.boxed_or_last_number("none") is None


def test_answer_tag_and_regex():
    text = "<answer> 1 </answer> wait <answer>\n2\n</answer> <answer>3"
    assert extraction.answer_tag(text) == "2"  # the last closed one, stripped
    assert extraction.answer_tag("<final>x</final>", tag="final") == "x"
    assert extraction.answer_tag("no tags") is None
    assert extraction.regex("a=1, a=2", r"a=(\d)") == "2"  # group 1 of the last match
    assert extraction.regex("a=1, a=2", r"a=\d") == "a=2"  # no group: the whole match
    assert extraction.regex("A: x", re.compile(r"a: (\w)", re.IGNORECASE)) == "x"
    assert extraction.regex("nothing", r"a=(\d)") is None
    assert extraction.regex("b", r"(a)?b") is None  # group 1 did not take part


def test_extract_dispatches_on_how():
    text = r"<answer>\boxed{5}</answer> then 6 "
    assert extraction.extract(text, "last_number") == "6"
    assert extraction.extract(text, "boxed") == "5"
    assert extraction.extract(text, "boxed_or_last_number") == "5"
    assert extraction.extract(text, "answer_tag") == r"\boxed{5}"
    assert extraction.extract(text, re.compile(r"then (\d)")) == "6"
    assert extraction.extract(text, lambda t: t[:3]) == "<an"
    assert extraction.extract(text, None) == text.strip()


def test_extract_rejects_unknown_names_and_types():
    with pytest.raises(
        ValueError,
        match=r"`how` must be one of 'last_number', 'boxed', 'boxed_or_last_number', "
        r"'answer_tag', a compiled re.Pattern, a callable or None; got 'number'",
    ):
        extraction.extract("1", "number")
    with pytest.raises(ValueError, match=r"pass re.compile\('a=\(\\\\d\)'\)"):
        extraction.extract("a=1", r"a=(\d)")  # a str is a name, never a pattern
    with pytest.raises(TypeError, match="`how` must be one of .* got int"):
        extraction.extract("1", 3)
    with pytest.raises(TypeError, match="must return a str or None; got int"):
        extraction.extract("1", lambda t: 1)
    with pytest.raises(TypeError, match="`text` must be a str"):
        extraction.last_number(None)
    with pytest.raises(ValueError, match="`tag` must be a tag name"):
        extraction.answer_tag("<a b>x</a b>", tag="a b")
    with pytest.raises(ValueError, match="`pattern` is not a valid regular expression"):
        extraction.regex("x", "(")
