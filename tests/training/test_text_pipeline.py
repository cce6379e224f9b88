"""The trainer on text: a Hugging Face checkpoint, a chat tokenizer, a JSONL task and a
reward function written exactly as for TRL's GRPOTrainer."""

import json

import jax
import numpy as np
import pytest
import transformers

from jaxrl_llm import algorithms, models, rollouts, sampling, tasks, training
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks.text import from_jsonl
from tests.models.hf_fixtures import tiny_hf_model
from tests.tasks.fixtures import chat_tokenizer

PROBLEMS = [
    ("Ann has 2 apples and buys 3.", "5"),
    ("What is 12 times 7?", "84"),
    ("Solve 2 + 2.", "4"),
    ("How many legs do 3 ducks have?", "6"),
    ("Half of 18?", "9"),
    ("Ten minus four?", "6"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3 in the Hugging Face layout, with a ChatML tokenizer and a
    generation config whose end-of-turn token is not the tokenizer's EOS."""
    directory = tmp_path_factory.mktemp("qwen3")
    tokenizer = chat_tokenizer(eos=False)  # the checkpoint's generation_config names the stop ids
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model = tiny_hf_model("qwen3", vocab_size=len(tokenizer), max_position_embeddings=128)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[end_of_turn, end_of_text], pad_token_id=end_of_text
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a, "source": "test"}) + "\n" for q, a in PROBLEMS))
    return path


def _tiny_model(tokenizer, *, max_positions: int):
    """A one-layer random model over ``tokenizer``'s vocabulary."""
    config = models.ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=max_positions,
    )
    return models.init(config, jax.random.key(0))


class _Recording:
    """The built-in sampler, keeping a host copy of every rollout it returns."""

    def __init__(self, sampler):
        self.sampler, self.rollouts = sampler, []

    def __call__(self, *args, **kwargs):
        rollout = self.sampler(*args, **kwargs)
        self.rollouts.append(jax.device_get(rollout))
        return rollout


@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_a_trl_reward_function_trains_a_hugging_face_checkpoint_on_jsonl(checkpoint, problems, method):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model, params = models.from_pretrained(checkpoint)
    calls = []

    def reward(completions, answer, **kwargs):  # as written for TRL
        calls.append(dict(completions=completions, answer=answer, **kwargs))
        return [float(a in c) for c, a in zip(completions, answer)]

    task = from_jsonl(problems, tokenizer=tokenizer, prompt="question", reward_fns=[reward], test_fraction=0.3)
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(task.eos_ids) == {end_of_turn, end_of_text}  # from generation_config.json
    config = training.TrainConfig(
        num_prompts=2, group_size=3, sampling=SamplingConfig(max_new_tokens=6, max_prompt_length=64)
    )
    backend = _Recording(sampling.Sampler(model=model, eos_ids=task.eos_ids, pad_id=task.pad_id))
    state, history = training.train(model, params, algorithms.get(method), config, steps=3, task=task, rollout=backend)

    assert int(state.step) == 3 and len(calls) == len(backend.rollouts) == 3
    answers = dict(PROBLEMS)
    for call, rollout in zip(calls, backend.rollouts, strict=True):
        n = config.sampling.max_new_tokens
        for row, (completion, ids) in enumerate(zip(call["completions"], call["completion_ids"], strict=True)):
            sampled = rollout.tokens[row, -n:][: rollout.lengths[row]].tolist()
            assert ids == sampled
            text_ids = sampled[:-1] if sampled and sampled[-1] in task.eos_ids else sampled
            assert completion == tokenizer.decode(text_ids, skip_special_tokens=True)
        # Each row's prompt and its columns, the G completions of a prompt adjacent.
        assert call["prompts"][::3] == call["prompts"][1::3] == call["prompts"][2::3]
        assert [answers[p] for p in call["prompts"]] == call["answer"]
        assert call["source"] == ["test"] * config.batch_size
    for metrics in history:
        assert all(np.isfinite(value) for value in metrics.values()), metrics


def test_prompts_of_spread_lengths_trace_each_half_a_bounded_number_of_times():
    """Prompts of 5 to 60 tokens over 20 steps: one trace per padded width (8, 16, 32, 64)."""
    alphabet = "abcdefghij "
    tokenizer = tasks.build_char_tokenizer(alphabet)
    rng = np.random.default_rng(0)
    records = [
        {"prompt": "".join(rng.choice(list("abcdefghij"), size=length)), "answer": "a"}
        for length in rng.integers(5, 61, size=200)
    ]

    def starts_right(completions, answer, **kwargs):
        return [float(c.startswith(a)) for c, a in zip(completions, answer)]

    task = tasks.from_records(records, tokenizer=tokenizer, reward_fns=[starts_right])
    model, params = _tiny_model(tokenizer, max_positions=80)
    run = training.TrainConfig(
        num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2, max_prompt_length=64)
    )
    _, history = training.train(model, params, algorithms.GRPO, run, steps=20, task=task)
    widths = {rollouts.prompt_width(length, bucket=8, max_length=64) for length in range(5, 61)}
    assert widths == {8, 16, 32, 64}
    assert history[-1]["score_traces"] <= len(widths) and history[-1]["update_traces"] <= len(widths)
    assert history[-1]["score_traces"] >= 3  # the prompts did spread over the widths


def test_a_prompt_longer_than_the_limit_is_an_error_or_left_truncated_and_counted():
    tokenizer = tasks.build_char_tokenizer("abc")
    records = [{"prompt": "ab" * 10, "answer": "a"}, {"prompt": "abc", "answer": "a"}]

    def one(completions, **kwargs):
        return [1.0] * len(completions)

    task = tasks.from_records(records, tokenizer=tokenizer, reward_fns=[one])
    model, params = _tiny_model(tokenizer, max_positions=32)
    run = training.TrainConfig(
        num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2, max_prompt_length=8)
    )
    with pytest.raises(
        training.RunStopped, match="has 20 tokens, more than max_prompt_length=8 .* prompt_truncation='left'"
    ):
        training.train(model, params, algorithms.RLOO, run, steps=1, task=task)
    run = training.TrainConfig(
        num_prompts=2,
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=2, max_prompt_length=8, prompt_truncation="left"),
    )
    _, history = training.train(model, params, algorithms.RLOO, run, steps=1, task=task)
    assert history[0]["truncated_prompts"] == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        ("ab" * 500_000, r"the prompt of example 5 of the train split has 1,000,000 characters, more than"),
        (17, r"the prompt column 'prompt' of example 5 of the train split must hold a string"),
    ],
    ids=["a megabyte", "a number"],
)
def test_every_prompt_is_checked_before_any_compute(bad, message, monkeypatch):
    tokenizer = tasks.build_char_tokenizer("abc")
    records = [{"prompt": "ab"}] * 5 + [{"prompt": bad}] + [{"prompt": "abc"}] * 4
    task = tasks.from_records(
        records, tokenizer=tokenizer, reward_fns=[lambda completions, **_: [0.0] * len(completions)]
    )
    model, params = _tiny_model(tokenizer, max_positions=32)
    monkeypatch.setattr(training.loop, "_compile", lambda *a, **k: pytest.fail("compiled before the prompts were read"))
    run = training.TrainConfig(
        num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2, max_prompt_length=8)
    )
    with pytest.raises(ValueError, match=message):
        training.train(model, params, algorithms.PG, run, steps=1, task=task)


def test_a_dataset_is_walked_in_epochs_and_a_resumed_run_sees_the_prompts_of_the_uninterrupted_one():
    tokenizer = tasks.build_char_tokenizer("abcde")
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.extend(prompts[::2])  # one row per prompt (group_size=2)
        return [0.0] * len(completions)

    task = tasks.from_records([{"prompt": letter} for letter in "abcde"], tokenizer=tokenizer, reward_fns=[spy])
    model, params = _tiny_model(tokenizer, max_positions=16)
    run = training.TrainConfig(num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2))
    training.train(model, params, algorithms.PG, run, steps=5, task=task)
    straight, seen[:] = list(seen), []
    assert sorted(straight[:5]) == sorted(straight[5:]) == list("abcde")  # each epoch: every example once
    assert straight[:5] != straight[5:]  # in a fresh order
    half, _ = training.train(model, params, algorithms.PG, run, steps=3, task=task)
    assert int(half.prompts_drawn) == 6
    training.train(model, params, algorithms.PG, run, steps=2, task=task, state=half)
    assert seen == straight


def test_reward_functions_get_the_trainer_state_and_log_metrics_as_under_trl():
    tokenizer = tasks.build_char_tokenizer("abcde")
    states = []

    def curriculum(completions, trainer_state, log_metric, **kwargs):  # TRL's signature
        states.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        log_metric("progress", 1.0)  # logged twice: the step's metric is the mean
        return [0.0] * len(completions)

    task = tasks.from_records([{"prompt": letter} for letter in "abcde"], tokenizer=tokenizer, reward_fns=[curriculum])
    model, params = _tiny_model(tokenizer, max_positions=16)
    run = training.TrainConfig(num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2))
    state, history = training.train(model, params, algorithms.PG, run, steps=2, task=task)
    _, resumed = training.train(model, params, algorithms.PG, run, steps=1, task=task, state=state)
    assert states == [(0, 2, 0.0), (1, 2, 0.4), (2, 3, 0.8)]  # 2 of 5 prompts a step
    assert [m["progress"] for m in history + resumed] == pytest.approx([0.5, 0.75, 2 / 3 / 2 + 0.5])
    task = tasks.from_records(
        [{"prompt": "a"}],
        tokenizer=tokenizer,
        reward_fns=[lambda log_metric, completions, **_: log_metric("reward", 1.0) or [0.0] * len(completions)],
    )
    with pytest.raises(training.RunStopped, match=r"logged metric\(s\) \['reward'\] with log_metric"):
        training.train(model, params, algorithms.PG, run, steps=1, task=task)


def test_a_reward_function_that_raises_stops_the_run_naming_it_or_scores_zero_and_is_counted():
    tokenizer = tasks.build_char_tokenizer("abcde")

    def fragile(prompts, completions, **kwargs):
        if "b" in prompts:  # breaks on one example
            raise ValueError("cannot parse")
        return [1.0] * len(completions)

    task = tasks.from_records([{"prompt": letter} for letter in "ab"], tokenizer=tokenizer, reward_fns=[fragile])
    model, params = _tiny_model(tokenizer, max_positions=16)
    run = training.TrainConfig(num_prompts=2, group_size=2, sampling=SamplingConfig(max_new_tokens=2))
    with pytest.raises(
        training.RunStopped,
        match="In the rollout of train step 0: reward function 'fragile' raised "
        r"ValueError: cannot parse at row \d \(prompt 'b'",
    ):
        training.train(model, params, algorithms.PG, run, steps=1, task=task)
    run = training.TrainConfig(
        num_prompts=2, group_size=2, on_reward_error="zero", sampling=SamplingConfig(max_new_tokens=2)
    )
    _, history = training.train(model, params, algorithms.PG, run, steps=1, task=task)
    assert history[0]["reward_errors"] == 2 and history[0]["reward"] == 0.5  # the two rows of prompt 'b' score 0
