"""TrainConfig's settings grouped by concern (SamplingConfig, OptimizerConfig, EpisodeConfig),
validated when built; the flat names of grouped settings are refused in Python with their
grouped spelling (config files, flags and stored runs take them: tests/test_cli.py)."""

import dataclasses
import pickle

import pytest

from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.training.config import GROUPED_FIELDS, OptimizerConfig, TrainConfig


def test_a_flat_name_is_refused_with_its_grouped_spelling_and_the_groups_build_the_config():
    grouped = TrainConfig(
        num_prompts=4,
        sampling=SamplingConfig(max_new_tokens=3, temperature=0.7, top_k=5),
        optimizer=OptimizerConfig(learning_rate=1e-5, lr_schedule="cosine"),
    )
    assert grouped.sampling.temperature == 0.7 and grouped.optimizer.lr_schedule == "cosine"
    assert pickle.loads(pickle.dumps(grouped)) == grouped
    spelled = (
        r"^TrainConfig: a grouped setting is passed in its group: temperature as sampling=SamplingConfig\(temperature="
        r"\.\.\.\), warmup_steps as optimizer=OptimizerConfig\(warmup_steps=\.\.\.\)\.$"
    )
    with pytest.raises(TypeError, match=spelled):
        TrainConfig(num_prompts=4, temperature=0.5, warmup_steps=2)
    with pytest.raises(TypeError, match=r"max_turns as episodes=EpisodeConfig\(max_turns=\.\.\.\)"):
        dataclasses.replace(grouped, max_turns=3)
    with pytest.raises(AttributeError, match="'TrainConfig' object has no attribute 'temperature'"):
        _ = grouped.temperature
    with pytest.raises(TypeError, match="temprature"):
        TrainConfig(temprature=0.5)


FLAT_SETTINGS = {  # every field of the flat TrainConfig, as stored runs and config files may hold them
    "sampling": ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "max_prompt_length", "prompt_truncation"),
    "optimizer": (
        *("learning_rate", "critic_learning_rate", "warmup_steps", "lr_schedule", "decay_steps"),
        *("end_learning_rate_fraction", "weight_decay", "adam_b1", "adam_b2", "adam_eps", "max_grad_norm"),
    ),
    "episodes": ("max_turns", "tool_timeout", "tool_call_format"),
    None: (
        *("num_prompts", "group_size", "minibatch_size", "on_reward_error", "eval_every", "eval_samples"),
        *("chunk_size", "max_consecutive_skips", "max_refill_rounds", "seed", "share_prompts", "micro_batch_size"),
        *("reference_metrics", "exact_kl", "lora_decoding"),
    ),
}


def test_every_flat_setting_has_one_place():
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    assert names == {*FLAT_SETTINGS[None], "sampling", "optimizer", "episodes"}
    for group, kind in (("sampling", SamplingConfig), ("optimizer", OptimizerConfig), ("episodes", EpisodeConfig)):
        assert {field.name for field in dataclasses.fields(kind)} == set(FLAT_SETTINGS[group])
        assert all(GROUPED_FIELDS[name] == group for name in FLAT_SETTINGS[group])  # nest_flat_settings' map
    assert TrainConfig().sampling == SamplingConfig() and TrainConfig().optimizer == OptimizerConfig()
    assert TrainConfig().episodes == EpisodeConfig()


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(sampling=SamplingConfig(temperature=0.0)),
            r"TrainConfig: `sampling.temperature` must be a finite number > 0 "
            r"\(the policy trained is softmax\(logits / T",
        ),
        (dict(sampling=dict(temperature=0.7)), "TrainConfig: `sampling` must be of type SamplingConfig; got"),
        (dict(optimizer=None), "TrainConfig: `optimizer` must be of type OptimizerConfig; got None"),
    ],
)
def test_the_groups_are_checked_where_they_meet_training(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("learning_rate", 0.0, "> 0"),
        ("critic_learning_rate", float("nan"), "finite"),
        ("warmup_steps", 0, ">= 1"),
        ("max_grad_norm", float("inf"), "finite"),
        ("weight_decay", -0.1, ">= 0"),
        ("decay_steps", 0, ">= 1"),
        ("lr_schedule", "step", "'constant', 'linear', 'cosine'"),
        ("adam_b2", 1.0, r"\[0.0, 1.0\)"),
        ("end_learning_rate_fraction", 2.0, r"\[0.0, 1.0\]"),
        ("adam_eps", -1e-8, "> 0"),
    ],
)
def test_bad_optimizer_settings_name_the_group_and_the_setting(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^OptimizerConfig: `{field}` must .*{allowed}"):
        OptimizerConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("max_new_tokens", 0, ">= 1"),
        ("max_prompt_length", 1.5, "integer"),
        ("temperature", -1.0, ">= 0"),
        ("top_k", 0, ">= 1"),
        ("top_p", 0.0, r"\(0.0, 1.0\]"),
        ("min_p", 1.5, r"\[0.0, 1.0\]"),
        ("prompt_truncation", "right", "'error', 'left'"),
    ],
)
def test_bad_sampling_settings_name_the_group_and_the_setting(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^SamplingConfig: `{field}` must .*{allowed}"):
        SamplingConfig(**{field: value})
