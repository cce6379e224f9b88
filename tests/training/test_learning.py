"""Every preset improves a warm-started language model on the digit task (experiments/digits_lm.py)."""

import re

import jax
import numpy as np
import pytest

from experiments import digits_lm
from jaxrl_llm import algorithms, training
from jaxrl_llm.tasks import DigitSumTask

CONFIG = digits_lm.DigitsConfig()  # the `make run` defaults: 30 RL steps from a fixed seed
# The policy's exact expected reward over all 100 prompts (rewards are in [0, 1.5]),
# after 30 steps minus before: free of the prompt-sampling noise of the training reward.
MARGIN = {name: 0.1 for name in algorithms.PRESETS}
# The metrics the training engine reports every step, for every method (the digit task's reward
# functions are "correct" and "stops").
EVERY_STEP_METRICS = {
    "reward", "reward_std", "reward_correct", "reward_stops",
    "advantage_mean", "advantage_std", "advantage_min", "advantage_max",
    "kl_k3", "kl_exact", "clip_fraction", "ratio_min", "ratio_mean", "ratio_max", "entropy",
    "completion_length", "completion_length_max", "truncated_fraction", "identical_reward_groups",
    "grad_norm", "learning_rate", "tokens_per_second",
    "rollout_seconds", "reward_seconds", "logprob_seconds", "update_seconds", "skipped_updates",
}


@pytest.fixture(scope="module")
def warm_start():
    task = DigitSumTask()
    model, params, losses = digits_lm.warm_started_model(CONFIG, task)
    assert losses[-1] < losses[0]
    return task, model, params


@pytest.mark.slow
@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_each_preset_improves_the_reward_of_a_warm_started_model(name, warm_start):
    task, model, params = warm_start
    result = digits_lm.run(CONFIG, algorithms.get(name), model, params, task)
    start, end = result["expected_reward_start"], result["expected_reward_end"]
    assert end - start >= MARGIN[name], (name, start, end)
    history, state = result["history"], result["state"]
    assert all(np.isfinite(v) for h in history for v in h.values())
    assert all(EVERY_STEP_METRICS <= h.keys() for h in history), EVERY_STEP_METRICS - history[0].keys()
    assert history[-1]["score_traces"] == history[-1]["update_traces"] == 1  # traced once per run
    assert history[-1]["skipped_updates"] == 0
    jax.tree.map(np.testing.assert_array_equal, state.ref_params, params)  # the reference stays put
    if name == "ppo":  # the critic learns: its value loss falls (0.37 -> 0.27 at this seed)
        value_loss = [h["value_loss"] for h in history]
        assert np.mean(value_loss[-10:]) < 0.85 * np.mean(value_loss[:5]), value_loss


def test_the_main_job_runs_and_prints_its_table(capsys):
    results = digits_lm.main(["--sft-steps", "3", "--rl-steps", "2", "--algorithms", "grpo,ppo"])
    assert [r["algorithm"] for r in results] == ["grpo", "ppo"]
    out = capsys.readouterr().out
    assert "SFT warm start: 3 steps" in out and "greedy acc" in out


def test_the_main_job_interrupted_prints_the_methods_done_and_exits_130(monkeypatch, capsys):
    real_run = digits_lm.run

    def interrupted_at_grpo(config, method, *args):
        if method.name == "grpo":
            raise training.RunInterrupted("stopped", None, [{}])
        return real_run(config, method, *args)

    monkeypatch.setattr(digits_lm, "run", interrupted_at_grpo)
    with pytest.raises(SystemExit) as exit_:
        digits_lm.main(["--sft-steps", "3", "--rl-steps", "2", "--algorithms", "pg,grpo,ppo"])
    out = capsys.readouterr().out
    assert exit_.value.code == 130
    assert "Interrupted: grpo after 1 of 2 steps." in out and "\npg " in out and "ppo" not in out.split("Interrupted")[1]


@pytest.mark.parametrize("argv, message", [
    (["--rl-steps", "0"], "`rl_steps` must be an integer >= 1; got 0"),
    (["--learning-rate", "inf"], "`learning_rate` must be a finite number; got inf"),
    (["--group-size", "1", "--algorithms", "grpo"], "Algorithm 'grpo' compares each completion"),
    (["--algorithms", "grpo2"], "Unknown algorithm 'grpo2'"),
    (["--sft-accuracy", "1.5"], r"`sft_accuracy` must be in \[0.0, 1.0\]; got 1.5"),
])
def test_the_main_job_refuses_bad_settings_before_any_compute(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(digits_lm, "warm_started_model", lambda *a: pytest.fail("the warm start ran"))
    with pytest.raises(SystemExit) as exit_:
        digits_lm.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
