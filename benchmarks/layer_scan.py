r"""Compile time, step time and peak memory of the loss-and-gradient program, with the
decoder's layers unrolled or scanned (``ModelConfig.scan_layers``), and rematerialised.

The program is ``jax.jit(jax.value_and_grad(loss))`` of a GRPO-like token loss over
the completion's log-probs (:func:`jaxrl_llm.models.completion_logprobs`, chunked over
the vocabulary):

.. math::
    L(\theta) = -\frac{1}{\sum_t m_t} \sum_t m_t \exp\big(\log\pi_t - \operatorname{sg}(\log\pi_t)\big) A_t

on a Qwen2.5-0.5B-shaped model with random weights: 24 layers, d_model 896, 14 query and
2 key-value heads of 64, MLP 4864, vocabulary 151936, tied embeddings, q/k/v biases,
float32. The batch is ``--rows`` rows of ``--prompt-len`` left-padded prompt tokens and
``--completion-len`` completion tokens.

Columns: ``lower`` (tracing and lowering to StableHLO) and ``compile`` (XLA) are timed
separately on ``.lower(...)`` and ``.compile()``, with JAX's persistent compilation
cache off; ``step`` is the median of ``--repeats`` calls after a warm-up call;
``temp`` and ``peak`` are XLA's account of the compiled program
(``compiled.memory_analysis()``: temporaries, and temporaries + arguments + outputs -
aliased). ``|dg|`` is the largest difference of a gradient from the unrolled program's,
relative to that gradient's largest entry, over the first and last layers' weights and
the final norm (kept to compare; all of them would be 2 GB more): float32 rounding, the
programs compute the same function. ``--compile-only`` skips the runs (abstract params,
so no weights in memory either): compile time and memory at shapes too long to run here.

What to expect on XLA's CPU backend: it compiles the identical layers of an unrolled
model once, so the scan saves tracing time, not compile time; the scan's stacked copies
of the layer weights and of their gradients cost about twice the layer weights' bytes;
remat lowers the peak only in the scan (the unrolled program recomputes, but its peak
does not move). At long sequences scan + remat is the lowest peak by far.

    python benchmarks/layer_scan.py [--layers 24] [--rows 8] [--prompt-len 32] [--completion-len 64]
                                    [--repeats 3] [--remat full] [--group-size 1] [--compile-only]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from timing import median_seconds

from jaxrl_llm import models
from jaxrl_llm.models.decoder import unstack_layers


def qwen25_05b(num_layers: int = 24, *, tiny: bool = False) -> models.ModelConfig:
    """Qwen2.5-0.5B's shape (``tiny``: the same structure at toy widths, for smoke tests)."""
    if tiny:
        return models.ModelConfig(
            architecture="qwen2",
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_layers=num_layers,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            attention_bias=True,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        )
    return models.ModelConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=num_layers,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope=models.RopeConfig(theta=1e6),
    )


def grpo_like_loss(
    model: models.Model,
    params: models.Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    advantages: jax.Array,
    *,
    completion_len: int,
    group_size: int,
) -> jax.Array:
    """The scalar loss above: tokens, attention_mask ``[B, S + N]``, advantages ``[B]``."""
    logp = models.completion_logprobs(
        model, params, tokens, attention_mask, completion_len, group_size=group_size
    )  # [B, N]
    mask = attention_mask[:, -completion_len:].astype(jnp.float32)  # [B, N]
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    return -jnp.sum(ratio * advantages[:, None] * mask) / jnp.sum(mask)


def batch(
    config: models.ModelConfig, *, rows: int, prompt_len: int, completion_len: int, group_size: int, seed: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random ids with left-padded prompts (row ``b``'s prompt has ``prompt_len - b % 4``
    real tokens; ``group_size`` consecutive rows share one), and random advantages."""
    keys = jax.random.split(jax.random.key(seed), 3)
    prompts = jax.random.randint(keys[0], (rows // group_size, prompt_len), 0, config.vocab_size)
    completions = jax.random.randint(keys[1], (rows, completion_len), 0, config.vocab_size)
    tokens = jnp.concatenate([jnp.repeat(prompts, group_size, axis=0), completions], axis=1)  # [B, S + N]
    padding = jnp.repeat(jnp.arange(rows // group_size) % 4, group_size)[:, None]  # [B, 1]
    mask = jnp.arange(prompt_len + completion_len)[None, :] >= padding  # [B, S + N]
    return tokens, mask, jax.random.normal(keys[2], (rows,))


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache off, and back as it was on exit (JAX opens the
    cache once per process, so each switch resets it)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        jax_cache.reset_cache()


def compared_leaves(grads, num_layers: int) -> dict[str, jax.Array]:
    """The gradients ``|dg|`` is computed over, by path: first and last layer, final norm."""
    kept = ("['layers'][0]", f"['layers'][{num_layers - 1}]", "['norm']")
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
        if jax.tree_util.keystr(path).startswith(kept)
    }


def measure(model: models.Model, params, inputs, *, completion_len: int, group_size: int, repeats: int):
    """Lower and compile (timed) the value-and-gradient program of ``model``; then, unless
    ``repeats`` is 0, time it and return its value and gradients (else ``None``)."""

    def loss(params, tokens, mask, advantages):
        return grpo_like_loss(
            model, params, tokens, mask, advantages, completion_len=completion_len, group_size=group_size
        )

    program = jax.jit(jax.value_and_grad(loss))
    start = time.perf_counter()
    lowered = program.lower(params, *inputs)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    row = dict(lower=lowered_at - start, compile=compiled_at - lowered_at)
    memory = compiled.memory_analysis()
    if memory is not None:
        row["temp"] = memory.temp_size_in_bytes
        row["peak"] = (
            memory.temp_size_in_bytes
            + memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
        )
    if not repeats:
        return row, None
    row["step"] = median_seconds(compiled, params, *inputs, repeats=repeats)
    return row, compiled(params, *inputs)


def main(argv=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="rows per shared prompt (> 1: the prompt-sharing pass, its KV cache scanned too)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--remat",
        choices=("full", "dots", "none"),
        default="full",
        help="the policy of the two remat rows ('none': no remat rows)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile time and memory only (abstract params: no weights in memory, no step)",
    )
    parser.add_argument("--tiny", action="store_true", help="toy widths (a smoke test of the script)")
    args = parser.parse_args(argv)

    config = qwen25_05b(args.layers, tiny=args.tiny)
    model, params = (models.abstract if args.compile_only else lambda c: models.init(c, jax.random.key(0)))(config)
    inputs = batch(
        config,
        rows=args.rows,
        prompt_len=args.prompt_len,
        completion_len=args.completion_len,
        group_size=args.group_size,
    )
    # The layers' layout (scan_layers, with its own params) and the execution options.
    variants = {"unrolled": dict(scan_layers=False), "scan": dict(scan_layers=True)}
    if args.remat != "none":
        variants.update(
            {
                f"unrolled, remat {args.remat}": dict(scan_layers=False, remat=args.remat),
                f"scan, remat {args.remat}": dict(scan_layers=True, remat=args.remat),
            }
        )

    c = config
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {c.architecture} {c.num_layers} layers, d_model "
        f"{c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, MLP {c.intermediate_size}, "
        f"vocab {c.vocab_size}, {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M params, float32"
    )
    steps = "compile only" if args.compile_only else f"step: median of {args.repeats}"
    print(
        f"loss and gradient of {args.rows} rows x ({args.prompt_len} + {args.completion_len}) tokens, "
        f"group_size {args.group_size}; {steps}\n"
    )
    header = "| layers | remat | lower (s) | compile (s) | step (s) | temp (MiB) | peak (MiB) | \\|dg\\| |"
    print(header)
    print("|---" * 8 + "|")
    results: dict[str, dict] = {}
    reference = None
    with persistent_cache_off():
        for name, options in variants.items():
            options = dict(options)
            layout_model, layout_params = models.with_scan_layers(model, params, options.pop("scan_layers"))
            row, outputs = measure(
                models.with_options(layout_model, **options),
                layout_params,
                inputs,
                completion_len=args.completion_len,
                group_size=args.group_size,
                repeats=0 if args.compile_only else args.repeats,
            )
            if outputs is not None:
                value, grads = float(outputs[0]), compared_leaves(unstack_layers(outputs[1]), config.num_layers)
                del outputs
                reference = reference or (value, grads)
                row["dg"] = max(
                    float(jnp.max(jnp.abs(grads[k] - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
                    for k, r in reference[1].items()
                )
                assert np.isclose(value, reference[0], rtol=1e-4, atol=1e-6), (value, reference[0])
            results[name] = row
            cells = {k: f"{row[k] / 2**20:,.0f}" if k in row else "n/a" for k in ("temp", "peak")}
            cells.update(
                step=f"{row['step']:.3f}" if "step" in row else "-", dg=f"{row['dg']:.1e}" if "dg" in row else "-"
            )
            layout, _, remat = name.partition(", ")
            print(
                f"| {layout} | {remat or 'no remat'} | {row['lower']:.2f} | {row['compile']:.2f} | {cells['step']} | "
                f"{cells['temp']} | {cells['peak']} | {cells['dg']} |",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
