"""Every preset improves a warm-started language model on the digit task (experiments/compare_methods.py)."""

import jax
import numpy as np
import pytest

from experiments import compare_methods
from jaxrl_llm import algorithms
from jaxrl_llm.tasks import DigitSumTask

CONFIG = compare_methods.CompareConfig()  # the experiment's defaults: 30 RL steps from a fixed seed
# The policy's exact expected reward over all 100 prompts (rewards are in [0, 1.5]),
# after 30 steps minus before: free of the prompt-sampling noise of the training reward.
MARGIN = {name: 0.1 for name in algorithms.PRESETS}
# The metrics the training engine reports every step, for every method (the digit task's reward
# functions are "correct" and "stops").
EVERY_STEP_METRICS = {
    "reward",
    "reward_std",
    "reward_correct",
    "reward_stops",
    "advantage_mean",
    "advantage_std",
    "advantage_min",
    "advantage_max",
    "kl_k3",
    "kl_exact",
    "clip_fraction",
    "ratio_min",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "completion_length",
    "completion_length_max",
    "truncated_fraction",
    "identical_reward_groups",
    "grad_norm",
    "learning_rate",
    "tokens_per_second",
    "rollout_seconds",
    "reward_seconds",
    "logprob_seconds",
    "update_seconds",
    "skipped_updates",
}


@pytest.fixture(scope="module")  # a module runs on one worker (`make test`: `--dist loadscope`): trained once
def warm_start():
    task = DigitSumTask()
    model, params, losses = compare_methods.warm_started_model(CONFIG, task)
    assert losses[-1] < losses[0]
    return task, model, params


@pytest.mark.slow
@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_each_preset_improves_the_reward_of_a_warm_started_model(name, warm_start):
    task, model, params = warm_start
    result = compare_methods.run(CONFIG, algorithms.get(name), model, params, task)
    start, end = result["expected_reward_start"], result["expected_reward_end"]
    assert end - start >= MARGIN[name], (name, start, end)
    history = result["history"]
    assert all(np.isfinite(v) for h in history for v in h.values())
    assert all(EVERY_STEP_METRICS <= h.keys() for h in history), EVERY_STEP_METRICS - history[0].keys()
    assert history[-1]["score_traces"] == history[-1]["update_traces"] == 1  # traced once per run
    assert history[-1]["skipped_updates"] == 0
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))  # the reference: read, never donated
    if name == "ppo":  # the critic learns: its value loss falls (0.37 -> 0.27 at this seed)
        value_loss = [h["value_loss"] for h in history]
        assert np.mean(value_loss[-10:]) < 0.85 * np.mean(value_loss[:5]), value_loss
