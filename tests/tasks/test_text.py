"""TextTask: records, JSON lines and datasets as tasks; prompts, templates, columns, splits."""

import dataclasses
import json
import sys

import numpy as np
import pytest

from jaxrl_llm.rewards.combine import compute_rewards
from jaxrl_llm.rewards.text import exact_match
from jaxrl_llm.tasks import base, text
from tests.tasks.fixtures import CHATML, char_tokenizer, chat_tokenizer

RECORDS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(12)]


def reward(*, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def unpadded(batch, row):
    return batch.tokens[row][batch.mask[row]].tolist()


def test_prompt_column_gives_prompts_and_every_other_column():
    task = text.from_records(RECORDS, tokenizer=chat_tokenizer(), prompt="question", reward_fns=reward)
    batch = task.examples("train", np.array([3, 0]), seed=0)
    assert batch.prompts == ["What is 3 + 3?", "What is 0 + 0?"]
    assert batch.columns == {"answer": ["6", "0"], "level": [0, 0]}
    assert task.columns == ("answer", "level")
    np.testing.assert_array_equal(batch.indices, [3, 0])
    assert batch.tokens.dtype == np.int32 and batch.mask.dtype == bool and batch.tokens.shape == batch.mask.shape


def test_format_string_prompt_keeps_every_column():
    task = text.from_records(
        RECORDS, tokenizer=char_tokenizer(), prompt="Q: {question} (level {level}) {{x}}", reward_fns=reward
    )
    batch = task.examples("train", np.array([4]), seed=0)
    assert batch.prompts == ["Q: What is 4 + 4? (level 1) {x}"]
    assert batch.columns == {"question": ["What is 4 + 4?"], "answer": ["8"], "level": [1]}
    assert task.tokenizer.decode(unpadded(batch, 0)) == batch.prompts[0]


def test_chat_template_tokens_equal_the_tokenizers_own():
    tokenizer = chat_tokenizer()
    task = text.from_records(
        RECORDS, tokenizer=tokenizer, prompt="question", reward_fns=reward, system_prompt="Be brief."
    )
    assert task.chat_template is True
    batch = task.examples("train", np.array([1, 11]), seed=0)
    for row, index in enumerate([1, 11]):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": RECORDS[index]["question"]}]
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert unpadded(batch, row) == list(expected)
    # left-padded with the pad id
    short = int(np.argmin(batch.mask.sum(1)))
    assert not batch.mask[short, 0] and batch.tokens[short, 0] == task.pad_id == tokenizer.pad_token_id
    assert batch.prompts[0] == RECORDS[1]["question"]  # prompts are given before templating


def test_a_bos_is_written_once():
    tokenizer = chat_tokenizer(bos=True)  # encoding adds BOS and the template writes it too (Llama 3)
    chat = text.from_records(RECORDS, tokenizer=tokenizer, prompt="question", reward_fns=reward)
    ids = unpadded(chat.examples("train", np.array([0]), seed=0), 0)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": RECORDS[0]["question"]}], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert ids == list(expected) and ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    plain = dataclasses.replace(chat, chat_template=False)
    ids = unpadded(plain.examples("train", np.array([0]), seed=0), 0)
    assert ids == [tokenizer.bos_token_id] + tokenizer(RECORDS[0]["question"], add_special_tokens=False)["input_ids"]


def test_chat_template_kwargs_reach_the_template():
    tokenizer = chat_tokenizer()
    task = text.from_records(
        RECORDS,
        tokenizer=tokenizer,
        prompt="question",
        reward_fns=reward,
        chat_template_kwargs={"enable_thinking": False},
    )
    rendered = task.render("hi")
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "system" not in rendered


def test_conversational_prompts():
    conversations = [
        {"messages": [{"role": "user", "content": "Name a prime."}], "answer": "2"},
        {"messages": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}], "answer": "x"},
    ]
    tokenizer = chat_tokenizer()
    task = text.from_records(
        conversations, tokenizer=tokenizer, prompt="messages", reward_fns=reward, system_prompt="Default system."
    )
    batch = task.examples("train", np.array([0, 1]), seed=0)
    assert batch.prompts == [c["messages"] for c in conversations]
    assert batch.columns == {"answer": ["2", "x"]}
    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Default system."}] + conversations[0]["messages"],
        tokenize=True,
        add_generation_prompt=True,
    )["input_ids"]
    second = tokenizer.apply_chat_template(
        conversations[1]["messages"],
        tokenize=True,  # its own system wins
        add_generation_prompt=True,
    )["input_ids"]
    assert unpadded(batch, 0) == list(first) and unpadded(batch, 1) == list(second)
    with pytest.raises(ValueError, match="conversation.*chat template"):
        text.from_records(conversations, tokenizer=char_tokenizer(), prompt="messages", reward_fns=reward)


def test_plain_template_and_system_prompt():
    tokenizer = char_tokenizer()
    plain = text.from_records(RECORDS, tokenizer=tokenizer, prompt="question", reward_fns=reward)
    assert plain.chat_template is False
    assert tokenizer.decode(unpadded(plain.examples("train", np.array([2]), seed=0), 0)) == "What is 2 + 2?"
    system = dataclasses.replace(plain, system_prompt="Be brief.")
    assert tokenizer.decode(unpadded(system.examples("train", np.array([2]), seed=0), 0)) == (
        "Be brief.\n\nWhat is 2 + 2?"
    )
    custom = dataclasses.replace(plain, system_prompt="S", plain_template="{system}: {prompt} =")
    assert custom.render("1 + 1") == "S: 1 + 1 ="
    with pytest.raises(ValueError, match="plain_template"):
        dataclasses.replace(plain, plain_template="{system} only")
    # A chat tokenizer told not to use its template: plain text with the tokenizer's own special tokens.
    chat = chat_tokenizer()
    off = text.from_records(RECORDS, tokenizer=chat, prompt="question", reward_fns=reward, chat_template=False)
    assert unpadded(off.examples("train", np.array([5]), seed=0), 0) == chat("What is 5 + 5?")["input_ids"]


def test_chat_template_true_without_one_is_an_error():
    with pytest.raises(ValueError, match="no chat template"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward, chat_template=True)
    task = text.from_records(
        RECORDS, tokenizer=chat_tokenizer(chat_template=None), prompt="question", reward_fns=reward
    )
    assert task.chat_template is False
    assert (
        text.from_records(
            RECORDS,
            tokenizer=char_tokenizer(),
            prompt="question",
            reward_fns=reward,
            chat_template_kwargs={},
            chat_template=None,
        ).chat_template
        is False
    )
    forced = text.from_records(
        RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward, chat_template=False
    )
    assert forced.render("x") == "x"
    assert CHATML  # the fixture's template is the one the chat tests render


def test_missing_columns_are_errors_listing_the_columns():
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'.*'question', 'answer', 'level'"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), reward_fns=reward)
    with pytest.raises(ValueError, match=r"'questoin'.*'question', 'answer', 'level'"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="Solve {questoin}", reward_fns=reward)
    with pytest.raises(ValueError, match="positional"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="Solve {}", reward_fns=reward)
    with pytest.raises(ValueError, match="collide"):
        text.from_records([{"prompt": "a", "completions": 1}], tokenizer=char_tokenizer(), reward_fns=reward)
    with pytest.raises(ValueError, match="no completion column 'solution'.*'answer', 'level'"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward).demonstrations(
            "train", np.arange(2), completion="solution", max_new_tokens=4
        )
    with pytest.raises(TypeError, match="unknown option.*'sytem_prompt'"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward, sytem_prompt="x")


def test_a_later_record_without_the_prompt_column_is_named_when_the_task_is_built():
    records = RECORDS[:3] + [{"answer": "1"}]
    with pytest.raises(
        ValueError,
        match="example 3 of the train split has no 'question' column for the prompt; its columns are 'answer'",
    ):
        text.from_records(records, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    with pytest.raises(ValueError, match="example 3 of the train split has no 'question' column"):
        text.from_records(records, tokenizer=char_tokenizer(), prompt="Solve {question}", reward_fns=reward)


def test_records_with_different_keys_get_every_column():
    records = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "hint": "h"}]
    with pytest.warns(UserWarning, match=r"is missing from 1 of 2 examples of the train split") as warned:
        task = text.from_records(records, tokenizer=char_tokenizer(), reward_fns=reward)
    assert [str(w.message).split("'")[1] for w in warned] == ["answer", "hint"]  # once each
    assert task.columns == ("answer", "hint")
    assert task.examples("train", np.array([1, 0]), seed=0).columns == {"answer": [None, "1"], "hint": ["h", None]}


def test_jsonl(tmp_path):
    path, test_path = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS[:8]) + "\n\n   \n")
    test_path.write_text("\n".join(json.dumps(r) for r in RECORDS[8:]))
    task = text.from_jsonl(path, test_path=test_path, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    assert task.split_size("train") == 8 and task.split_size("test") == 4
    assert task.examples("test", np.array([0]), seed=0).prompts == [RECORDS[8]["question"]]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + '\n\n{"question": oops}\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: not valid JSON"):
        text.from_jsonl(bad, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    bad.write_text(json.dumps(RECORDS[0]) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: each line must be a JSON object"):
        text.from_jsonl(bad, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    bad.write_text("\n\n")
    with pytest.raises(ValueError, match="no examples"):
        text.from_jsonl(bad, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)


def test_held_out_fraction_is_disjoint_and_deterministic():
    def split(seed):
        task = text.from_records(
            RECORDS,
            tokenizer=char_tokenizer(),
            prompt="question",
            reward_fns=reward,
            test_fraction=0.25,
            split_seed=seed,
        )
        train = task.examples("train", np.arange(task.split_size("train")), seed=0).prompts
        test = task.examples("test", np.arange(task.split_size("test")), seed=0).prompts
        return train, test

    train, test = split(0)
    assert len(test) == 3 and len(train) == 9
    assert sorted(train + test) == sorted(r["question"] for r in RECORDS)
    assert split(0) == (train, test)
    assert split(1)[1] != test
    assert train == [r["question"] for r in RECORDS if r["question"] in train]  # file order kept
    none = text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    assert none.split_size("test") == 0
    assert len(none.examples("test", np.zeros(0, np.int64), seed=0)) == 0
    with pytest.raises(ValueError, match="not both"):
        text.from_records(
            RECORDS,
            tokenizer=char_tokenizer(),
            prompt="question",
            reward_fns=reward,
            test_records=RECORDS[:2],
            test_fraction=0.5,
        )
    with pytest.raises(ValueError, match="test_fraction"):
        text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward, test_fraction=1)


def test_from_dataset_in_memory_parquet_and_disk(tmp_path):
    import datasets

    dataset = datasets.Dataset.from_list(RECORDS)
    kwargs = dict(tokenizer=chat_tokenizer(), prompt="question", reward_fns=reward)
    task = text.from_dataset(dataset, test_fraction=0.25, **kwargs)
    assert task.columns == ("answer", "level") and task.split_size("train") == 9
    test = task.examples("test", np.arange(3), seed=0)
    assert all(
        r in RECORDS
        for r in (
            {"question": p, "answer": a, "level": lv}
            for p, a, lv in zip(test.prompts, test.columns["answer"], test.columns["level"], strict=True)
        )
    )

    dataset.to_parquet(str(tmp_path / "train.parquet"))
    from_file = text.from_dataset(tmp_path / "train.parquet", **kwargs)
    batch = from_file.examples("train", np.array([7]), seed=0)
    assert batch.prompts == [RECORDS[7]["question"]] and batch.columns == {"answer": ["14"], "level": [1]}

    datasets.DatasetDict({"train": dataset.select(range(10)), "test": dataset.select(range(10, 12))}).save_to_disk(
        str(tmp_path / "saved")
    )
    saved = text.from_dataset(str(tmp_path / "saved"), **kwargs)
    assert saved.split_size("train") == 10 and saved.split_size("test") == 2
    assert saved.examples("test", np.array([1]), seed=0).prompts == [RECORDS[11]["question"]]

    arrow = next((tmp_path / "saved" / "train").glob("*.arrow"))
    assert text.from_dataset(arrow, **kwargs).split_size("train") == 10

    with pytest.raises(ValueError, match="no 'train' split.*'validation'"):
        text.from_dataset(datasets.DatasetDict({"validation": dataset}), **kwargs)
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="not a .parquet or .arrow"):
        text.from_dataset(tmp_path / "data.csv", **kwargs)


def test_from_dataset_without_datasets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxrl_llm\[datasets\]'"):
        text.from_dataset(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)


def test_stream_covers_each_example_once_per_epoch_and_is_reproducible():
    task = text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    size = task.split_size("train")
    epochs = [base.draw(task, "train", seed=3, start=e * size, count=size) for e in range(2)]
    for batch in epochs:
        assert sorted(batch.prompts) == sorted(r["question"] for r in RECORDS)
    assert epochs[0].prompts != epochs[1].prompts  # a fresh order each epoch
    # Any window of the stream is the same examples, whatever the batch boundaries.
    window = base.draw(task, "train", seed=3, start=5, count=13)
    assert window.prompts == (epochs[0].prompts + epochs[1].prompts)[5:18]
    np.testing.assert_array_equal(window.tokens, base.draw(task, "train", seed=3, start=5, count=13).tokens)
    assert base.draw(task, "train", seed=4, start=0, count=size).prompts != epochs[0].prompts


def test_demonstrations_layout():
    tokenizer = char_tokenizer()
    task = text.from_records(RECORDS, tokenizer=tokenizer, prompt="{question} =", reward_fns=reward)
    tokens, attention_mask, completion_mask = task.demonstrations(
        "train", np.array([1, 10]), completion="answer", max_new_tokens=4
    )
    prompts = task.examples("train", np.array([1, 10]), seed=0)
    width = prompts.tokens.shape[1]
    assert tokens.shape == attention_mask.shape == (2, width + 4) and completion_mask.shape == (2, 4)
    assert tokens.dtype == np.int32 and attention_mask.dtype == bool and completion_mask.dtype == bool
    np.testing.assert_array_equal(tokens[:, :width], prompts.tokens)
    np.testing.assert_array_equal(attention_mask[:, :width], prompts.mask)
    np.testing.assert_array_equal(attention_mask[:, width:], completion_mask)
    eos, pad = task.eos_ids[0], task.pad_id
    digit = {str(d): tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert tokens[0, width:].tolist() == [digit["2"], eos, pad, pad]
    assert tokens[1, width:].tolist() == [digit["2"], digit["0"], eos, pad]
    np.testing.assert_array_equal(completion_mask, [[1, 1, 0, 0], [1, 1, 1, 0]])

    by_function, _, _ = task.demonstrations(
        "train", np.array([1]), max_new_tokens=4, completion=lambda record: record["answer"] + record["question"][-2]
    )
    assert by_function[0, -4:].tolist() == [digit["2"], digit["1"], eos, pad]
    with pytest.raises(ValueError, match="takes 3 tokens with its EOS, more than max_new_tokens=2"):
        task.demonstrations("train", np.array([10]), completion="answer", max_new_tokens=2)


def test_special_ids_fall_back_and_fail_as_documented():
    no_pad = chat_tokenizer(pad=False)
    task = text.from_records(RECORDS, tokenizer=no_pad, prompt="question", reward_fns=reward)
    assert task.eos_ids == (no_pad.eos_token_id,) and task.pad_id == no_pad.eos_token_id
    assert task.examples("train", np.array([0, 11]), seed=0).tokens[0, 0] == no_pad.eos_token_id
    no_eos = chat_tokenizer(eos=False, pad=False)
    with pytest.raises(ValueError, match="no EOS token"):
        text.from_records(RECORDS, tokenizer=no_eos, prompt="question", reward_fns=reward)
    end = no_eos.convert_tokens_to_ids("<|im_end|>")
    given = text.from_records(RECORDS, tokenizer=no_eos, prompt="question", reward_fns=reward, eos_ids=end)
    assert given.eos_ids == (end,) and given.pad_id == end


def test_rewards_in_trl_convention_and_weights():
    task = text.from_records(
        RECORDS,
        tokenizer=chat_tokenizer(),
        prompt="question",
        reward_fns=[reward, exact_match],
        reward_weights=[1.0, 0.5],
        stop_strings="\n\n",
    )
    assert task.reward_weights == (1.0, 0.5) and task.stop_strings == ("\n\n",)
    base.check_task(task)
    assert isinstance(task, base.Task)
    batch = base.draw(task, "train", seed=0, start=0, count=2)
    group = 2  # each column repeated per completion, as the trainer does
    columns = {name: [v for v in values for _ in range(group)] for name, values in batch.columns.items()}
    prompts = [p for p in batch.prompts for _ in range(group)]
    answers = columns["answer"]
    completions = [answers[0], "no", f"It is {answers[2]}.", answers[3]]
    result = compute_rewards(
        task.reward_fns,
        task.reward_weights,
        prompts=prompts,
        completions=completions,
        completion_ids=[[1]] * 4,
        columns=columns,
    )
    np.testing.assert_allclose(result.total, [1.5, 0.0, 0.5, 1.5])
    assert text.from_records(
        RECORDS, tokenizer=chat_tokenizer(), prompt="question", reward_fns=reward
    ).reward_weights == (1.0,)
    unscored = text.from_records(RECORDS, tokenizer=chat_tokenizer(), prompt="question", reward_fns=[])
    with pytest.raises(ValueError, match="at least one reward function"):  # a run's environments may score it
        base.check_task(unscored)


def test_bad_indices_and_splits():
    task = text.from_records(RECORDS, tokenizer=char_tokenizer(), prompt="question", reward_fns=reward)
    with pytest.raises(IndexError, match="index 12 is outside the train split"):
        task.examples("train", np.array([0, 12]), seed=0)
    with pytest.raises(ValueError, match="Unknown split 'dev'"):
        task.examples("dev", np.array([0]), seed=0)
    with pytest.raises(ValueError, match="empty"):
        text.from_records([], tokenizer=char_tokenizer(), reward_fns=reward)
    with pytest.raises(TypeError, match="not a dict"):
        text.from_records([{"prompt": "a"}, "b"], tokenizer=char_tokenizer(), reward_fns=reward)


def test_procedural_source():
    def example(split, index, seed):
        return {"prompt": f"{split} {seed} {index}", "answer": str(index)}

    task = text.TextTask(
        tokenizer=char_tokenizer(), reward_fns=(reward,), example=example, sizes={"train": None, "test": 3}
    )
    assert task.split_size("train") is None and task.split_size("test") == 3
    assert base.draw(task, "train", seed=7, start=100, count=2).prompts == ["train 7 100", "train 7 101"]
    assert sorted(base.draw(task, "test", seed=7, start=0, count=3).columns["answer"]) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="exactly one of `records`"):
        text.TextTask(tokenizer=char_tokenizer(), reward_fns=(reward,))
    with pytest.raises(ValueError, match="needs `sizes`"):
        text.TextTask(tokenizer=char_tokenizer(), reward_fns=(reward,), example=example)
