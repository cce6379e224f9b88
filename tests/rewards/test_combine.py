"""Reward functions called in TRL's convention: the weighted sum, None, and every bad return."""

import fractions
import functools
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import rewards
from jaxrl_llm.rewards.combine import ON_ERROR, completion_text, reward_names

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]
IDS = [[5, 2], [8, 2], [9]]
COLUMNS = {"answer": ["2", "4", "6"], "level": [1, 2, 3]}


def _compute(fns, weights=None, *, on_error="raise", columns=COLUMNS, first_row=0):
    return rewards.compute_rewards(
        fns,
        weights or [1.0] * len(fns),
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=IDS,
        columns=columns,
        on_error=on_error,
        first_row=first_row,
    )


def accuracy(completions, answer, **kwargs):  # exactly as written for TRL
    return [float(c == a) for c, a in zip(completions, answer)]


def test_functions_get_every_argument_by_keyword_and_the_sum_is_weighted_over_those_that_apply():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.5, None, 2.0]

    result = _compute([accuracy, spy], [2.0, -1.0])
    assert {key: seen.pop(key) for key in ("trainer_state", "log_extra", "log_metric")}
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "completion_ids": IDS, **COLUMNS}
    # Slow reference: r_i = sum over j with r_ij not None of w_j r_ij.
    expected = [2.0 * 1 - 1.0 * 0.5, 2.0 * 0, 2.0 * 1 - 1.0 * 2.0]
    np.testing.assert_allclose(result.total, expected)
    assert result.total.dtype == np.float32
    np.testing.assert_array_equal(result.values["spy"], [0.5, np.nan, 2.0])
    assert result.means() == {"accuracy": pytest.approx(2 / 3), "spy": pytest.approx(1.25)}  # None left out
    assert result.errors == {}


def test_a_row_where_no_function_applies_scores_zero_and_a_function_that_never_applies_has_a_nan_mean():
    with pytest.warns(UserWarning, match=r"Every reward function returned None for every completion \(<lambda>\)"):
        result = _compute([lambda **kwargs: [None, None, None]])
    np.testing.assert_array_equal(result.total, [0, 0, 0])
    np.testing.assert_array_equal(result.unscored, [True, True, True])
    assert np.isnan(result.means()["<lambda>"])


def test_unscored_rows_are_those_no_function_applies_to_and_only_a_batch_of_them_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = _compute([lambda **kwargs: [None, 1.0, None], lambda **kwargs: [None, None, 0.5]])
    np.testing.assert_array_equal(result.unscored, [True, False, False])
    np.testing.assert_array_equal(result.total, [0.0, 1.0, 0.5])


def test_exact_rationals_are_numbers():
    result = _compute([lambda **kwargs: [fractions.Fraction(1, 2), fractions.Fraction(3), 0]])
    np.testing.assert_array_equal(result.total, [0.5, 3.0, 0.0])


def test_names_come_through_partials_and_repeated_names_are_numbered():
    exact = functools.partial(rewards.exact_match, extract="last_number")
    assert reward_names([exact, accuracy, accuracy]) == ["exact_match", "accuracy", "accuracy_2"]
    assert list(_compute([accuracy, accuracy]).values) == ["accuracy", "accuracy_2"]


def test_arrays_numpy_numbers_and_bools_are_numbers():
    result = _compute(
        [
            lambda **kwargs: np.array([1, 0, 1], np.int64),
            lambda **kwargs: [True, False, np.float32(2)],
            lambda **kwargs: jnp.array([0.5, 0.5, 0.5]),
        ]
    )
    np.testing.assert_array_equal(result.total, [2.5, 0.5, 3.5])
    with pytest.raises(rewards.RewardFunctionError, match=r"must return 3 numbers; got an array of shape \[3, 1\]"):
        _compute([lambda **kwargs: jnp.ones((3, 1))])


def test_conversational_completions_are_read_as_trl_passes_them():
    messages = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert [completion_text(m) for m in messages] == COMPLETIONS
    assert rewards.exact_match(completions=messages, answer=COLUMNS["answer"]) == [1.0, 0.0, 1.0]
    with pytest.raises(TypeError, match="a str or a list of chat messages"):
        completion_text({"content": "2"})


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, 2.0], r"'bad' returned 2 values for 3 completions"),
        ("abc", r"'bad' must return a list of 3 numbers or None; got str"),
        ({"a": 1}, r"'bad' must return a list of 3 numbers or None; got dict"),
        (7.0, r"'bad' must return a list of 3 numbers or None; got float"),
        (
            [1.0, "1", 0.0],
            r"'bad' returned '1' \(str\) at row 1 \(prompt '2\+2=', completion '5'\); it must return numbers",
        ),
        (
            [1.0, 0.0, float("nan")],
            r"'bad' returned nan at row 2 \(prompt '3\+3=', completion '6'\); rewards must be "
            r"finite float32 numbers \(\|r\| <= 3.4e\+38; return None where the function does not "
            r"apply\)",
        ),
        ([float("inf"), 0.0, 0.0], r"'bad' returned inf at row 0"),
        ([0.0, 1e39, 0.0], r"'bad' returned 1e\+39 at row 1 .* finite float32 numbers"),  # finite only in float64
        ([0.0, 0.0, 1j], r"'bad' returned 1j \(complex\) at row 2"),
    ],
)
def test_a_function_that_returns_garbage_is_named_with_the_row(returned, message):
    def bad(**kwargs):
        return returned

    for on_error in ON_ERROR:  # garbage is a bug in the function: never scored 0
        with pytest.raises(rewards.RewardFunctionError, match=message):
            _compute([accuracy, bad], on_error=on_error)


def _raises_on_level_2(completions, level, **kwargs):
    if 2 in level:
        raise KeyError("level 2 is not handled")
    return [1.0] * len(completions)


def test_a_function_that_raises_is_named_with_the_example_that_raised():
    with pytest.raises(
        rewards.RewardFunctionError,
        match=r"'_raises_on_level_2' raised KeyError: 'level 2 is not handled' at row 1 \(prompt "
        r"'2\+2=', completion '5'\)\. .* on_reward_error='zero'",
    ) as error:
        _compute([_raises_on_level_2])
    assert isinstance(error.value.__cause__, KeyError)
    # Rows numbered in the whole batch when these are a part of it (one process's share).
    with pytest.raises(rewards.RewardFunctionError, match=r"KeyError: 'level 2 is not handled' at row 11 \(prompt"):
        _compute([_raises_on_level_2], first_row=10)

    def bad(**kwargs):
        return [0.0, 1.0, float("nan")]

    with pytest.raises(rewards.RewardFunctionError, match=r"'bad' returned nan at row 12 \(prompt"):
        _compute([bad], first_row=10)


def test_with_on_error_zero_the_rows_that_raise_score_zero_and_are_counted():
    result = _compute([accuracy, _raises_on_level_2], on_error="zero")
    np.testing.assert_array_equal(result.values["_raises_on_level_2"], [1, 0, 1])
    np.testing.assert_array_equal(result.total, [2, 0, 2])
    assert result.errors == {"_raises_on_level_2": 1}


def test_a_function_that_fails_only_on_whole_batches_is_an_error():
    def one_at_a_time(completions, **kwargs):
        (completion,) = completions  # a bug: assumes one row
        return [1.0]

    with pytest.raises(
        rewards.RewardFunctionError, match="raised on the batch of 3 completions but not on any one of them alone"
    ):
        _compute([one_at_a_time])


def test_columns_may_not_shadow_the_functions_own_arguments():
    with pytest.raises(ValueError, match=r"Dataset columns \['completions'\] clash"):
        _compute([accuracy], columns={**COLUMNS, "completions": [1, 2, 3]})
    with pytest.raises(ValueError, match="`on_reward_error` must be one of"):
        _compute([accuracy], on_error="ignore")


# TRL 1.16's documented uses of `trainer_state`, `log_metric` and `log_extra`, as written there.
def curriculum(completions, trainer_state, **kwargs):
    weight = min(1.0, trainer_state.global_step / max(trainer_state.max_steps, 1) * 2)
    return [weight * float(c.isdigit()) for c in completions]


def logging_accuracy(completions, answer, log_extra=None, log_metric=None, **kwargs):
    correct = [c == a for c, a in zip(completions, answer)]
    if log_extra:
        log_extra("golden_answer", list(answer))
    if log_metric:
        log_metric("accuracy", sum(correct) / len(correct))
    return [float(c) for c in correct]


def test_functions_get_trainer_state_and_what_they_log_comes_back():
    result = rewards.compute_rewards(
        [curriculum, logging_accuracy],
        [1.0, 1.0],
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=IDS,
        columns=COLUMNS,
        trainer_state=rewards.TrainerState(global_step=5, max_steps=20, epoch=0.25),
    )
    np.testing.assert_allclose(result.values["curriculum"], [0.5, 0.5, 0.5])
    assert result.logged == {"accuracy": [pytest.approx(2 / 3)]}
    assert result.extra == {"golden_answer": ["2", "4", "6"]}
    default = _compute([curriculum])  # outside a run: step 0 of 0
    np.testing.assert_array_equal(default.values["curriculum"], [0, 0, 0])


@pytest.mark.parametrize(
    "log, message",
    [
        (lambda log_metric, **_: log_metric("accuracy", float("nan")), "must be a finite number"),
        (lambda log_metric, **_: log_metric(3, 0.5), "`name` must be a non-empty str"),
        (lambda log_extra, **_: log_extra("answer", ["a"]), r"one value per completion \(3\); got list of 1"),
        (lambda log_extra, **_: log_extra("answer", "abc"), "one value per completion"),
    ],
)
def test_bad_logs_are_named(log, message):
    def logs_badly(completions, **kwargs):
        log(**kwargs)
        return [0.0] * len(completions)

    with pytest.raises(rewards.RewardFunctionError, match=message):
        _compute([logs_badly])
