"""Sampler throughput: jaxrl_llm.sampling against transformers' generate (PyTorch, CPU).

Both generate from the same weights (ours exported with ``save_pretrained`` and loaded
by transformers), for the same batch, prompt length and completion length, sampling at
temperature 1 with the KV cache on. Both decode the whole batch until every row has
finished or the budget is spent; EOS is a token the random model rarely draws, so both
run all ``--new-tokens`` steps on all rows, and tokens/s counts batch x steps.
Compilation is excluded (one warm-up call each); the table shows the median of
``--repeats`` timed calls.

    python benchmarks/sampler.py [--prompts 8] [--group 4] [--prompt-len 16] [--new-tokens 32]

Two models: ``tiny`` (2 layers, d_model 64), where per-step overhead dominates, and
``train-bench`` (the training benchmark's 4 layers, d_model 256), where the matmuls do.
Ours runs twice: layers unrolled (the default) and scanned (``scan_layers``: stacked
weights and cache, one layer's slices per scan step).
"""

from __future__ import annotations

import argparse
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from timing import median_seconds

from jaxrl_llm import models, sampling

transformers.logging.disable_progress_bar()  # "Loading weights" bars would break the table

CONFIGS = {
    "tiny": models.ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    # The training benchmark's model: 4 layers, d_model 256, 4 heads of 64, MLP 1024, vocab 512.
    "train-bench": models.ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
    ),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}"
    )
    batch = args.prompts * args.group
    print(
        f"batch {args.prompts} prompts x {args.group} = {batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, float32, temperature 1"
    )
    header = f"{'model':<12} {'sampler':<34} {'median s':>9} {'tokens/s':>10} {'vs generate':>12}"
    print(header)
    print("-" * len(header))
    for name, config in CONFIGS.items():
        ours_s, scanned_s, theirs_s = compare(config, args)
        tokens_out = batch * args.new_tokens
        for sampler, seconds in (
            ("jaxrl_llm.sampling.sample", ours_s),
            ("jaxrl_llm, scan_layers", scanned_s),
            ("transformers generate", theirs_s),
        ):
            print(
                f"{name:<12} {sampler:<34} {seconds:>9.4f} {tokens_out / seconds:>10.0f} {theirs_s / seconds:>11.2f}x"
            )


def compare(config: models.ModelConfig, args) -> tuple[float, float, float]:
    """Median seconds of one batch for (ours, ours with scanned layers, transformers) on
    the same weights."""
    model, params = models.init(config, jax.random.key(0))
    eos = config.vocab_size - 1
    with tempfile.TemporaryDirectory() as directory:
        models.save_pretrained(directory, model, params)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()

    rng = np.random.default_rng(0)
    prompts = rng.integers(0, eos, size=(args.prompts, args.prompt_len))
    mask = np.ones_like(prompts)
    batch = args.prompts * args.group
    keys = iter(jax.random.split(jax.random.key(1), 2 * (args.repeats + 1)))

    def ours(model=model, params=params):
        rollout = sampling.sample(
            model,
            params,
            jnp.asarray(prompts),
            jnp.asarray(mask),
            next(keys),
            num_samples=args.group,
            max_new_tokens=args.new_tokens,
            eos_ids=(eos,),
            pad_id=0,
        )
        jax.block_until_ready(rollout)
        assert int(rollout.lengths.max()) == args.new_tokens  # the loop ran every step

    hf_inputs = torch.tensor(np.repeat(prompts, args.group, axis=0))
    hf_mask = torch.ones_like(hf_inputs)

    def theirs():
        with torch.no_grad():
            out = hf_model.generate(
                input_ids=hf_inputs,
                attention_mask=hf_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                eos_token_id=eos,
                pad_token_id=0,
                use_cache=True,
            )
        assert out.shape == (batch, args.prompt_len + args.new_tokens)

    scanned_model, scanned_params = models.with_scan_layers(model, params, True)
    scanned = functools.partial(ours, model=scanned_model, params=scanned_params)
    return tuple(median_seconds(fn, repeats=args.repeats) for fn in (ours, scanned, theirs))


if __name__ == "__main__":
    main()
