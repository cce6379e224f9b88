"""Cost of the functional core: each preset's policy loss and gradient, and log-probs.

The loss math should be noise next to the model's forward and backward passes. This
prints, for every preset, the median time of a jitted ``value_and_grad`` of
``algorithms.policy_loss`` on ``[B, T]`` log-probs, and the time of
``ops.token_logprobs`` (+ gradient) at a real vocabulary size.

    python benchmarks/core_ops.py [--batch 64] [--length 1024] [--vocab 32000]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import median_seconds

from jaxrl_llm import algorithms, ops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logprob-batch", type=int, default=4)
    args = parser.parse_args(argv)
    batch, length = args.batch, args.length
    keys = jax.random.split(jax.random.key(0), 5)
    logp = -jax.random.exponential(keys[0], (batch, length))
    old_logp = logp + 0.1 * jax.random.normal(keys[1], (batch, length))
    ref_logp = logp + 0.1 * jax.random.normal(keys[2], (batch, length))
    advantages = jax.random.normal(keys[3], (batch,))
    lengths = jax.random.randint(keys[4], (batch,), 1, length + 1)
    mask = (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.float32)
    tokens = int(mask.sum())

    print(f"devices: {jax.devices()}")
    print(f"policy loss + gradient, B={batch}, T={length} ({tokens} valid tokens), float32")
    header = f"{'preset':<20} {'median ms':>10} {'Mtokens/s':>10}"
    print(header)
    print("-" * len(header))
    for name, method in algorithms.PRESETS.items():

        def loss(lp, method=method):
            return algorithms.policy_loss(method, lp, old_logp, advantages, mask, ref_logp=ref_logp, max_len=length)

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        seconds = median_seconds(step, logp)
        print(f"{name:<20} {seconds * 1e3:>10.2f} {tokens / seconds / 1e6:>10.1f}")

    b, v = args.logprob_batch, args.vocab
    logits = jax.random.normal(keys[0], (b, length, v), jnp.bfloat16)
    ids = jax.random.randint(keys[1], (b, length), 0, v)
    grad_fn = jax.jit(jax.value_and_grad(lambda z: jnp.sum(ops.token_logprobs(z, ids))))
    fwd = jax.jit(ops.token_logprobs)
    print()
    print(f"token_logprobs, logits [{b}, {length}, {v}] bfloat16")
    print(header.replace("preset", "op"))
    print("-" * len(header))
    for label, fn in (("forward", fwd), ("forward+backward", grad_fn)):
        seconds = (
            median_seconds(fn, logits, ids, repeats=5) if label == "forward" else median_seconds(fn, logits, repeats=5)
        )
        print(f"{label:<20} {seconds * 1e3:>10.2f} {b * length / seconds / 1e6:>10.2f}")

    # From hidden states: full logits vs chunks of 256 tokens, forward + backward.
    width = 256
    hidden = jax.random.normal(keys[2], (b, length, width), jnp.bfloat16)
    kernel = jax.random.normal(keys[3], (width, v), jnp.bfloat16) * 0.05

    def full(h, w):
        return jnp.sum(ops.token_logprobs(jnp.matmul(h, w, preferred_element_type=jnp.float32), ids))

    def chunked(h, w):
        return jnp.sum(ops.chunked_token_logprobs(h, w, ids, chunk_size=256))

    print()
    print(f"log-probs from hidden [{b}, {length}, {width}] and kernel [{width}, {v}] bfloat16, forward+backward")
    head = f"{'path':<20} {'median ms':>10} {'temp MB':>10}"
    print(head)
    print("-" * len(head))
    for label, loss in (("full logits", full), ("chunked (256)", chunked)):
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        temp = step.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes / 2**20
        print(f"{label:<20} {median_seconds(step, hidden, kernel, repeats=5) * 1e3:>10.2f} {temp:>10.1f}")


if __name__ == "__main__":
    main()
