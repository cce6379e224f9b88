"""The digit-sum task: prompts and verified rewards."""

import numpy as np

from jaxrl_llm import rewards
from jaxrl_llm.tasks import DigitSumTask
from jaxrl_llm.tasks.base import draw


def test_prompts_are_well_formed_and_answers_correct():
    task = DigitSumTask()
    batch = draw(task, "train", seed=0, start=5, count=20)
    assert batch.tokens.shape == (20, 4) and batch.mask.all()
    for row, text, answer in zip(batch.tokens, batch.prompts, batch.columns["answer"], strict=True):
        assert task.tokenizer.decode(row) == text
        a, b = int(text[0]), int(text[2])
        assert text[1] == "+" and text[3] == "=" and answer == (a + b) % 10
    # Addressable: the same positions give the same examples, another seed other ones.
    again = draw(task, "train", seed=0, start=10, count=5)
    np.testing.assert_array_equal(again.tokens, batch.tokens[5:10])
    assert draw(task, "train", seed=1, start=5, count=20).prompts != batch.prompts


def test_the_test_split_is_every_sum_once():
    task = DigitSumTask()
    batch = task.examples("test", np.arange(100), seed=0)
    assert sorted(batch.prompts) == sorted(f"{a}+{b}=" for a in range(10) for b in range(10))
    assert all(answer == (int(p[0]) + int(p[2])) % 10 for p, answer in zip(batch.prompts, batch.columns["answer"]))


def test_rewards_score_the_first_digit_and_the_stop():
    task = DigitSumTask()
    digit = {d: task.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    eos, other = task.eos_id, digit[1]
    completions = np.array([[digit[7], eos, 0, 0], [digit[7], other, eos, 0], [digit[3], eos, 0, 0], [eos, 0, 0, 0]])
    lengths = np.array([2, 3, 2, 1])
    np.testing.assert_array_equal(task.rewards(completions, lengths, np.array([7, 7, 7, 7])), [1.5, 1.0, 0.0, 0.0])
    # The same numbers through the reward functions, in TRL's convention (completion ids as lists).
    ids = [list(row[:n]) for row, n in zip(completions, lengths)]
    result = rewards.compute_rewards(
        task.reward_fns,
        task.reward_weights,
        prompts=["3+4="] * 4,
        completions=["7", "71", "3", ""],
        completion_ids=ids,
        columns={"answer": [7] * 4},
    )
    np.testing.assert_array_equal(result.total, [1.5, 1.0, 0.0, 0.0])
    assert list(result.values) == ["correct", "stops"]
