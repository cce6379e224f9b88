"""The digit-sum task: prompts and verified rewards."""

import numpy as np

from jaxrl_llm.tasks import DigitSumTask


def test_prompts_are_well_formed_and_answers_correct():
    task = DigitSumTask()
    ids, mask, answers = task.prompts(np.random.default_rng(0), 20)
    assert ids.shape == (20, 4) and mask.all()
    for row, answer in zip(ids, answers, strict=True):
        text = task.tokenizer.decode(row)
        a, b = int(text[0]), int(text[2])
        assert text[1] == "+" and text[3] == "=" and answer == (a + b) % 10


def test_rewards_score_the_first_digit_and_the_stop():
    task = DigitSumTask()
    digit = {d: task.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    eos, other = task.eos_id, digit[1]
    completions = np.array([[digit[7], eos, 0, 0], [digit[7], other, eos, 0], [digit[3], eos, 0, 0], [eos, 0, 0, 0]])
    lengths = np.array([2, 3, 2, 1])
    np.testing.assert_array_equal(task.rewards(completions, lengths, np.array([7, 7, 7, 7])), [1.5, 1.0, 0.0, 0.0])
