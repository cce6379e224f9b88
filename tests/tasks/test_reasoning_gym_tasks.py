"""Reasoning Gym datasets as tasks, scored by their own verifiers."""

import sys

import numpy as np
import pytest
import reasoning_gym as rg_package

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks import reasoning_gym_tasks as rg
from tests.tasks.fixtures import char_tokenizer, chat_tokenizer

NAMES = ("basic_arithmetic", "leg_counting")


@pytest.mark.parametrize("name", NAMES)
def test_prompts_columns_and_the_datasets_own_score(name):
    task = rg.reasoning_gym(name, size=30, seed=3, tokenizer=chat_tokenizer(), test_size=10)
    reference = rg_package.create_dataset(name, size=30, seed=3)
    batch = base.draw(task, "train", seed=0, start=0, count=6)
    entries = [reference[int(i)] for i in batch.indices]
    assert batch.prompts == [e["question"] for e in entries]
    assert batch.columns["answer"] == [e["answer"] for e in entries]
    assert batch.columns["entry"] == entries and batch.columns["metadata"] == [e["metadata"] for e in entries]

    score = task.reward_fns[0]
    args = dict(prompts=batch.prompts, **batch.columns)
    right = score(completions=[f"Thinking...\n<answer>{a}</answer>" for a in batch.columns["answer"]], **args)
    assert right == [1.0] * 6
    last_tag_counts = score(
        completions=[f"<answer>{a}</answer> no, <answer>{int(a) + 1}</answer>" for a in batch.columns["answer"]], **args
    )
    assert all(s < 1.0 for s in last_tag_counts)
    untagged = score(completions=batch.columns["answer"], **args)
    assert untagged == [reference.score_answer(answer=None, entry=e) for e in entries] == [0.0] * 6


def test_system_prompt_is_rendered_and_configurable():
    tokenizer = chat_tokenizer()
    task = rg.reasoning_gym("leg_counting", size=5, tokenizer=tokenizer, test_size=2)
    rendered = tokenizer.decode(task.examples("train", np.array([0]), seed=0).tokens[0])
    assert "<|im_start|>system\n" + rg.DEFAULT_SYSTEM_PROMPT in rendered
    assert "<answer>answer here</answer>" in rg.DEFAULT_SYSTEM_PROMPT
    bare = rg.reasoning_gym("leg_counting", size=5, tokenizer=tokenizer, test_size=2, system_prompt=None)
    assert "system" not in tokenizer.decode(bare.examples("train", np.array([0]), seed=0).tokens[0])
    plain = rg.reasoning_gym(
        "basic_arithmetic",
        size=5,
        tokenizer=char_tokenizer(),
        test_size=2,
        config={"min_terms": 2, "max_terms": 2},
        system_prompt="Be exact.",
    )
    assert plain.render("q") == "Be exact.\n\nq"


def test_test_split_is_the_items_after_the_train_items():
    task = rg.reasoning_gym("basic_arithmetic", size=20, seed=5, tokenizer=char_tokenizer(), test_size=8)
    longer = rg_package.create_dataset("basic_arithmetic", size=28, seed=5)
    test = task.examples("test", np.arange(8), seed=0)
    assert test.prompts == [longer[20 + i]["question"] for i in range(8)]
    train = task.examples("train", np.arange(20), seed=0)
    assert train.prompts == [longer[i]["question"] for i in range(20)]
    assert task.split_size("train") == 20 and task.split_size("test") == 8
    with pytest.raises(ValueError, match="share draws"):
        rg.reasoning_gym("basic_arithmetic", size=20, seed=5, tokenizer=char_tokenizer(), test_seed=10)
    assert (
        rg.reasoning_gym(
            "basic_arithmetic", size=20, seed=5, tokenizer=char_tokenizer(), test_size=2, test_seed=30
        ).split_size("test")
        == 2
    )


def test_unknown_names_and_options_are_listed():
    assert set(NAMES) <= set(rg.dataset_names())
    with pytest.raises(ValueError, match=r"unknown dataset 'leg_countin'.*'leg_counting'.*basic_arithmetic"):
        rg.reasoning_gym("leg_countin", size=5, tokenizer=char_tokenizer())
    with pytest.raises(ValueError, match="no option.*'max_term'.*max_terms"):
        rg.reasoning_gym("basic_arithmetic", size=5, tokenizer=char_tokenizer(), config={"max_term": 3})
    with pytest.raises(ValueError, match="min_terms must be positive"):
        rg.reasoning_gym("basic_arithmetic", size=5, tokenizer=char_tokenizer(), config={"min_terms": 0})
    with pytest.raises(ValueError, match="size"):
        rg.reasoning_gym("basic_arithmetic", size=0, tokenizer=char_tokenizer())


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxrl_llm\[reasoning-gym\]'"):
        rg.reasoning_gym("leg_counting", size=5, tokenizer=char_tokenizer())
