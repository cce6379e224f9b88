"""The language-model training engine: on-policy ratios, tracing, non-finite updates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, models, training
from jaxrl_llm.tasks import DigitSumTask

TASK = DigitSumTask()
CONFIG = models.ModelConfig(vocab_size=len(TASK.tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
RUN = training.TrainConfig(num_prompts=4, group_size=4, max_new_tokens=3)
SUPPORTED = ["pg", "reinforce-baseline", "rloo", "grpo", "dr-grpo", "dapo", "gspo", "cispo"]


@pytest.mark.parametrize("name", SUPPORTED)
def test_each_supported_preset_runs_with_finite_metrics_and_moves_the_params(name):
    model, params = models.init(CONFIG, jax.random.key(0))
    state, history = training.train(model, params, algorithms.get(name), RUN, steps=3, task=TASK)
    assert len(history) == 3 and int(state.step) == 3 * algorithms.get(name).num_iterations
    assert all(np.isfinite(v) for h in history for v in h.values())
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params, params))
    assert any(moved)
    jax.tree.map(np.testing.assert_array_equal, state.ref_params, params)  # the reference stays put
    assert np.isfinite(np.asarray(jax.tree.leaves(params)[0])).all()  # the caller's params were not donated


def test_on_policy_update_has_ratio_one_and_no_clipping():
    model, params = models.init(CONFIG, jax.random.key(1))
    _, history = training.train(model, params, algorithms.GRPO, RUN, steps=2, task=TASK)
    for h in history:  # mu = 1: the sampler's log-probs are the old log-probs
        np.testing.assert_allclose([h["ratio_min"], h["ratio_max"]], 1.0, atol=1e-5)
        assert h["clip_fraction"] == 0.0


def test_with_several_iterations_old_logprobs_come_from_the_snapshot():
    model, params = models.init(CONFIG, jax.random.key(2))
    method = dataclasses.replace(algorithms.GRPO, num_iterations=3)
    _, history = training.train(model, params, method, dataclasses.replace(RUN, learning_rate=3e-2), steps=2,
                                task=TASK)
    # After the first of three updates the policy has moved away from the sampler's.
    assert any(h["ratio_max"] - h["ratio_min"] > 1e-4 for h in history)


def test_non_finite_updates_are_skipped_counted_and_stop_the_run():
    model, params = models.init(CONFIG, jax.random.key(3))
    optimizer = training.make_optimizer(RUN)
    update = jax.jit(training.make_update_step(model, algorithms.GRPO, optimizer, RUN))
    state = training.init_state(model, params, optimizer)
    prompts, mask, _ = TASK.prompts(np.random.default_rng(0), 2)
    tokens = jnp.concatenate([jnp.asarray(prompts), jnp.full((2, 3), 5, jnp.int32)], axis=1)
    batch = training.Batch(tokens=tokens, attention_mask=jnp.ones(tokens.shape, bool),
                           completion_mask=jnp.ones((2, 3), bool), old_logp=jnp.full((2, 3), -3.0),
                           advantages=jnp.array([1.0, jnp.nan]), ref_logp=jnp.zeros((2, 3)))
    before = jax.tree.map(np.asarray, state.params)
    for expected in (1, 2):
        state, metrics = update(state, batch)
        assert int(metrics["skipped_updates"]) == expected and int(metrics["consecutive_skips"]) == expected
        jax.tree.map(np.testing.assert_array_equal, state.params, before)
    good = batch._replace(advantages=jnp.array([1.0, -1.0]))
    state, metrics = update(state, good)
    assert int(metrics["consecutive_skips"]) == 0 and int(metrics["skipped_updates"]) == 2
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state.params, before)))


def test_the_loop_stops_after_max_consecutive_skips(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(4))
    monkeypatch.setattr(TASK.__class__, "rewards", lambda self, c, l, a: np.full(len(c), np.nan, np.float32))
    with pytest.raises(FloatingPointError, match="2 consecutive updates had a non-finite loss or gradient"):
        training.train(model, params, algorithms.RLOO, dataclasses.replace(RUN, max_consecutive_skips=2), steps=5,
                       task=TASK)


@pytest.mark.parametrize("name", ["ppo", "trpo", "reinforce++"])
def test_presets_the_engine_cannot_run_yet_are_refused(name):
    model, params = models.init(CONFIG, jax.random.key(0))
    with pytest.raises(ValueError, match="does not support yet"):
        training.train(model, params, algorithms.get(name), RUN, steps=1, task=TASK)


class AnswerSeven(DigitSumTask):
    """Reward 1 for a first token of '7', whatever the prompt: learnable in a few dozen steps."""

    def rewards(self, completion_tokens, lengths, answers):
        return (completion_tokens[:, 0] == self.tokenizer.convert_tokens_to_ids("7")).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pg", "rloo", "grpo", "dapo", "gspo", "cispo"])
def test_the_engine_learns_a_prompt_independent_preference(name):
    """The RL signal reaches the weights with the right sign: from ~1/21 to near 1."""
    task = AnswerSeven()
    config = dataclasses.replace(CONFIG, vocab_size=len(task.tokenizer))
    model, params = models.init(config, jax.random.key(0))
    run = training.TrainConfig(num_prompts=8, group_size=8, max_new_tokens=2)
    _, history = training.train(model, params, algorithms.get(name), run, steps=40, task=task)
    rewards = [h["reward"] for h in history]
    assert np.mean(rewards[:5]) < 0.2 and np.mean(rewards[-5:]) > 0.8, rewards
