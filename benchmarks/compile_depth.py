r"""Compile time against depth, layers unrolled or scanned (``ModelConfig.scan_layers``),
for the three programs a training step compiles:

- ``sampler``: the rollout, :func:`jaxrl_llm.sampling.sample` under ``jit`` (its jitted program):
  prefill of ``P`` prompts, the cache copied to ``G`` rows each, the decoding loop;
- ``logprobs``: :func:`jaxrl_llm.models.completion_logprobs` of ``B = P * G`` rows, the
  prompt run once per group (``group_size = G``);
- ``loss+grad``: ``value_and_grad`` of ``benchmarks/layer_scan.py``'s GRPO-like loss
  through the same log-prob pass.

Each is lowered and compiled with abstract params (``jax.ShapeDtypeStruct`` leaves: no
weights in memory, nothing run), JAX's persistent compilation cache off. ``lower`` is
tracing and lowering to StableHLO, ``compile`` XLA's compilation. Default widths are
Qwen2.5-0.5B's (``--tiny``: toy widths, the same structure).

    python benchmarks/compile_depth.py [--depths 2,8,24,28] [--programs sampler,logprobs,loss+grad]
                                       [--prompts 4] [--group-size 4] [--prompt-len 64] [--completion-len 128]
                                       [--repeats 1] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
from layer_scan import batch, grpo_like_loss, persistent_cache_off, qwen25_05b

from jaxrl_llm import models, sampling

PROGRAMS = ("sampler", "logprobs", "loss+grad")


def lowered(
    program: str, model: models.Model, params, *, prompts: int, group_size: int, prompt_len: int, completion_len: int
):
    """``program`` of ``model`` lowered for ``params`` (abstract or not)."""
    rows = prompts * group_size
    tokens, mask, advantages = batch(
        model.config, rows=rows, prompt_len=prompt_len, completion_len=completion_len, group_size=group_size
    )
    if program == "sampler":
        # sampling.sample traced under jit: its jitted rollout program, inlined.
        def rollout(params, prompt_tokens, prompt_mask, key):
            return sampling.sample(
                model,
                params,
                prompt_tokens,
                prompt_mask,
                key,
                num_samples=group_size,
                max_new_tokens=completion_len,
                eos_ids=(0,),
                pad_id=0,
                bucket=1,
            )

        return jax.jit(rollout).lower(
            params, tokens[::group_size, :prompt_len], mask[::group_size, :prompt_len], jax.random.key(0)
        )
    if program == "logprobs":

        def logprobs(params, tokens, mask):
            return models.completion_logprobs(model, params, tokens, mask, completion_len, group_size=group_size)

        return jax.jit(logprobs).lower(params, tokens, mask)

    def loss(params, tokens, mask, advantages):
        return grpo_like_loss(
            model, params, tokens, mask, advantages, completion_len=completion_len, group_size=group_size
        )

    return jax.jit(jax.value_and_grad(loss)).lower(params, tokens, mask, advantages)


def measure(program: str, model: models.Model, params, *, repeats: int, **shapes) -> dict[str, float]:
    """Seconds to lower and to compile ``program``, each the least of ``repeats`` tries
    (a compilation is not cached across lowerings, nor persistently here)."""
    row = dict(lower=float("inf"), compile=float("inf"))
    for _ in range(repeats):
        start = time.perf_counter()
        lowering = lowered(program, model, params, **shapes)
        lowered_at = time.perf_counter()
        lowering.compile()
        row = dict(
            lower=min(row["lower"], lowered_at - start), compile=min(row["compile"], time.perf_counter() - lowered_at)
        )
    return row


def main(argv=None) -> dict[tuple[str, int, bool], dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="2,8,24,28", help="comma-separated layer counts")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="compile each this many times, keep the least")
    parser.add_argument("--tiny", action="store_true", help="toy widths (a smoke test of the script)")
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    programs = args.programs.split(",")
    if unknown := set(programs) - set(PROGRAMS):
        parser.error(f"unknown programs {sorted(unknown)}; choose from {', '.join(PROGRAMS)}")
    shapes = dict(
        prompts=args.prompts, group_size=args.group_size, prompt_len=args.prompt_len, completion_len=args.completion_len
    )

    c = qwen25_05b(tiny=args.tiny)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {c.architecture}, d_model {c.hidden_size}, "
        f"{c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, MLP {c.intermediate_size}, vocab {c.vocab_size}, "
        f"float32, abstract params"
    )
    print(
        f"{args.prompts} prompts x {args.group_size} completions, {args.prompt_len} + {args.completion_len} "
        f"tokens; seconds to lower / compile (least of {args.repeats})\n"
    )
    print("| program | layers | unrolled: lower | compile | scan: lower | compile |")
    print("|---" * 6 + "|")
    results = {}
    with persistent_cache_off():
        for program in programs:
            for depth in depths:
                cells = []
                for scan in (False, True):  # the layers' layout: one subtree per layer, or stacked [L, ...]
                    model, params = models.abstract(
                        dataclasses.replace(qwen25_05b(depth, tiny=args.tiny), scan_layers=scan)
                    )
                    row = measure(program, model, params, repeats=args.repeats, **shapes)
                    results[program, depth, scan] = row
                    cells += [f"{row['lower']:.2f}", f"{row['compile']:.2f}"]
                print(f"| {program} | {depth} | {' | '.join(cells)} |", flush=True)
    return results


if __name__ == "__main__":
    main()
