r"""Every method on a real (tiny) language model: SFT warm start, then RL, compared in one table.

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

The table is printed and, with ``--out-dir`` (default ``runs/compare_methods``), written
as ``results.md`` and ``results.json`` (the table's numbers, the warm start's and every
method's training reward per step), with ``rewards.png``: every method's training-reward
curve.

Run ``python experiments/compare_methods.py --help`` for options.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tyro

from jaxrl_llm import _checks, algorithms, evaluation, host, models, training
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import DigitSumTask
from jaxrl_llm.training.config import OptimizerConfig

PROMPT_WIDTH = 8
"""Prompt positions in training: ``"a+b="`` left-padded to ``train``'s 8-token bucket."""
WINDOW = 5
"""Steps averaged: the table's first and last training reward, the plot's moving average."""
ALL_METHODS = tuple(algorithms.PRESETS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """Settings of the comparison (defaults: all eleven methods in a few minutes on 2 CPU cores)."""

    algorithms: tuple[str, ...] = ALL_METHODS
    """Methods to compare, in this order: preset names, space- or comma-separated (grpo ppo, or grpo,ppo)."""
    hidden_size: int = 64
    """Model width (4 heads, 2 KV heads, MLP 4x)."""
    num_layers: int = 2
    """Decoder layers."""
    sft_label_noise: float = 0.5
    """Fraction of warm-start answers replaced by random digits: the answers become a mode, room for RL."""
    sft_accuracy: float = 0.8
    """The warm start stops once greedy accuracy reaches this."""
    sft_steps: int = 1500
    """At most this many warm-start steps (checked every 25)."""
    sft_learning_rate: float = 1e-3
    """Learning rate of the warm start."""
    rl_steps: int = 30
    """Train steps (rollout batches) per method."""
    learning_rate: float = 5e-4
    """Peak AdamW learning rate of the RL policy (and critic)."""
    num_prompts: int = 8
    """P: prompts per rollout batch."""
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 2
    """Room for the answer digit and EOS."""
    seed: int = 0
    """PRNG seed of the model, the warm start and every RL run."""
    out_dir: pathlib.Path | None = pathlib.Path("runs/compare_methods")
    """Where results.md, results.json and rewards.png go (created if missing); None: print the table only."""
    plot: bool = True
    """Write rewards.png into out_dir (needs matplotlib)."""

    def __post_init__(self):
        where = "CompareConfig"
        # `--algorithms grpo,ppo` arrives as one entry: split it, so both spellings mean the same.
        try:
            object.__setattr__(self, "algorithms", algorithms.preset_names(self.algorithms))
        except ValueError as error:
            raise ValueError(f"{where}: `algorithms`: {error}") from None
        for field in (
            "hidden_size",
            "num_layers",
            "sft_steps",
            "rl_steps",
            "num_prompts",
            "group_size",
            "max_new_tokens",
        ):
            _checks.positive_int(where, field, getattr(self, field))
        if self.hidden_size % 4:
            raise ValueError(f"{where}: `hidden_size` must be a multiple of the 4 heads; got {self.hidden_size}.")
        _checks.nonnegative_int(where, "seed", self.seed)
        for field in ("sft_label_noise", "sft_accuracy"):
            _checks.finite_number(where, field, getattr(self, field))
            _checks.in_range(where, field, getattr(self, field), 0.0, 1.0)
        _checks.finite_number(where, "sft_learning_rate", self.sft_learning_rate)
        _checks.positive(where, "sft_learning_rate", self.sft_learning_rate)
        if self.out_dir is not None and self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"{where}: `out_dir` must be a directory; {str(self.out_dir)!r} is a file.")
        if self.plot and self.out_dir is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(f"{where}: `plot` needs matplotlib (pip install matplotlib); or pass --no-plot.")
        train_config = self.train_config()  # validates the RL settings (learning rate, batch shape)
        for method in self.methods():  # methods these settings cannot run
            training.step.check_supported(method, train_config)

    def methods(self) -> list[algorithms.Algorithm]:
        """The presets named by ``algorithms``."""
        return [algorithms.get(name) for name in self.algorithms]

    def train_config(self) -> training.TrainConfig:
        """The settings of each method's RL run."""
        return training.TrainConfig(
            num_prompts=self.num_prompts,
            group_size=self.group_size,
            sampling=SamplingConfig(max_new_tokens=self.max_new_tokens),
            optimizer=OptimizerConfig(learning_rate=self.learning_rate, critic_learning_rate=self.learning_rate),
            seed=self.seed,
            exact_kl=True,
        )  # every method's KL to its start, those without a KL term too


def warm_started_model(config: CompareConfig, task: DigitSumTask) -> tuple[models.Model, models.Params, list[float]]:
    """A random decoder fine-tuned on ``sft_steps`` batches of solved examples."""
    model_config = models.ModelConfig(
        vocab_size=len(task.tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size,
        num_layers=config.num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=config.hidden_size // 4,
        max_position_embeddings=max(32, PROMPT_WIDTH + config.max_new_tokens),
        bos_token_id=task.tokenizer.bos_token_id,
        eos_token_ids=(task.eos_id,),
        pad_token_id=task.pad_id,
    )
    model, params = models.init(model_config, jax.random.key(config.seed))
    demonstrations = task.demonstrations(
        np.random.default_rng(config.seed), 4096, config.max_new_tokens, label_noise=config.sft_label_noise
    )
    params, losses = training.supervised_finetune(
        model,
        params,
        *demonstrations,
        steps=config.sft_steps,
        batch_size=64,
        learning_rate=config.sft_learning_rate,
        seed=config.seed,
        stop=lambda step, p: greedy_accuracy(model, p, task) >= config.sft_accuracy,
    )
    return model, params, losses


def greedy_accuracy(model: models.Model, params: models.Params, task: DigitSumTask) -> float:
    """Fraction of all 100 prompts (the task's test split) answered exactly by greedy
    decoding: the digit, then EOS (the ``stops`` reward, 0.5, is earned by exactly these)."""
    return evaluation.evaluate(
        model,
        params,
        task,
        sampling=SamplingConfig(max_new_tokens=2),
        batch_size=100,
        correct_reward="stops",
        threshold=0.5,
        progress=False,
    )["greedy_accuracy"]


def expected_reward(model: models.Model, params: models.Params, task: DigitSumTask) -> float:
    r"""The policy's exact expected reward over all 100 prompts (temperature 1, no sampling):

    .. math::
        \mathbb{E}[R] = \frac{1}{100}\sum_{a,b} \pi(d \mid a{+}b{=})\,
            \big(1 + \tfrac12\, \pi(\text{EOS} \mid a{+}b{=}d)\big), \quad d = (a+b) \bmod 10
    """
    tokens, attention_mask = _all_solved_examples(task)
    logp = models.completion_logprobs(model, params, tokens, attention_mask, 2)  # [100, 2]
    p_digit, p_eos = np.exp(np.asarray(logp, np.float64)).T
    return float(np.mean(p_digit * (1.0 + 0.5 * p_eos)))


def _all_solved_examples(task: DigitSumTask) -> tuple[np.ndarray, np.ndarray]:
    """``"a+b="`` followed by the right digit and EOS, for all 100 prompts: ``[100, S + 2]`` twice."""
    digits = np.stack(np.meshgrid(np.arange(10), np.arange(10), indexing="ij"), -1).reshape(-1, 2)  # [100, 2]
    encoded = task.tokenizer([f"{a}+{b}=" for a, b in digits], return_tensors="np")
    completion = np.stack([task.answer_ids(digits.sum(1) % 10), np.full(100, task.eos_id)], axis=1)  # [100, 2]
    tokens = np.concatenate([encoded["input_ids"], completion], axis=1)
    attention_mask = np.concatenate([encoded["attention_mask"], np.ones_like(completion)], axis=1)
    return tokens, attention_mask.astype(bool)


def run(
    config: CompareConfig,
    algorithm: algorithms.Algorithm,
    model: models.Model,
    params: models.Params,
    task: DigitSumTask,
) -> dict[str, Any]:
    """Trains one method from the warm start; returns its curve and summary numbers."""
    started = time.perf_counter()
    state, history = training.train(model, params, algorithm, config.train_config(), steps=config.rl_steps, task=task)
    seconds = time.perf_counter() - started
    rewards = np.array([h["reward"] for h in history])
    window = min(WINDOW, len(rewards))
    return {
        "algorithm": algorithm.name,
        "reward_start": float(rewards[:window].mean()),
        "reward_end": float(rewards[-window:].mean()),
        "accuracy_end": greedy_accuracy(model, state.params, task),
        "expected_reward_start": expected_reward(model, params, task),
        "expected_reward_end": expected_reward(model, state.params, task),
        "kl_exact": float(history[-1]["kl_exact"]),
        "seconds": seconds,
        "history": history,
        "state": state,
    }


def summary(result: dict[str, Any], accuracy_start: float) -> dict[str, Any]:
    """One method's row of the table (JSON-ready), with its training reward per step."""
    numbers = (
        "reward_start",
        "reward_end",
        "expected_reward_start",
        "expected_reward_end",
        "accuracy_end",
        "kl_exact",
        "seconds",
    )
    return {
        "algorithm": result["algorithm"],
        "accuracy_start": float(accuracy_start),
        **{key: float(result[key]) for key in numbers},
        "rewards": [float(h["reward"]) for h in result["history"]],
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`summary` as a Markdown table, padded to line up in a terminal too."""
    header = ("method", f"reward first {WINDOW}", f"reward last {WINDOW}", "E[reward]", "greedy acc", "KL(ref)", "time")
    cells = [header] + [
        (
            r["algorithm"],
            f"{r['reward_start']:.3f}",
            f"{r['reward_end']:.3f}",
            f"{r['expected_reward_start']:.3f} -> {r['expected_reward_end']:.3f}",
            f"{r['accuracy_start']:.2f} -> {r['accuracy_end']:.2f}",
            f"{r['kl_exact']:.3f}",
            f"{r['seconds']:.1f}s",
        )
        for r in rows
    ]
    widths = [max(len(row[j]) for row in cells) for j in range(len(header))]

    def line(row):
        padded = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def moving_average(x: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start): ``[S] -> [S]``."""
    x = np.asarray(x, np.float64)
    sums = np.cumsum(np.concatenate([[0.0], x]))  # [S + 1]
    ends = np.arange(1, len(x) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_rewards(rows: Sequence[dict[str, Any]], path: pathlib.Path, *, title: str):
    """Every method's training reward per step, smoothed over ``WINDOW`` steps, saved as one
    PNG; returns the :class:`matplotlib.figure.Figure`."""
    import matplotlib  # optional dependency: imported only to plot
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(figure)  # renders with Agg, whatever pyplot's backend
    ax = figure.add_subplot()
    # Eleven distinct colours (tab20's darker half, then black); dashed lines past eleven methods.
    colors = matplotlib.colormaps["tab20"](np.arange(0, 20, 2)).tolist() + [[0.0, 0.0, 0.0, 1.0]]
    for i, row in enumerate(rows):
        steps = np.arange(1, len(row["rewards"]) + 1)
        ax.plot(
            steps,
            moving_average(row["rewards"], WINDOW),
            color=colors[i % len(colors)],
            linestyle="-" if i < len(colors) else "--",
            linewidth=1.6,
            label=row["algorithm"],
        )
    ax.set(title=title, xlabel="RL step", ylabel=f"training reward, moving average over {WINDOW} steps (max 1.5)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", ncols=2, fontsize="small")
    figure.savefig(path, dpi=120)
    return figure


def write_results(
    out_dir: pathlib.Path,
    config: CompareConfig,
    warm_start: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    interrupted: str | None,
) -> list[pathlib.Path]:
    """``results.md``, ``results.json`` and (with ``config.plot``) ``rewards.png``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = f"P={config.num_prompts} prompts x G={config.group_size} completions, {config.rl_steps} steps"
    table = format_table(rows)
    markdown = (
        f"# compare_methods\n\nWarm start: {warm_start['steps']} SFT steps, greedy accuracy "
        f"{warm_start['greedy_accuracy']:.2f}, expected reward {warm_start['expected_reward']:.3f}. "
        f"RL: {settings} per method, seed {config.seed}.\n\n{table}\n"
    )
    if interrupted:
        markdown += f"\n{interrupted}\n"
    paths = [out_dir / "results.md", out_dir / "results.json"]
    paths[0].write_text(markdown)
    document = {
        "config": {**dataclasses.asdict(config), "out_dir": str(config.out_dir)},
        "warm_start": warm_start,
        "methods": list(rows),
        "interrupted": interrupted,
    }
    paths[1].write_text(json.dumps(document, indent=1) + "\n")
    if config.plot and rows:
        paths.append(out_dir / "rewards.png")
        plot_rewards(rows, paths[-1], title=f"DigitSumTask from one SFT warm start: {settings}")
    return paths


def parse(argv: Sequence[str] | None = None) -> CompareConfig:
    """The config from command-line flags (``--help`` lists them). A bad value ends the
    program with tyro's message and exit status 2, before any compute."""
    return tyro.cli(CompareConfig, args=argv, description=__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    config = parse(argv)
    task = DigitSumTask()
    started = time.perf_counter()
    model, params, losses = warm_started_model(config, task)
    accuracy = greedy_accuracy(model, params, task)
    warm_start = {
        "steps": len(losses),
        "loss_start": float(losses[0]),
        "loss_end": float(np.mean(losses[-20:])),
        "greedy_accuracy": float(accuracy),
        "expected_reward": expected_reward(model, params, task),
        "seconds": time.perf_counter() - started,
    }
    print(
        f"SFT warm start: {len(losses)} steps, loss {warm_start['loss_start']:.2f} -> {warm_start['loss_end']:.2f}, "
        f"greedy accuracy {accuracy:.2f} ({warm_start['seconds']:.1f}s)"
    )
    print(f"RL: P={config.num_prompts} prompts x G={config.group_size} completions, {config.rl_steps} steps per method")
    results, interrupted = [], None
    for method in config.methods():
        try:
            results.append(run(config, method, model, params, task))
        except training.RunInterrupted as stop:  # Ctrl-C: the methods done so far still get their table
            interrupted = f"Interrupted: {method.name} after {len(stop.history)} of {config.rl_steps} steps."
            break
        r = results[-1]
        print(
            f"  {r['algorithm']:<20} reward {r['reward_start']:.3f} -> {r['reward_end']:.3f}  ({r['seconds']:.1f}s)",
            flush=True,
        )
    rows = [summary(r, accuracy) for r in results]
    print()
    if interrupted:
        print(interrupted)
    if rows:
        print(format_table(rows))
    if config.out_dir is not None:
        paths = write_results(config.out_dir, config, warm_start, rows, interrupted)
        print(f"\nwrote {', '.join(map(str, paths))}")
    if interrupted:
        raise SystemExit(130)  # the shell's status for a run ended by SIGINT
    return results


if __name__ == "__main__":
    host.reuse_freed_memory()  # before JAX's first computation
    main()
