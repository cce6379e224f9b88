r"""Every method on a real (tiny) language model: SFT warm start, then RL. The ``make run`` job.

Task (:class:`jaxrl_llm.tasks.DigitSumTask`): the prompt is ``"a+b="``, the right answer
the single digit ``(a + b) mod 10`` then EOS; reward 1 for the digit, +0.5 for the EOS.

1. A 2-layer Llama-style decoder (:mod:`jaxrl_llm.models`) starts from random weights.
2. Supervised warm start (:func:`jaxrl_llm.training.supervised_finetune`) on solved
   examples whose answers are half random digits, stopped once greedy decoding answers
   80% of the prompts right: the model then knows the answers only as a mode (expected
   reward about 0.5). From scratch, almost every group's rewards tie and group
   baselines give no gradient.
3. For each method, the same warm-started model is trained by
   :func:`jaxrl_llm.training.train`: jitted KV-cache rollouts, host rewards, then the
   jitted ``score`` / ``update`` halves of the train step. The table shows the mean
   training reward of the first and last five steps, the policy's exact expected
   reward and its greedy accuracy over all 100 prompts before and after, the exact KL
   to the reference, and the wall time.

Run ``python experiments/digits_lm.py --help`` for options.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm import _checks, algorithms, cli, evaluation, host, models, training
from jaxrl_llm.tasks import DigitSumTask

PROMPT_WIDTH = 8
"""Prompt positions in training: ``"a+b="`` left-padded to ``train``'s 8-token bucket."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """Settings of the run (defaults: all eleven methods in about two minutes on 2 CPU cores)."""

    hidden_size: int = 64
    """Model width (4 heads, 2 KV heads, MLP 4x)."""
    num_layers: int = 2
    sft_label_noise: float = 0.5
    """Fraction of warm-start answers replaced by random digits: the model learns the
    answers but only as a mode, room for RL to sharpen."""
    sft_accuracy: float = 0.8
    """The warm start stops once greedy accuracy reaches this."""
    sft_steps: int = 1500
    """At most this many warm-start steps (checked every 25)."""
    sft_learning_rate: float = 1e-3
    rl_steps: int = 30
    """Train steps (rollout batches) per method."""
    learning_rate: float = 5e-4
    """Peak AdamW learning rate of the RL policy (and critic)."""
    num_prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 2
    """Room for the answer digit and EOS."""
    seed: int = 0

    def __post_init__(self):
        where = "DigitsConfig"
        for field in ("hidden_size", "num_layers", "sft_steps", "rl_steps", "num_prompts", "group_size",
                      "max_new_tokens"):
            _checks.positive_int(where, field, getattr(self, field))
        if self.hidden_size % 4:
            raise ValueError(f"{where}: `hidden_size` must be a multiple of the 4 heads; got {self.hidden_size}.")
        _checks.nonnegative_int(where, "seed", self.seed)
        for field in ("sft_label_noise", "sft_accuracy"):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.in_range(where, field, getattr(self, field), 0.0, 1.0)
        _checks.finite_number(where, "sft_learning_rate", self.sft_learning_rate)
        _checks.positive(where, "sft_learning_rate", self.sft_learning_rate)
        self.train_config()  # validates the RL settings (learning rate, batch shape) before any compute

    def train_config(self) -> training.TrainConfig:
        """The settings of each method's RL run."""
        return training.TrainConfig(
            num_prompts=self.num_prompts, group_size=self.group_size, max_new_tokens=self.max_new_tokens,
            learning_rate=self.learning_rate, critic_learning_rate=self.learning_rate, seed=self.seed)


def warm_started_model(config: DigitsConfig, task: DigitSumTask) -> tuple[models.Model, models.Params, list[float]]:
    """A random decoder fine-tuned on ``sft_steps`` batches of solved examples."""
    model_config = models.ModelConfig(
        vocab_size=len(task.tokenizer), hidden_size=config.hidden_size, intermediate_size=4 * config.hidden_size,
        num_layers=config.num_layers, num_heads=4, num_kv_heads=2, head_dim=config.hidden_size // 4,
        max_position_embeddings=max(32, PROMPT_WIDTH + config.max_new_tokens),
        bos_token_id=task.tokenizer.bos_token_id, eos_token_ids=(task.eos_id,),
        pad_token_id=task.pad_id)
    model, params = models.init(model_config, jax.random.key(config.seed))
    demonstrations = task.demonstrations(np.random.default_rng(config.seed), 4096, config.max_new_tokens,
                                         label_noise=config.sft_label_noise)
    params, losses = training.supervised_finetune(
        model, params, *demonstrations, steps=config.sft_steps, batch_size=64, learning_rate=config.sft_learning_rate,
        seed=config.seed, stop=lambda step, p: greedy_accuracy(model, p, task) >= config.sft_accuracy)
    return model, params, losses


def greedy_accuracy(model: models.Model, params: models.Params, task: DigitSumTask) -> float:
    """Fraction of all 100 prompts (the task's test split) answered exactly by greedy
    decoding: the digit, then EOS (the ``stops`` reward, 0.5, is earned by exactly these)."""
    return evaluation.evaluate(model, params, task, max_new_tokens=2, batch_size=100, correct_reward="stops",
                               threshold=0.5, progress=False)["greedy_accuracy"]


def expected_reward(model: models.Model, params: models.Params, task: DigitSumTask) -> float:
    r"""The policy's exact expected reward over all 100 prompts (temperature 1, no sampling):

    .. math::
        \mathbb{E}[R] = \frac{1}{100}\sum_{a,b} \pi(d \mid a{+}b{=})\,
            \big(1 + \tfrac12\, \pi(\text{EOS} \mid a{+}b{=}d)\big), \quad d = (a+b) \bmod 10
    """
    tokens, attention_mask, _ = _all_solved_examples(task)
    logp = models.completion_logprobs(model, params, tokens, attention_mask, 2)  # [100, 2]
    p_digit, p_eos = np.exp(np.asarray(logp, np.float64)).T
    return float(np.mean(p_digit * (1.0 + 0.5 * p_eos)))


def _all_solved_examples(task: DigitSumTask):
    digits = np.stack(np.meshgrid(np.arange(10), np.arange(10), indexing="ij"), -1).reshape(-1, 2)  # [100, 2]
    encoded = task.tokenizer([f"{a}+{b}=" for a, b in digits], return_tensors="np")
    completion = np.stack([task.answer_ids(digits.sum(1) % 10), np.full(100, task.eos_id)], axis=1)  # [100, 2]
    tokens = np.concatenate([encoded["input_ids"], completion], axis=1)
    attention_mask = np.concatenate([encoded["attention_mask"], np.ones_like(completion)], axis=1)
    return tokens, attention_mask.astype(bool), digits


def run(config: DigitsConfig, algorithm: algorithms.Algorithm, model: models.Model, params: models.Params,
        task: DigitSumTask) -> dict[str, Any]:
    """Trains one method from the warm start; returns its curve and summary numbers."""
    started = time.perf_counter()
    state, history = training.train(model, params, algorithm, config.train_config(), steps=config.rl_steps, task=task)
    seconds = time.perf_counter() - started
    rewards = np.array([h["reward"] for h in history])
    window = min(5, len(rewards))
    return {
        "algorithm": algorithm.name,
        "reward_start": float(rewards[:window].mean()),
        "reward_end": float(rewards[-window:].mean()),
        "accuracy_end": greedy_accuracy(model, state.params, task),
        "expected_reward_start": expected_reward(model, params, task),
        "expected_reward_end": expected_reward(model, state.params, task),
        "kl_exact": history[-1]["kl_exact"],
        "seconds": seconds,
        "history": history,
        "state": state,
    }


def format_table(results: list[dict[str, Any]], accuracy_start: float) -> str:
    header = (f"{'method':<20} {'reward first 5':>14} {'reward last 5':>13} {'E[reward]':>14} {'greedy acc':>14} "
              f"{'KL(ref)':>8} {'time':>7}")
    lines = [header, "-" * len(header)]
    for r in results:
        accuracy = f"{accuracy_start:.2f} -> {r['accuracy_end']:.2f}"
        expected = f"{r['expected_reward_start']:.3f} -> {r['expected_reward_end']:.3f}"
        lines.append(f"{r['algorithm']:<20} {r['reward_start']:>14.3f} {r['reward_end']:>13.3f} {expected:>14} "
                     f"{accuracy:>14} {r['kl_exact']:>8.3f} {r['seconds']:>6.1f}s")
    return "\n".join(lines)


def check_supported(config: DigitsConfig, methods: list[algorithms.Algorithm]) -> None:
    """Raises if a method cannot run with these settings (before the warm start, not after it)."""
    for method in methods:
        training.check_supported(method, config.train_config())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config, methods = cli.parse(DigitsConfig, __doc__.split("\n\n")[0], argv, check=check_supported)
    task = DigitSumTask()
    started = time.perf_counter()
    model, params, losses = warm_started_model(config, task)
    accuracy = greedy_accuracy(model, params, task)
    print(f"SFT warm start: {len(losses)} steps, loss {losses[0]:.2f} -> {np.mean(losses[-20:]):.2f}, "
          f"greedy accuracy {accuracy:.2f} ({time.perf_counter() - started:.1f}s)")
    print(f"RL: P={config.num_prompts} prompts x G={config.group_size} completions, {config.rl_steps} steps per method")
    results, interrupted = [], None
    for method in methods:
        try:
            results.append(run(config, method, model, params, task))
        except training.RunInterrupted as stop:  # Ctrl-C: the methods done so far still get their table
            interrupted = f"Interrupted: {method.name} after {len(stop.history)} of {config.rl_steps} steps."
            break
        r = results[-1]
        print(f"  {r['algorithm']:<20} reward {r['reward_start']:.3f} -> {r['reward_end']:.3f}  ({r['seconds']:.1f}s)",
              flush=True)
    print()
    if interrupted:
        print(interrupted)
    if results:
        print(format_table(results, accuracy))
    if interrupted:
        raise SystemExit(130)  # the shell's status for a run ended by SIGINT
    return results


if __name__ == "__main__":
    host.reuse_freed_memory()  # before JAX's first computation
    main()
