"""The arithmetic task: exact answers with Python's precedence, validation, determinism."""

import re

import numpy as np
import pytest

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks import expressions as arith
from tests.tasks.fixtures import char_tokenizer, chat_tokenizer

EXPRESSION = re.compile(r"\d+( [-+*] \d+)*")


def task(**options):
    return arith.arithmetic(tokenizer=char_tokenizer(), **options)


def test_answers_equal_python_eval_over_many_examples():
    t = task(num_operands=(2, 5), digits=(1, 3), operators=("+", "-", "*"), test_size=50)
    train = base.draw(t, "train", seed=11, start=0, count=400)
    test = t.examples("test", np.arange(50), seed=0)
    negatives = 0
    for batch in (train, test):
        for expression, answer, solution, prompt in zip(
            batch.columns["expression"], batch.columns["answer"], batch.columns["solution"], batch.prompts, strict=True
        ):
            assert EXPRESSION.fullmatch(expression), expression
            assert answer == solution == str(eval(expression))  # noqa: S307 (our own digits and operators)
            assert prompt == f"Solve {expression}"
            negatives += answer.startswith("-")
    assert negatives > 0  # subtraction reaches negative results


def test_evaluate_uses_python_precedence():
    assert arith.evaluate([2, 3, 4], ["+", "*"]) == 14
    assert arith.evaluate([2, 3, 4], ["*", "-"]) == 2
    assert arith.evaluate([10, 2, 3], ["-", "-"]) == 5
    assert arith.evaluate([7, 2, 3, 4], ["-", "*", "*"]) == -17
    assert arith.evaluate([5], []) == 5


def test_operand_counts_and_widths_stay_in_range():
    t = task(num_operands=(2, 3), digits=(2, 3), operators=("*",), test_size=10)
    batch = base.draw(t, "train", seed=0, start=0, count=300)
    counts, widths = set(), set()
    for expression in batch.columns["expression"]:
        operands = expression.split(" * ")
        counts.add(len(operands))
        widths.update(len(o) for o in operands)
    assert counts == {2, 3} and widths == {2, 3}


def test_determinism_and_splits():
    t = task(digits=2, operators=("+", "-"), test_size=30)
    first = base.draw(t, "train", seed=5, start=10, count=20).columns["expression"]
    assert first == base.draw(t, "train", seed=5, start=10, count=20).columns["expression"]
    assert first[5:] == base.draw(t, "train", seed=5, start=15, count=15).columns["expression"]
    assert first != base.draw(t, "train", seed=6, start=10, count=20).columns["expression"]
    # The test split is fixed by test_seed: the stream's seed does not change it, and it is distinct.
    test = t.examples("test", np.arange(30), seed=0).columns["expression"]
    assert test == t.examples("test", np.arange(30), seed=99).columns["expression"]
    assert (
        test
        == task(digits=2, operators=("+", "-"), test_size=30)
        .examples("test", np.arange(30), seed=0)
        .columns["expression"]
    )
    assert len(set(test)) == 30
    assert (
        test
        != task(digits=2, operators=("+", "-"), test_size=30, test_seed=7)
        .examples("test", np.arange(30), seed=0)
        .columns["expression"]
    )
    assert t.split_size("train") is None and t.split_size("test") == 30


def test_the_test_split_is_held_out_of_the_train_stream():
    t = task(test_size=90)  # 1-digit a + b: 100 expressions, 10 left to train on
    test = set(t.examples("test", np.arange(90), seed=0).columns["expression"])
    assert len(test) == 90
    train = set(t.examples("train", np.arange(300), seed=3).columns["expression"])
    assert len(train) == 10 and not train & test
    with pytest.raises(ValueError, match="test_size=100 leaves none of the 100 distinct expressions"):
        task(test_size=100)


def test_validation():
    with pytest.raises(ValueError, match=r"unknown operator.*'/'.*allowed: \+, -, \*"):
        task(operators=("+", "/"))
    with pytest.raises(ValueError, match="operators"):
        task(operators="+-")
    with pytest.raises(ValueError, match="digits"):
        task(digits=(3, 2))
    with pytest.raises(ValueError, match="digits"):
        task(digits=19)
    with pytest.raises(ValueError, match="num_operands"):
        task(num_operands=1)
    with pytest.raises(ValueError, match="prompt_format"):
        task(prompt_format="Solve it")
    with pytest.raises(ValueError, match="prompt_format"):
        task(prompt_format="Solve {question}")
    with pytest.raises(TypeError, match="prompt_format"):
        task(prompt="expression")


def test_default_reward_and_demonstrations():
    tokenizer = char_tokenizer()
    t = arith.arithmetic(tokenizer=tokenizer, operators=("-",), prompt_format="{expression} =", test_size=5)
    batch = base.draw(t, "train", seed=0, start=0, count=8)
    answers = batch.columns["answer"]
    right = t.reward_fns[0](prompts=batch.prompts, completions=[f"It is {a}." for a in answers], **batch.columns)
    wrong = t.reward_fns[0](prompts=batch.prompts, completions=[f"{int(a) + 1}" for a in answers], **batch.columns)
    assert right == [1.0] * 8 and wrong == [0.0] * 8
    tokens, attention_mask, completion_mask = t.demonstrations(
        "train", batch.indices, completion="solution", max_new_tokens=3
    )
    width = tokens.shape[1] - 3
    for row, answer in enumerate(answers):
        ids = tokens[row, width:][completion_mask[row]].tolist()
        assert ids[-1] == t.eos_ids[0] and tokenizer.decode(ids[:-1]) == answer
        assert tokenizer.decode(tokens[row, :width][attention_mask[row, :width]]) == batch.prompts[row]


def test_chat_tokenizer_and_system_prompt():
    tokenizer = chat_tokenizer()
    t = arith.arithmetic(tokenizer=tokenizer, system_prompt="Answer with a number.", test_size=3)
    batch = t.examples("test", np.arange(3), seed=0)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": batch.prompts[0]}]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert batch.tokens[0][batch.mask[0]].tolist() == list(expected)
