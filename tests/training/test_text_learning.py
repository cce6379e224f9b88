"""GRPO raises the held-out accuracy of a tiny model on the text arithmetic task.

The whole text pipeline, end to end: a character tokenizer with a chat template, the
arithmetic task ("Solve 3 + 4") rendering its prompts through that template, a supervised
warm start on the task's own demonstrations, then ``training.train`` with GRPO and the
task's default reward (exact match on the completion's last number), scored by
``evaluation.evaluate`` on the test split, whose 20 expressions the train stream never draws.

The warm start uses systematically wrong labels: 70% of the demonstrations answer
``a + b + 1``. The model learns the sums, on held-out expressions too, but with the right
answer as the weaker of two modes, so greedy decoding mostly answers one too many while
sampling finds the right answer often (pass@1 about 0.3): the reward gives GRPO a clear
signal, and the fix, preferring ``a + b`` to ``a + b + 1``, carries over to expressions it
never trains on. Uniformly random wrong labels do not make such a test: the right answer
stays the greedy mode, and the noise only hurts held-out accuracy.

Held-out greedy accuracy before -> after 30 GRPO steps (pass@1 of 16 samples at T = 1):

    seed 0: 0.20 -> 0.65 (0.33 -> 0.53)    seed 1: 0.10 -> 0.95 (0.26 -> 0.69)
    seed 2: 0.40 -> 0.85 (0.41 -> 0.59)    seed 3: 0.05 -> 0.80 (0.25 -> 0.64)
    seed 4: 0.35 -> 1.00 (0.39 -> 0.72)

The test runs seed 0 and asks for a gain of ``MARGIN``, below the smallest seen (0.45).
"""

import jax
import numpy as np
import pytest

from jaxrl_llm import algorithms, evaluation, models, tasks, training

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- message['role'][0] + ':' + message['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'a:' }}{%- endif %}"
)
"""A user turn "Solve 3 + 4" renders as "u:Solve 3 + 4\\na:" (a system turn as "s:...\\n")."""
ALPHABET = "0123456789+ :\nSolveua"
"""Every character the template, the prompts and the answers use."""
SEED = 0
MAX_NEW_TOKENS = 3  # answers are 0..19 (with the wrong labels), then EOS
WRONG_LABELS = 0.7  # the fraction of demonstrations answering a + b + 1
RL_STEPS = 30
MARGIN = 0.3  # greedy accuracy gained on the 20 held-out expressions: 6 of them


def warm_started(seed: int):
    """The task and a tiny model fine-tuned on demonstrations with wrong labels."""
    tokenizer = tasks.build_char_tokenizer(ALPHABET)
    tokenizer.chat_template = CHAT_TEMPLATE
    task = tasks.arithmetic(tokenizer=tokenizer)  # a + b, one-digit operands; 20 test expressions
    config = models.ModelConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=32, bos_token_id=tokenizer.bos_token_id, eos_token_ids=task.eos_ids,
        pad_token_id=task.pad_id)
    model, params = models.init(config, jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def mostly_one_too_many(record):
        return str(int(record["answer"]) + 1) if rng.random() < WRONG_LABELS else record["answer"]

    demonstrations = task.demonstrations("train", np.arange(1024), completion=mostly_one_too_many,
                                         max_new_tokens=MAX_NEW_TOKENS, seed=seed)
    params, losses = training.supervised_finetune(model, params, *demonstrations, steps=300, batch_size=64,
                                                  learning_rate=1e-3, seed=seed)
    # Anneal: a lower rate settles the model near the labels' distribution (at 1e-3 the
    # greedy answer flips with the latest minibatches, the two modes being close).
    params, annealed = training.supervised_finetune(model, params, *demonstrations, steps=100, batch_size=64,
                                                    learning_rate=2e-4, seed=seed + 1)
    return task, model, params, losses + annealed


def learn(seed: int):
    """Warm start, then GRPO: the held-out metrics before and after, and the run's history."""
    task, model, params, losses = warm_started(seed)
    evaluate = lambda p: evaluation.evaluate(  # noqa: E731
        model, p, task, split="test", max_new_tokens=MAX_NEW_TOKENS, num_samples=16, progress=False)
    before = evaluate(params)
    config = training.TrainConfig(num_prompts=8, group_size=8, max_new_tokens=MAX_NEW_TOKENS, learning_rate=2e-4,
                                  seed=seed)
    state, history = training.train(model, params, algorithms.GRPO, config, steps=RL_STEPS, task=task)
    return task, losses, before, evaluate(state.params), history


@pytest.mark.slow
def test_grpo_raises_the_held_out_accuracy_of_a_model_warm_started_through_the_chat_template():
    task, losses, before, after, history = learn(SEED)

    # The prompts went through the chat template, over the tokenizer's alphabet only.
    assert task.chat_template
    test = task.examples("test", np.arange(task.split_size("test")), seed=0)
    assert task.tokenizer.decode(test.tokens[0]) == f"u:Solve {test.columns['expression'][0]}\na:"
    assert task.tokenizer.unk_token_id not in test.tokens
    # Held out: the warm start and RL draw from the train stream, which skips the test expressions.
    train_expressions = task.examples("train", np.arange(1024), seed=SEED).columns["expression"]
    assert not set(train_expressions) & set(test.columns["expression"])

    assert np.mean(losses[-20:]) < losses[0]
    assert before["examples"] == after["examples"] == 20
    assert before["greedy_accuracy"] <= 0.5, before  # room to improve: the wrong mode mostly wins
    assert after["greedy_accuracy"] - before["greedy_accuracy"] >= MARGIN, (before, after)
    assert after["pass@1"] - before["pass@1"] >= 0.1, (before, after)  # sampling at T = 1 improves too
    assert all(np.isfinite(value) for metrics in history for value in metrics.values())
    assert history[-1]["update_traces"] == 1 and history[-1]["skipped_updates"] == 0
