"""LoRA rollouts: decode with the adapters unmerged, or merge them once per rollout and decode the plain model.

A LoRA model computes ``x W + s (x A) B`` at every projection of every decode step;
``lora.merge`` folds ``W + s A B`` into a copy of the targeted kernels once, after which the
rollout decodes a plain model. For one rollout (``sampling.sample``, greedy, fixed key,
float32 base, rank ``--rank`` on all seven linear layers) the table times:

- ``base``: the model without adapters, the floor;
- ``unmerged``: the LoRA model on ``lora.combine(base, adapters)``;
- ``merged f32``: ``lora.merge`` (jitted once, outside the timing; the call and its
  ``block_until_ready`` are timed) into float32 kernels, then the plain model's rollout;
- ``merged bf16``: the same with ``dtype=bfloat16`` kernels (the matmuls still run in the
  model's float32: the kernels are upcast at every step).

The merge column gives the merge's own share; the eager ``lora.merge`` (op by op, no jit,
float32) is timed in the same rounds, on its own. The adapters' ``B`` is drawn
normal(0.02) instead of PEFT's zeros, as after training, so the adapted policy decodes
other tokens than the base. Tokens/s counts rows x new tokens: EOS is the last id, and
every rollout runs every step (checked). The methods are interleaved (one call of each per
round) after one untimed call each (compilation excluded); medians. The line under each
shape gives the fraction of completion tokens equal to the unmerged rollout's: 100% when
merging changes no greedy choice (float rounding could flip a near tie; bfloat16 kernels do).

    python benchmarks/lora_decode.py [--shapes tiny,qwen05b] [--repeats N] [--rank 16]

Shapes: ``tiny`` (``grpo_step.CONFIG``: 4 layers, d_model 256, vocab 512), 8 prompts x 4
samples, 64 new tokens, 15 repeats; ``qwen05b`` (``layer_scan.qwen25_05b()``: 24 layers,
d_model 896, vocab 151,936, tied), 2 prompts x 2 samples, 32 new tokens, 5 repeats.
Prompts are 16 random tokens. The default run takes about 5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from grpo_step import CONFIG
from layer_scan import qwen25_05b

from jaxrl_llm import models, sampling
from jaxrl_llm.models import lora

SHAPES = {  # name -> (config, prompts, samples per prompt, new tokens, default repeats)
    "tiny": (CONFIG, 8, 4, 64, 15),
    "qwen05b": (qwen25_05b(), 2, 2, 32, 5),
}
PROMPT_LEN = 16


class Workload(NamedTuple):
    """One rollout's inputs: the base model and params, the LoRA model and its params
    (base and adapters), ``[P, S]`` prompts and mask, and the sampling budget."""

    model: models.Model
    base: models.Params
    lora_model: models.Model
    params: models.Params
    prompts: jax.Array  # [P, S] int32
    mask: jax.Array  # [P, S] bool
    samples: int
    new_tokens: int
    eos: int


def trained_adapters(adapters: models.Params, key: jax.Array, *, std: float = 0.02) -> models.Params:
    """``adapters`` with every ``B`` (PEFT's zeros at initialisation) drawn normal(``std``), as
    after some training; the ``A``s unchanged."""
    flat = nnx.to_flat_state(adapters)
    keys = iter(jax.random.split(key, len(flat)))

    def drawn(path, leaf):
        key = next(keys)
        if not path[-1].endswith("_lora_b"):
            return leaf
        value = leaf.get_value()
        return leaf.replace((std * jax.random.normal(key, value.shape, jnp.float32)).astype(value.dtype))

    return nnx.from_flat_state({path: drawn(path, leaf) for path, leaf in flat})


def workload(
    config: models.ModelConfig,
    *,
    prompts: int,
    samples: int,
    new_tokens: int,
    rank: int,
    prompt_len: int = PROMPT_LEN,
    adapter_std: float = 0.02,
) -> Workload:
    """A float32 base (``config``) with rank-``rank`` adapters on all linear layers (``B``
    normal(``adapter_std``)) and ``[prompts, prompt_len]`` random prompts."""
    model, base = models.init(config, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=rank), jax.random.key(1))
    params = lora.combine(base, trained_adapters(adapters, jax.random.key(2), std=adapter_std))
    eos = config.vocab_size - 1
    tokens = np.random.default_rng(0).integers(0, eos, size=(prompts, prompt_len))
    return Workload(
        model, base, lora_model, params, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, bool),
        samples, new_tokens, eos,
    )  # fmt: skip


def decode(work: Workload, model: models.Model, params: models.Params) -> sampling.Rollout:
    """One greedy rollout of ``work``'s prompts (``P x G`` rows, ``N`` new tokens), fixed key."""
    return sampling.sample(
        model,
        params,
        work.prompts,
        work.mask,
        jax.random.key(3),
        num_samples=work.samples,
        max_new_tokens=work.new_tokens,
        temperature=0.0,
        eos_ids=(work.eos,),
        pad_id=0,
    )


def merger(work: Workload, *, dtype=None) -> Callable[[models.Params], models.Params]:
    """``params -> merged params`` (``lora.merge`` into ``dtype`` kernels; ``None``: the
    base's), jitted: what a caller merging once per rollout runs."""
    return jax.jit(lambda params: lora.merge(work.lora_model, params, dtype=dtype)[1])


def methods(work: Workload) -> dict[str, Callable[[], tuple[sampling.Rollout, float]]]:
    """The compared rollouts: name -> ``() -> (rollout, merge seconds)``, each waited for."""
    plain = lora.base_model(work.lora_model)

    def direct(model, params):
        def run():
            return jax.block_until_ready(decode(work, model, params)), 0.0

        return run

    def merged(merge):
        def run():
            start = time.perf_counter()
            params = jax.block_until_ready(merge(work.params))
            seconds = time.perf_counter() - start
            return jax.block_until_ready(decode(work, plain, params)), seconds

        return run

    return {
        "base": direct(work.model, work.base),
        "unmerged": direct(work.lora_model, work.params),
        "merged f32": merged(merger(work)),
        "merged bf16": merged(merger(work, dtype=jnp.bfloat16)),
    }


def agreement(reference: sampling.Rollout, other: sampling.Rollout) -> float:
    """Fraction of the ``[B, N]`` completion tokens of ``other`` equal to ``reference``'s."""
    return float(np.mean(np.asarray(reference.completion_tokens) == np.asarray(other.completion_tokens)))


def measure(
    work: Workload, *, repeats: int
) -> tuple[dict[str, tuple[float, float]], float, dict[str, sampling.Rollout]]:
    """Median ``(total seconds, merge seconds)`` of each method and median seconds of the eager
    ``lora.merge`` (called as it is, op by op), over ``repeats`` interleaved rounds after one
    untimed call each; and each method's (warm-up) rollout."""
    runs = methods(work)

    def eager_merge():
        start = time.perf_counter()
        jax.block_until_ready(lora.merge(work.lora_model, work.params)[1])
        return time.perf_counter() - start

    rollouts = {name: run()[0] for name, run in runs.items()}  # compiles
    eager_merge()
    times, eager = {name: [] for name in runs}, []
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            rollout, merge_s = run()
            times[name].append((time.perf_counter() - start, merge_s))
            assert int(rollout.lengths.max()) == work.new_tokens  # the loop ran every step
        eager.append(eager_merge())
    medians = {name: tuple(np.median(np.array(t), axis=0).tolist()) for name, t in times.items()}
    return medians, float(np.median(eager)), rollouts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,qwen05b", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per method (default: 15 tiny, 5 qwen05b)"
    )
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} devices), float32 base, "
        f"LoRA rank {args.rank} on all linear layers, greedy, prompt {PROMPT_LEN}"
    )
    header = (
        f"{'shape':<8} {'batch':>6} {'new':>4} {'method':<12} {'median s':>9} {'merge s':>8} {'tokens/s':>9} "
        f"{'x base':>7}"
    )
    for name in shapes:
        config, prompts, samples, new_tokens, repeats = SHAPES[name]
        repeats = args.repeats or repeats
        work = workload(config, prompts=prompts, samples=samples, new_tokens=new_tokens, rank=args.rank)
        medians, eager, rollouts = measure(work, repeats=repeats)
        print()
        print(header)
        print("-" * len(header))
        tokens = prompts * samples * new_tokens
        for method, (seconds, merge_s) in medians.items():
            merge = f"{merge_s:>8.3f}" if method.startswith("merged") else f"{'':>8}"
            print(
                f"{name:<8} {f'{prompts}x{samples}':>6} {new_tokens:>4} {method:<12} {seconds:>9.3f} {merge} "
                f"{tokens / seconds:>9.1f} {seconds / medians['base'][0]:>6.2f}x"
            )
        same = {m: agreement(rollouts["unmerged"], rollouts[m]) for m in ("merged f32", "merged bf16", "base")}
        print(
            f"medians of {repeats}; eager lora.merge (no jit): {eager:.3f} s. Completion tokens equal to unmerged: "
            + ", ".join(f"{m} {fraction:.1%}" for m, fraction in same.items())
        )


if __name__ == "__main__":
    main()
