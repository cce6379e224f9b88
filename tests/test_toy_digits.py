"""End to end: every preset learns the toy digit task through the functional core."""

import re

import jax
import numpy as np
import pytest

from experiments import toy_digits
from jaxrl_llm import algorithms, training

CONFIG = toy_digits.ToyConfig(steps=150, seed=0)  # learning is stochastic: 150 steps (the default) leave a margin


@pytest.mark.slow
@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_every_preset_learns(name):
    result = toy_digits.train(CONFIG, algorithms.get(name))
    # Random policy: reward ~0.1 (the right digit 1 time in 11). Learning lifts it well past.
    assert result["reward_end"] > result["reward_start"] + 0.15, (result["reward_start"], result["reward_end"])
    assert result["accuracy_end"] > result["accuracy_start"]
    metrics = result["final_metrics"]
    assert all(np.all(np.isfinite(v)) for v in metrics.values())
    method = algorithms.get(name)
    if method.update == "trpo":
        # Every accepted TRPO step satisfied the trust region on its own batch.
        assert float(metrics["trpo_kl"]) <= method.max_kl
    elif method.num_iterations == 1 and method.objective != "policy_gradient":
        # mu = 1: the single update is on-policy, so the ratio is 1 (to float32 rounding:
        # the sampler and the teacher-forced pass order their sums differently) and
        # nothing clips. Checked on the last step that trained on any row (DAPO's dynamic
        # sampling can leave none: then there is no ratio).
        metrics = next(m for m in reversed(result["history"]) if m["trained_rows"] > 0)
        np.testing.assert_allclose([metrics["ratio_min"], metrics["ratio_max"]], 1.0, atol=1e-5)
        assert float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_the_step_takes_its_advantages_and_loss_from_the_library(name, monkeypatch):
    """The toy trains with the library's train step: no private copy of the RL math.
    Its step must feed `compute_advantages`' output, unchanged, to `policy_loss`."""
    calls = {"compute_advantages": [], "policy_loss": []}
    for fn in calls:

        def spy(*args, _fn=fn, _original=getattr(algorithms, fn), **kwargs):  # noqa: B008 (bound per fn)
            out = _original(*args, **kwargs)
            calls[_fn].append((args, kwargs, out))
            return out

        monkeypatch.setattr(algorithms, fn, spy)
    config = toy_digits.ToyConfig(num_prompts=2, group_size=2, hidden=8)
    method = training.fit_overlong_buffer(algorithms.get(name), config.max_new_tokens)
    state, fixed = toy_digits.init_state(config, method)
    jax.eval_shape(toy_digits.make_train_step(config, method), state, fixed)  # traces the whole step
    ((args, _, (advantages, _, _)),) = calls["compute_advantages"]
    assert args[0] is method
    assert calls["policy_loss"] and all(loss_args[3] is advantages for loss_args, _, _ in calls["policy_loss"])
    expected_shape = (4, config.max_new_tokens) if method.advantage in ("gae", "reinforce_pp") else (4,)
    assert advantages.shape == expected_shape


@pytest.mark.slow
def test_ppo_critic_learns_to_explain_returns():
    """The returns' variance grows as the policy starts to succeed, so the raw value loss
    is not comparable across steps; the explained variance 1 - Var[R - V] / Var[R] is."""
    result = toy_digits.train(CONFIG, algorithms.PPO)
    explained = np.array([m["explained_variance"] for m in result["history"]])
    assert explained[:10].mean() < 0.1
    assert explained[-20:].mean() > 0.25, explained


def test_main_prints_a_table(capsys):
    toy_digits.main(["--steps", "3", "--algorithms", "grpo,trpo"])
    out = capsys.readouterr().out
    assert "method" in out and "grpo" in out and "trpo" in out


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="`group_size` must be >= 2"):
        toy_digits.ToyConfig(group_size=1)


def test_the_flags_parse_to_the_config():
    assert toy_digits.parse([]) == toy_digits.ToyConfig() and toy_digits.parse([]).algorithms == tuple(
        algorithms.PRESETS
    )
    for argv in (["--algorithms", "grpo,trpo"], ["--algorithms", "grpo", "trpo"]):
        config = toy_digits.parse([*argv, "--steps", "3"])
        assert config.steps == 3 and [m.name for m in config.methods()] == ["grpo", "trpo"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning-rate", "inf"], "`learning_rate` must be a finite number; got inf"),
        (["--group-size", "1"], "`group_size` must be >= 2"),
        (["--algorithms", "grpo2"], "Unknown algorithm 'grpo2'"),
        (["--steps", "many"], "--steps"),
    ],
)
def test_bad_settings_exit_with_usage_before_any_compute(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(toy_digits, "train", lambda *a: pytest.fail("a method trained"))
    with pytest.raises(SystemExit) as exit_:
        toy_digits.main(argv)
    stderr = " ".join(re.sub("[│╭╮╰╯─]", " ", capsys.readouterr().err).split())  # tyro's box as one line
    assert exit_.value.code == 2 and message in stderr
