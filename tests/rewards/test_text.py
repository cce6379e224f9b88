"""Text rewards: exact match, math equivalence (math_verify) and format, in TRL's convention."""

import functools
import re
import signal
import threading
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.rewards import length, text
from jaxrl_llm.rewards.text import exact_match, format_reward, math_equivalence, normalize_answer

# ---------------------------------------------------------------- exact_match


def test_exact_match_hand_worked():
    completions = ["so it is 1,000.", "3.0", "whatever", "  The   Paris ", "1/2", "-0", "no number", "41"]
    answer = ["1000", 3, None, "the paris", "0.5", 0, "7", "42"]
    got = exact_match(completions=completions, answer=answer, extract=None)
    assert got == [0.0, 1.0, None, 1.0, 1.0, 1.0, 0.0, 0.0]
    got = exact_match(completions=completions, answer=answer)  # the last number
    assert got == [1.0, 1.0, None, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_exact_match_extractors_and_strict_mode():
    completions = [r"\boxed{ 12 }", "<answer>Paris</answer>", "Answer: B"]
    assert exact_match(completions=completions, answer=["12", "x", "x"], extract="boxed") == [1.0, 0.0, 0.0]
    assert exact_match(completions=completions, answer=["x", "paris", "x"], extract="answer_tag") == [0.0, 1.0, 0.0]
    pattern = re.compile(r"Answer: ([A-D])")
    assert exact_match(completions=completions, answer=["x", "x", "b"], extract=pattern) == [0.0, 0.0, 1.0]
    assert exact_match(completions=completions, answer=["x", "x", "b"], extract=pattern, normalize=False) == [
        0.0,
        0.0,
        0.0,
    ]
    assert exact_match(completions=["3.0", "3"], answer=["3", "3"], normalize=False) == [0.0, 1.0]


def test_normalize_answer():
    assert normalize_answer("  A \n b\tC ") == "a b c"
    assert normalize_answer("1,000") == normalize_answer("1000") == 1000
    assert normalize_answer("3.0") == normalize_answer("+3") == 3
    assert normalize_answer("0.5") == normalize_answer("1/2") == normalize_answer(".5") == Fraction(1, 2)
    assert normalize_answer("1/0") == "1/0"  # not a number: compared as text
    assert normalize_answer("1 2") == "1 2"  # two numbers are not one
    assert normalize_answer("0.333") != normalize_answer("1/3")
    assert normalize_answer("50%") == "50%"


@given(st.integers(-(10**12), 10**12), st.integers(0, 3))
def test_exact_match_compares_numbers_by_value(n, zeros):
    written = [f"{n:,}", str(n), f"{n}." + "0" * zeros if zeros else str(n), f"{2 * n}/2"]
    for w in written:
        assert exact_match(completions=[f"the answer is {w}"], answer=[n]) == [1.0], w
    assert exact_match(completions=[f"the answer is {n + 1}"], answer=[n]) == [0.0]


# ---------------------------------------------------------------- math_equivalence


EQUIVALENT = [
    # (reference answer, completion)
    ("0.5", r"so the answer is \boxed{\frac{1}{2}}"),
    ("1/2", "The answer is 0.5"),
    (r"\frac{1}{2}", "which is 1/2."),
    ("0.5", r"\boxed{50\%}"),  # math_verify: a percentage also matches its fraction
    (r"50\%", r"\boxed{0.5}"),
    (r"50\%", "it is 50"),  # and its number, when the reference is the percentage
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\sqrt{2}/2}"),
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}"),
    (r"\{1,2\}", r"\boxed{\{2,1\}}"),
    ("x^2+2x+1", r"\boxed{(x+1)^2}"),
    ("3", "3.0"),
    ("1000", "we get 1,000 in total"),
    ("x=3", r"\boxed{3}"),
    (r"2\pi", r"\boxed{2\pi}"),
    (r"\text{A}", r"\boxed{A}"),
    (42, r"\boxed{42}"),  # a non-string answer is read as str(answer)
]

NOT_EQUIVALENT = [
    ("1/2", r"\boxed{\frac{1}{3}}"),
    ("2", r"\boxed{-2}"),
    (r"\{1,2\}", r"\boxed{\{1,3\}}"),
    ("50", r"\boxed{0.5}"),
    ("1/3", "0.33"),
    ("7", "no answer here"),
    ("7", r"\boxed{7} wait, actually \boxed{8}"),  # the last box counts
]


def test_math_equivalence_accepts_equal_answers_and_rejects_others():
    cases = EQUIVALENT + NOT_EQUIVALENT
    got = math_equivalence(completions=[c for _, c in cases], answer=[a for a, _ in cases])
    assert got == [1.0] * len(EQUIVALENT) + [0.0] * len(NOT_EQUIVALENT), list(zip(cases, got))


def test_math_equivalence_none_answers_extractors_and_whole_text():
    got = math_equivalence(
        completions=["1/2", "1/2", "<answer>0.5</answer> 7"], answer=[None, "0.5", "1/2"], extract="answer_tag"
    )
    assert got == [None, 0.0, 1.0]  # no answer tag in the second completion
    # extract=None: math_verify's own extraction over the whole completion.
    assert math_equivalence(completions=[r"It is $\frac{1}{2}$."], answer=["0.5"], extract=None) == [1.0]


def test_math_equivalence_is_safe_off_the_main_thread():
    handler = signal.getsignal(signal.SIGALRM)
    results = {}

    def work():
        try:
            results["value"] = math_equivalence(completions=[r"\boxed{\frac12}", "3"], answer=["0.5", "4"])
        except Exception as error:  # noqa: BLE001 - surfaced in the assertion below
            results["value"] = error

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert results["value"] == [1.0, 0.0]
    assert math_equivalence(completions=["3"], answer=["3"]) == [1.0]  # main thread: alarms on, then restored
    assert signal.getsignal(signal.SIGALRM) is handler
    assert math_equivalence(completions=["3"], answer=["3"], timeout_seconds=None) == [1.0]


# ---------------------------------------------------------------- format_reward


THINK_ANSWER = [
    "<think>\nstep 1\nstep 2\n</think>\n<answer>4</answer>",  # 1 1
    "  <think></think><answer>4</answer>\n",  # 1 1: empty blocks and outer whitespace are fine
    "Sure! <think>a</think> so <answer>4</answer>",  # 0 1: text around and between
    "<answer>4</answer><think>a</think>",  # 0 0: wrong order
    "<think>a</think><think>b</think><answer>4</answer>",  # 0 1: search finds the second pair
    "<think>a<think>b</think><answer>4</answer>",  # 0 1: a block may not reopen its tag; search skips it
    "<think>a</think>",  # 0 0: missing block
    "<think>a</think><answer>4",  # 0 0: unclosed
]


def test_format_reward_tags():
    assert format_reward(completions=THINK_ANSWER, tags=("think", "answer")) == [1, 1, 0, 0, 0, 0, 0, 0]
    assert format_reward(completions=THINK_ANSWER, tags=("think", "answer"), match="search") == [1, 1, 1, 0, 1, 1, 0, 0]
    assert format_reward(completions=["<answer>x</answer>"], tags=["answer"]) == [1.0]


def test_format_reward_pattern():
    completions = ["Answer: 4", "so\nAnswer: 4", "Answer: four"]
    assert format_reward(completions=completions, pattern=r"Answer: \d+") == [1.0, 0.0, 0.0]
    assert format_reward(completions=completions, pattern=r"Answer: \d+", match="search") == [1.0, 1.0, 0.0]
    assert format_reward(completions=completions, pattern=r".*Answer: \d+") == [1.0, 1.0, 0.0]  # DOTALL
    assert format_reward(completions=completions, pattern=re.compile(r".*Answer: \d+")) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------- convention and validation


def test_every_builtin_takes_the_trl_call_and_ignores_extra_columns():
    prompts = ["What is 1 + 1?", "Name the capital of France."]
    completions = [r"<think>easy</think><answer>\boxed{2}</answer>", "<think>hm</think><answer>Paris</answer>"]
    completion_ids = [[5] * 12, [7] * 3]
    columns = dict(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        answer=["2", "paris"],
        difficulty=["easy", "easy"],
        trainer_state=None,
    )
    builtins = {
        "exact_match": (exact_match, [1.0, 0.0]),
        "exact_match_tag": (functools.partial(exact_match, extract="answer_tag"), [0.0, 1.0]),
        "math_equivalence": (math_equivalence, [1.0, 0.0]),
        "format_reward": (functools.partial(format_reward, tags=("think", "answer")), [1.0, 1.0]),
        "soft_overlong_punishment": (
            functools.partial(length.soft_overlong_punishment, max_completion_length=10, buffer=4),
            [-1.0, 0.0],
        ),
        "length_penalty": (functools.partial(length.length_penalty, target_length=6), [-1.0, 0.0]),
    }
    for name, (fn, expected) in builtins.items():
        got = fn(**columns)
        assert got == expected, name
        assert all(type(r) is float for r in got), name
        assert fn(**{**columns, "completions": [], "completion_ids": [], "answer": [], "prompts": []}) == [], name
    # The text rewards need no completion_ids.
    assert text.exact_match(prompts=prompts, completions=["2", "x"], answer=["2", "3"]) == [1.0, 0.0]
    assert text.math_equivalence(prompts=prompts, completions=["2", "x"], answer=["2", "3"]) == [1.0, 0.0]
    assert text.format_reward(prompts=prompts, completions=["2", "x"], answer=["2", "3"], pattern=r"\d") == [1.0, 0.0]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: exact_match(completions=["1"], answer=["1"], extract="number"),
            ValueError,
            r"exact_match: `extract` must be one of 'last_number', 'boxed', 'boxed_or_last_number', 'answer_tag'",
        ),
        (
            lambda: exact_match(completions=["1"], answer=["1"], normalize="yes"),
            TypeError,
            "`normalize` must be True or False",
        ),
        (
            lambda: exact_match(completions=["1", "2"], answer=["1"]),
            ValueError,
            r"`answer` must have one entry per completion \(2\); got 1",
        ),
        (lambda: exact_match(completions="1", answer=["1"]), TypeError, "`completions` must be a list"),
        (lambda: exact_match(completions=[[1]], answer=["1"]), TypeError, r"completions\[0\] is list"),
        (
            lambda: math_equivalence(completions=["1"], answer=["1"], timeout_seconds=0),
            ValueError,
            "`timeout_seconds` must be an integer >= 1 .* or None; got 0",
        ),
        (
            lambda: math_equivalence(completions=["1"], answer=["1"], timeout_seconds=1.5),
            ValueError,
            "`timeout_seconds` must be an integer >= 1",
        ),
        (
            lambda: math_equivalence(completions=["1"], answer=["1"], extract="box"),
            ValueError,
            "math_equivalence: `extract` must be one of",
        ),
        (lambda: format_reward(completions=["x"]), ValueError, "give exactly one of `pattern` and `tags`; got neither"),
        (lambda: format_reward(completions=["x"], pattern="x", tags=("a",)), ValueError, "got both"),
        (
            lambda: format_reward(completions=["x"], pattern="x", match="full"),
            ValueError,
            "`match` must be one of 'fullmatch', 'search'; got 'full'",
        ),
        (
            lambda: format_reward(completions=["x"], tags="answer"),
            ValueError,
            r"`tags` must be a non-empty tuple of tag names, e.g. \('think', 'answer'\)",
        ),
        (lambda: format_reward(completions=["x"], tags=()), ValueError, "`tags` must be a non-empty tuple"),
        (lambda: format_reward(completions=["x"], tags=("<b>",)), ValueError, "`tags` must be a tag name"),
        (
            lambda: format_reward(completions=["x"], pattern="("),
            ValueError,
            "`pattern` is not a valid regular expression",
        ),
    ],
)
def test_wrong_options_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_math_equivalence_reads_an_unboxed_latex_answer_and_prefers_the_last_box():
    completions = [
        r"so x = \frac{1}{2}",
        r"We get $\frac{1}{2}$.",
        r"first \boxed{3}, then \boxed{0.5}",
        r"\boxed{1/2} or maybe \boxed{7}",
    ]
    assert math_equivalence(completions=completions, answer=["1/2"] * 4) == [1.0, 1.0, 1.0, 0.0]
    # The last number alone would read the first as 2.
    assert math_equivalence(completions=completions[:1], answer=["1/2"], extract="boxed_or_last_number") == [0.0]
