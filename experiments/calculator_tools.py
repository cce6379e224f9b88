r"""A tiny model learns *when* to call a tool, by RL on multi-turn episodes, on a CPU.

Task (:class:`jaxrl_llm.tasks.CalculatorTask`): sums, half of them single digits (easy, a
tiny model adds them itself), half of 3- and 4-digit numbers (hard, it cannot), with an
``add`` tool. The reward is 1 for the right final answer, minus 0.1 per tool call: calling
pays exactly where the model's own answer is right less than 90% of the time.

1. Warm start: supervised fine-tuning on demonstration episodes in which the tool is
   called with probability ``tool_fraction`` *whatever the sum*: the model learns both forms
   (answering, and calling ``add`` then copying its result) but not when each pays.
2. RL (GRPO through :func:`jaxrl_llm.training.train` with the task's tool): the episodes
   are rolled out with the KV cache carried across the tool turn, and the reward teaches the
   choice.

Every ``eval_every`` steps the held-out split is rolled out, greedy and sampled at the
training temperature, and split by difficulty: success (the sampled success is the
policy's own, pass@1) and tool calls per episode. The table and the plot show the calls
on hard sums rising and those on easy ones falling while success rises.

Run ``python experiments/calculator_tools.py --help`` for options.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
import tyro

from jaxrl_llm import algorithms, host, models, rollouts, sampling, training
from jaxrl_llm.episodes import EpisodeConfig, scoring
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import CalculatorTask
from jaxrl_llm.tasks.calculator import sft_arrays

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """Settings of the run (defaults: a few minutes on 2 CPU cores)."""

    tool_fraction: float = 0.5
    """The warm start's demonstrations call the tool with this probability, easy or hard."""
    demonstrations: int = 4096
    sft_steps: int = 1000
    sft_learning_rate: float = 3e-3
    steps: int = 300
    """RL steps (rollout batches)."""
    learning_rate: float = 1e-4
    temperature: float = 0.7
    """Sampling temperature of the rollouts and of the sampled held-out success."""
    num_prompts: int = 8
    group_size: int = 4
    max_new_tokens: int = 64
    max_turns: int = 1
    eval_every: int = 50
    eval_examples: int = 200
    eval_samples: int = 4
    """Samples per held-out prompt for the sampled success (pass@1)."""
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0
    plot: pathlib.Path | None = RESULTS / "calculator_tools.png"
    """Where to save the plot (``None``: no plot)."""
    history: pathlib.Path | None = None
    """Where to write the held-out metrics as JSON (``None``: nowhere)."""


def evaluate(task, model, params, config: CalculatorConfig, strategy: rollouts.RolloutStrategy) -> dict[str, float]:
    """Held-out success and tool calls per episode, greedy and sampled, easy and hard."""
    batch = task.examples("test", np.arange(config.eval_examples), seed=config.seed)
    hard = np.asarray(batch.columns["hard"])
    found = {}
    for mode, temperature, samples in (("greedy", 0.0, 1), ("sampled", config.temperature, config.eval_samples)):
        settings = sampling.SamplingConfig(
            max_new_tokens=config.max_new_tokens, max_prompt_length=32, temperature=temperature
        )
        sampler = sampling.Sampler(model=model, eos_ids=task.eos_ids, pad_id=task.pad_id, sampling=settings)
        scored = strategy.score(
            sampler, params, task, batch, jax.random.key(config.seed + 1), num_samples=samples, sampling_config=settings
        )
        rows = np.repeat(hard, samples)
        solved = scored.result.values["correct"] >= 1.0
        calls = -scored.result.values["calls"]  # the task's call cost counts tool messages
        for kind, where in (("all", slice(None)), ("hard", rows), ("easy", ~rows)):
            found[f"{mode}_success_{kind}"] = float(solved[where].mean())
            found[f"{mode}_calls_{kind}"] = float(calls[where].mean())
    return found


def run(config: CalculatorConfig) -> list[dict[str, float]]:
    """The warm start, then RL; the held-out metrics at step 0 (after the warm start) and
    every ``eval_every`` steps, with the elapsed seconds of each phase."""
    task = CalculatorTask()
    model, params = models.init(
        models.ModelConfig(
            vocab_size=len(task.tokenizer),
            hidden_size=config.hidden_size,
            intermediate_size=4 * config.hidden_size,
            num_layers=config.num_layers,
            num_heads=4,
            num_kv_heads=2,
            head_dim=config.hidden_size // 4,
            max_position_embeddings=256,
        ),
        jax.random.key(config.seed),
    )
    strategy = scoring.rollout_strategy(task, episodes=EpisodeConfig(max_turns=config.max_turns))
    started = time.perf_counter()
    conversations = task.demonstrations(config.demonstrations, seed=config.seed, tool_fraction=config.tool_fraction)
    params, _ = training.supervised_finetune(
        model,
        params,
        *sft_arrays(task.tokenizer, conversations, tools=task.tools),
        steps=config.sft_steps,
        batch_size=64,
        learning_rate=config.sft_learning_rate,
        seed=config.seed,
    )
    warm_seconds = time.perf_counter() - started
    history = [
        dict(step=0, warm_start_seconds=warm_seconds, rl_seconds=0.0, **evaluate(task, model, params, config, strategy))
    ]
    train_config = training.TrainConfig(
        num_prompts=config.num_prompts,
        group_size=config.group_size,
        seed=config.seed,
        sampling=SamplingConfig(
            max_new_tokens=config.max_new_tokens, max_prompt_length=32, temperature=config.temperature
        ),
        optimizer=training.OptimizerConfig(learning_rate=config.learning_rate, warmup_steps=1),
        episodes=EpisodeConfig(max_turns=config.max_turns),
    )
    rl_started = time.perf_counter()
    evaluation_seconds = 0.0

    def on_step(end: training.StepEnd) -> None:
        nonlocal evaluation_seconds
        if (end.step + 1) % config.eval_every == 0:
            began = time.perf_counter()
            metrics = evaluate(task, model, end.state.params, config, strategy)
            evaluation_seconds += time.perf_counter() - began
            rl_seconds = time.perf_counter() - rl_started - evaluation_seconds
            history.append(dict(step=end.step + 1, warm_start_seconds=warm_seconds, rl_seconds=rl_seconds, **metrics))
            print(table([history[-1]], header=False), flush=True)

    print(table(history), flush=True)
    training.train(model, params, algorithms.get("grpo"), train_config, steps=config.steps, task=task, callback=on_step)
    return history


COLUMNS = ("step", "rl_seconds", "greedy_success_all", "sampled_success_all", "sampled_success_hard",
           "sampled_success_easy", "sampled_calls_hard", "sampled_calls_easy")  # fmt: skip


def table(history: list[dict[str, float]], *, header: bool = True) -> str:
    lines = [" ".join(f"{c:>20}" for c in COLUMNS)] if header else []
    lines += [
        " ".join(f"{row[c]:>20.3f}" if isinstance(row[c], float) else f"{row[c]:>20}" for c in COLUMNS)
        for row in history
    ]
    return "\n".join(lines)


def plot(history: list[dict[str, float]], path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415 (plotting only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = [row["step"] for row in history]
    figure, (success, calls) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in ("hard", "easy", "all"):
        success.plot(steps, [row[f"sampled_success_{kind}"] for row in history], label=f"sampled, {kind}")
    success.plot(steps, [row["greedy_success_all"] for row in history], "--", label="greedy, all")
    success.set(xlabel="RL step", ylabel="held-out success", ylim=(0, 1.02), title="success")
    for kind in ("hard", "easy"):
        calls.plot(steps, [row[f"sampled_calls_{kind}"] for row in history], label=f"sampled, {kind}")
    calls.set(xlabel="RL step", ylabel="tool calls per episode", title="when the tool is called")
    success.legend()
    calls.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main(config: CalculatorConfig) -> None:
    history = run(config)
    first, last = history[0], history[-1]
    print(
        f"held-out sampled success {first['sampled_success_all']:.3f} -> {last['sampled_success_all']:.3f} "
        f"(greedy {first['greedy_success_all']:.3f} -> {last['greedy_success_all']:.3f}); tool calls per episode "
        f"hard {first['sampled_calls_hard']:.2f} -> {last['sampled_calls_hard']:.2f}, easy "
        f"{first['sampled_calls_easy']:.2f} -> {last['sampled_calls_easy']:.2f}; warm start "
        f"{last['warm_start_seconds']:.0f} s, RL {last['rl_seconds']:.0f} s"
    )
    if config.history is not None:
        config.history.write_text(json.dumps(history, indent=1))
    if config.plot is not None:
        plot(history, config.plot)
        print(f"plot: {config.plot}")


if __name__ == "__main__":
    host.reuse_freed_memory()  # before JAX's first computation
    main(tyro.cli(CalculatorConfig))
