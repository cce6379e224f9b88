"""TrainConfig's settings grouped by concern (SamplingConfig, OptimizerConfig), validated
when built, and the flat names that alias their group's fields."""

import dataclasses
import pickle

import pytest

from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.training.config import GROUPED_FIELDS, OptimizerConfig, TrainConfig


def test_the_flat_names_build_read_and_replace_the_grouped_settings():
    grouped = TrainConfig(
        num_prompts=4,
        sampling=SamplingConfig(max_new_tokens=3, temperature=0.7, top_k=5),
        optimizer=OptimizerConfig(learning_rate=1e-5, lr_schedule="cosine"),
    )
    flat = TrainConfig(
        num_prompts=4, max_new_tokens=3, temperature=0.7, top_k=5, learning_rate=1e-5, lr_schedule="cosine"
    )
    assert flat == grouped and flat.sampling == grouped.sampling and flat.optimizer == grouped.optimizer
    for name, group in GROUPED_FIELDS.items():
        assert getattr(flat, name) == getattr(getattr(flat, group), name)
    # A flat name beside its group changes that field of it: what dataclasses.replace passes.
    replaced = dataclasses.replace(grouped, temperature=0.5, warmup_steps=2)
    assert replaced.sampling == dataclasses.replace(grouped.sampling, temperature=0.5)
    assert replaced.optimizer == dataclasses.replace(grouped.optimizer, warmup_steps=2)
    assert TrainConfig(temperature=0.5).sampling == SamplingConfig(temperature=0.5)  # the other defaults kept
    assert pickle.loads(pickle.dumps(flat)) == flat
    with pytest.raises(AttributeError, match="'TrainConfig' object has no attribute 'temprature'"):
        _ = flat.temprature
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
        for name in FLAT_SETTINGS[group]:  # its flat name reads and builds the group's field
            assert GROUPED_FIELDS[name] == group and getattr(TrainConfig(), name) == getattr(kind(), name)
    assert TrainConfig().sampling == SamplingConfig() and TrainConfig().optimizer == OptimizerConfig()
    assert TrainConfig(max_turns=3).episodes == EpisodeConfig(max_turns=3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(sampling=SamplingConfig(temperature=0.0)),
            r"TrainConfig: `sampling.temperature` must be a finite number > 0 "
            r"\(the policy trained is softmax\(logits / T",
        ),
        (dict(temperature=0.0), r"TrainConfig: `sampling.temperature` must be a finite number > 0"),
        (dict(sampling=dict(temperature=0.7)), "TrainConfig: `sampling` must be of type SamplingConfig; got"),
        (dict(sampling=dict(top_k=2), temperature=0.7), "TrainConfig: `sampling` must be of type SamplingConfig; got"),
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
def test_bad_optimizer_settings_name_the_group_or_the_flat_name_given(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^OptimizerConfig: `{field}` must .*{allowed}"):
        OptimizerConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^TrainConfig: `{field}` must .*{allowed}"):
        TrainConfig(**{field: value})


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
def test_bad_sampling_settings_name_the_group_or_the_flat_name_given(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^SamplingConfig: `{field}` must .*{allowed}"):
        SamplingConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^TrainConfig: `{field}` must .*{allowed}"):
        TrainConfig(**{field: value})
