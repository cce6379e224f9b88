r"""What the train step's update program is made of, and what it costs to build.

The update (:func:`jaxrl_llm.training.step.update`: the loss, its gradient, the optimizer
step and its finiteness check, the metrics) is the largest program a run compiles, and the
one most of the test suite's time goes to. For each method asked for, on a small decoder
(two layers unless ``--layers``), this prints:

- ``trace``, ``lower``, ``compile``: seconds to trace it to a jaxpr, lower it to StableHLO
  and compile it (XLA on this backend, JAX's persistent cache off);
- ``equations``: the jaxpr's equations (inside loops and conditionals counted once), and
  how many of them each part of the code writes, by the innermost frame of
  :mod:`jaxrl_llm` or optax that the equation was traced from:
  ``optimizer`` (optax, ``training/optim.py``), ``model`` (``models/``), ``loss`` (the
  rest of :mod:`jaxrl_llm`: the objective, log-probs, advantages, metrics), ``other``
  (JAX's own, e.g. PRNG and autodiff bookkeeping).

    python benchmarks/update_program.py [--methods grpo,ppo,trpo] [--layers 2] [--scan-layers]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import jax
import jax.numpy as jnp
from jax import extend
from layer_scan import persistent_cache_off

from jaxrl_llm import algorithms, models, training
from jaxrl_llm.tasks import DigitSumTask
from jaxrl_llm.training import step

PARTS = ("optimizer", "model", "loss", "other")


def part_of(equation) -> str:
    """Which part of the code wrote ``equation`` (see the module docstring)."""
    traceback = equation.source_info.traceback
    frames = [] if traceback is None else traceback.frames
    for frame in frames:  # innermost first
        path = frame.file_name.replace("\\", "/")
        if "/optax/" in path or path.endswith("jaxrl_llm/training/optim.py"):
            return "optimizer"
        if "/jaxrl_llm/models/" in path:
            return "model"
        if "/jaxrl_llm/" in path:
            return "loss"
    return "other"


def count_parts(jaxpr: extend.core.Jaxpr) -> Counter:
    """Equations of ``jaxpr`` by part; an equation holding jaxprs (a loop, a conditional, a
    custom rule) counts as the equations inside them."""
    counts = Counter()
    for equation in jaxpr.eqns:
        inner = [
            sub
            for value in equation.params.values()
            for sub in (value if isinstance(value, tuple | list) else (value,))
            if isinstance(sub, extend.core.ClosedJaxpr | extend.core.Jaxpr)
        ]
        if inner:
            for sub in inner:
                counts += count_parts(sub.jaxpr if isinstance(sub, extend.core.ClosedJaxpr) else sub)
        else:
            counts[part_of(equation)] += 1
    return counts


def update_inputs(model: models.Model, params, method: algorithms.Algorithm, config: training.TrainConfig):
    """The update of ``method`` and its arguments: a train state, its fixed params and a
    scored batch (abstract: shapes only) of ``config``'s size, 8-token prompts and
    ``max_new_tokens`` completions."""
    state = training.init_state(model, params, method, config)
    fixed = training.fixed_params(params, method, config)
    train_step = step.make_train_step(model, method, config, total_steps=10)
    rows = config.num_prompts * config.group_size
    new_tokens = config.sampling.max_new_tokens
    batch = training.Batch(
        prompt_tokens=jnp.ones((config.num_prompts, 8), jnp.int32),
        prompt_mask=jnp.ones((config.num_prompts, 8), bool),
        completion_tokens=jnp.ones((rows, new_tokens), jnp.int32),
        completion_mask=jnp.ones((rows, new_tokens), bool),
        sampling_logp=jnp.zeros((rows, new_tokens)),
        rewards=jnp.linspace(0.0, 1.0, rows),
        prompts_drawn=jnp.asarray(config.num_prompts, jnp.int32),
    )
    scored, _ = jax.eval_shape(train_step.score, state, fixed, batch)
    return train_step.update, (state, fixed, scored)


def measure(name: str, *, layers: int, scan_layers: bool) -> dict[str, float]:
    """The update program of method ``name``: its build times and its equations by part."""
    task = DigitSumTask()
    config = models.ModelConfig(
        vocab_size=len(task.tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        scan_layers=scan_layers,
    )
    model, params = models.init(config, jax.random.key(0))
    run = training.TrainConfig(num_prompts=4, group_size=4)
    update, arguments = update_inputs(model, params, algorithms.get(name), run)
    started = time.perf_counter()
    traced = jax.jit(update).trace(*arguments)
    trace_seconds = time.perf_counter() - started
    started = time.perf_counter()
    lowered = traced.lower()
    lower_seconds = time.perf_counter() - started
    started = time.perf_counter()
    lowered.compile()
    compile_seconds = time.perf_counter() - started
    parts = count_parts(traced.jaxpr.jaxpr)
    return dict(
        trace=trace_seconds,
        lower=lower_seconds,
        compile=compile_seconds,
        equations=sum(parts.values()),
        **{part: parts[part] for part in PARTS},
    )


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="grpo,ppo,trpo", help="presets, comma-separated")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--scan-layers", action="store_true", help="the layers stacked (ModelConfig.scan_layers)")
    args = parser.parse_args(argv)
    results = {}
    with persistent_cache_off():
        for name in args.methods.split(","):
            results[name] = measure(name, layers=args.layers, scan_layers=args.scan_layers)
    layout = "stacked" if args.scan_layers else "unrolled"
    print(f"update program, {args.layers} layers {layout}, {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print("| method | trace s | lower s | compile s | equations | " + " | ".join(PARTS) + " |")
    print("|---" * (5 + len(PARTS)) + "|")
    for name, row in results.items():
        times = " | ".join(f"{row[phase]:.2f}" for phase in ("trace", "lower", "compile"))
        shares = " | ".join(f"{row[part]} ({row[part] / row['equations']:.0%})" for part in PARTS)
        print(f"| {name} | {times} | {row['equations']} | {shares} |")
    return results


if __name__ == "__main__":
    main()
