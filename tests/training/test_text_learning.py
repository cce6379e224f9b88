"""The built-in toy run (``--config toy``, ``RunConfig()``) raises held-out accuracy by at least 20 points.

The whole text pipeline, end to end, as ``jaxrl-llm train`` runs it (``runs.train_run``
on ``RunConfig()``): the built-in character tokenizer with its chat template, the
arithmetic task ("Solve 3 + 4") rendering its prompts through that template, a supervised
warm start on the task's own demonstrations, then GRPO with the task's default reward
(exact match on the completion's last number), evaluated every 10 steps on the test
split, whose 20 expressions the train stream never draws.

The warm start uses systematically wrong labels: 70% of the demonstrations answer
``a + b + 1``. The model learns the sums, on held-out expressions too, but with the right
answer as the weaker of two modes, so greedy decoding mostly answers one too many while
sampling often finds the right answer: the reward gives GRPO a clear signal, and the fix,
preferring ``a + b`` to ``a + b + 1``, carries over to expressions it never trains on.

Held-out greedy accuracy after the warm start -> after 40 GRPO steps: seed 0 0.35 -> 0.80,
seed 1 0.10 -> 0.70, seed 2 0.55 -> 0.85. The test runs seed 0 and asks for the 20 points
docs/runs.md promises.

With LoRA (``experiments/configs/toy-lora.toml``: rank-8 adapters on every linear layer over the
warm-started base, learning rate 2e-3): seed 0 0.35 -> 0.95, seed 1 0.10 -> 0.95, seed 2
0.55 -> 0.95. The test asks the same 20 points of seed 0, with the base left bitwise as the
warm start made it.
"""

import chex
import numpy as np
import pytest

from jaxrl_llm import models, runs
from jaxrl_llm.runs import build
from jaxrl_llm.runs.policy import load_base

MARGIN = 0.2  # greedy accuracy gained on the 20 held-out expressions: 4 of them


@pytest.mark.slow
def test_the_toy_run_raises_the_held_out_accuracy_of_its_warm_start_by_20_points(tmp_path):
    config = runs.RunConfig()
    result = runs.train_run(config, tmp_path / "run", progress=False, stream=None)
    metrics = runs.read_metrics(tmp_path / "run")
    evaluations = [row for row in metrics if row.get("eval_greedy_accuracy") is not None]
    before, after = result.warm_start, evaluations[-1]

    # The prompts went through the chat template, over the tokenizer's alphabet only.
    task = build.task(config.task, build.tokenizer(config.model))
    assert task.chat_template
    test = task.examples("test", np.arange(task.split_size("test")), seed=0)
    assert task.tokenizer.decode(test.tokens[0]) == f"u:Solve {test.columns['expression'][0]}\na:"
    assert task.tokenizer.unk_token_id not in test.tokens
    # Held out: the warm start and RL draw from the train stream, which skips the test expressions.
    train_expressions = task.examples("train", np.arange(1024), seed=config.train.seed).columns["expression"]
    assert not set(train_expressions) & set(test.columns["expression"])

    assert before["last_loss"] < before["first_loss"]
    assert before["eval_examples"] == after["eval_examples"] == 20
    assert [row["step"] for row in evaluations] == [9, 19, 29, 39] and len(metrics) == config.steps
    assert before["eval_greedy_accuracy"] <= 0.5, before  # room to improve: the wrong mode mostly wins
    assert after["eval_greedy_accuracy"] - before["eval_greedy_accuracy"] >= MARGIN, (before, after)
    assert after["eval_pass@1"] - before["eval_pass@1"] >= 0.05, (before, after)  # sampling at T = 1 improves too
    assert all(np.isfinite(v) for row in metrics for v in row.values() if v is not None)
    assert metrics[-1]["update_traces"] == 1 and metrics[-1]["skipped_updates"] == 0
    assert f"Held-out greedy accuracy: {before['eval_greedy_accuracy']:.2f} after the warm start" in result.summary


@pytest.mark.slow
def test_the_toy_run_with_lora_raises_the_held_out_accuracy_by_20_points_over_a_frozen_base(tmp_path):
    config = runs.load("toy-lora")
    assert config.lora.build() is not None and config.warm_start == runs.RunConfig().warm_start
    result = runs.train_run(config, tmp_path / "run", progress=False, stream=None)
    evaluations = [row for row in runs.read_metrics(tmp_path / "run") if row.get("eval_greedy_accuracy") is not None]
    before, after = result.warm_start, evaluations[-1]
    assert after["eval_greedy_accuracy"] - before["eval_greedy_accuracy"] >= MARGIN, (before, after)
    assert after["eval_pass@1"] - before["eval_pass@1"] >= 0.05, (before, after)
    base = load_base(tmp_path / "run", config, build.run_task(config))  # the warm start's weights
    *_, policy, step = runs.restore_policy(tmp_path / "run")
    assert step == config.steps
    chex.assert_trees_all_equal(policy, models.lora.combine(base, result.state.params))  # the base untouched by RL
    assert result.history[-1]["skipped_updates"] == 0
