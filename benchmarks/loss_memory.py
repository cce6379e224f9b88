r"""Peak memory of the GRPO loss and its gradient: chunked log-probs against full logits.

At a real vocabulary the log-probs of a batch's tokens are the largest thing the update
computes: ``[T, V]`` float32 logits, and as much again for their gradient. The library
computes them from the last hidden states ``chunk_size`` tokens at a time
(:func:`jaxrl_llm.ops.chunked_token_logprobs`, a rematerialised ``lax.scan``), so no
step holds more than ``[chunk_size, V]``. This compiles, in one run, the GRPO-like loss

.. math::
    L(h, W) = -\frac{1}{T} \sum_t \exp\big(\log\pi_t - \operatorname{sg}(\log\pi_t)\big) A_t,
    \qquad \log\pi_t = \log\operatorname{softmax}(h_t W)_{a_t}

and its gradient with respect to the hidden states ``h [T, E]`` and the output kernel
``W [E, V]`` both ways:

* ``naive``: ``logits = h @ W`` in float32 ``[T, V]``, ``jax.nn.log_softmax``, gather;
* ``chunked``: ``ops.chunked_token_logprobs(h, W, tokens, chunk_size=...)``.

Memory is XLA's own account of the compiled program (``compiled.memory_analysis()``):
temporaries + arguments + outputs (less what outputs alias from donated arguments,
nothing here). Both programs take and return the same buffers (``h``, ``W``, ids and
advantages in; the loss and the ``[T, E]`` and ``[E, V]`` gradients out), so the
difference is the temporaries: the naive program's ``[T, V]`` logits, softmax and their
gradient against the chunked program's one chunk of them and a float32 ``[E, V]``
gradient accumulator. The numbers are the CPU compiler's buffer assignment; an
accelerator's fuses differently but holds the same ``[T, V]`` arrays.

Then both programs run at ``--check-tokens`` tokens (the full vocabulary and width; the
naive one at ``--tokens`` would need the whole of the naive peak in host memory) and the
log-probs and both gradients are compared (``rtol`` / ``atol`` printed).

    python benchmarks/loss_memory.py [--tokens 8192] [--vocab 151936] [--hidden 896] [--chunk-size 256]
                                     [--check-tokens 1024]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import ops

TARGET = 0.15
"""The chunked program's peak may be at most this share of the naive one's."""
RTOL, ATOL = 1e-5, 1e-6
"""Agreement asked of the two programs: ``|chunked - naive| <= ATOL * max|naive| + RTOL * |naive|``."""


def naive_logprobs(hidden: jax.Array, kernel: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[T]`` log-probs through full float32 logits: ``hidden [T, E] @ kernel [E, V]``."""
    logits = jnp.matmul(hidden, kernel, preferred_element_type=jnp.float32)  # [T, V]
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]  # [T]


def chunked_logprobs(hidden: jax.Array, kernel: jax.Array, tokens: jax.Array, *, chunk_size: int) -> jax.Array:
    """``[T]`` log-probs, ``chunk_size`` tokens at a time (the library's path)."""
    return ops.chunked_token_logprobs(hidden[None], kernel, tokens[None], chunk_size=chunk_size)[0]  # [T]


def grpo_loss(logprobs_fn, hidden, kernel, tokens, advantages) -> jax.Array:
    """``-(exp(logp - sg(logp)) * A).sum() / T``: GRPO's on-policy surrogate (value 1 per
    token, gradient that of ``logp``)."""
    logp = logprobs_fn(hidden, kernel, tokens)  # [T]
    return -jnp.sum(jnp.exp(logp - jax.lax.stop_gradient(logp)) * advantages) / tokens.shape[0]


def programs(*, chunk_size: int) -> dict[str, object]:
    """Name -> the log-probs function of each way."""
    return {"naive": naive_logprobs, "chunked": lambda h, w, t: chunked_logprobs(h, w, t, chunk_size=chunk_size)}


def loss_and_grad(logprobs_fn):
    """``(h, W, ids, A) -> (loss, (dL/dh, dL/dW))``."""
    return jax.value_and_grad(lambda h, w, t, a: grpo_loss(logprobs_fn, h, w, t, a), argnums=(0, 1))


def inputs(*, tokens: int, vocab: int, hidden: int, seed: int = 0):
    """Random hidden states ``[T, E]``, a kernel ``[E, V]`` with unit-scale logits, ids ``[T]``
    and advantages ``[T]``."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (tokens, hidden), jnp.float32),
        jax.random.normal(keys[1], (hidden, vocab), jnp.float32) / np.sqrt(hidden),
        jax.random.randint(keys[2], (tokens,), 0, vocab),
        jax.random.normal(keys[3], (tokens,), jnp.float32),
    )


def memory(fn, *args) -> dict[str, int]:
    """Bytes of the compiled ``fn(*args)`` (arrays or ``ShapeDtypeStruct``s): XLA's
    temporaries, arguments, outputs, aliased, and the peak those make."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    parts = {
        "temp": stats.temp_size_in_bytes,
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes,
    }
    parts["peak"] = parts["temp"] + parts["arguments"] + parts["outputs"] - parts["alias"]
    return parts


def max_error(got, want) -> tuple[float, float]:
    """Largest absolute difference, and it over ``max|want|``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = float(np.max(np.abs(got - want)))
    return error, error / max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)


def check(*, tokens: int, vocab: int, hidden: int, chunk_size: int) -> dict[str, tuple[float, float]]:
    """Runs both programs at ``tokens`` tokens; returns each output's ``(max |error|,
    relative to max |naive|)`` and raises ``AssertionError`` beyond ``RTOL`` / ``ATOL``."""
    args = inputs(tokens=tokens, vocab=vocab, hidden=hidden, seed=1)
    ways = programs(chunk_size=chunk_size)
    logp = {name: jax.jit(fn)(*args[:3]) for name, fn in ways.items()}
    value = {name: jax.jit(loss_and_grad(fn))(*args) for name, fn in ways.items()}
    # (The loss's value is -mean(A) either way: exp(logp - sg(logp)) = 1.)
    outputs = {
        "log-probs": (logp["chunked"], logp["naive"]),
        "dL/dh": (value["chunked"][1][0], value["naive"][1][0]),
        "dL/dW": (value["chunked"][1][1], value["naive"][1][1]),
    }
    errors = {}
    for name, (got, want) in outputs.items():
        want = np.asarray(want)
        np.testing.assert_allclose(
            np.asarray(got), want, rtol=RTOL, atol=ATOL * float(np.max(np.abs(want))), err_msg=name
        )
        errors[name] = max_error(got, want)
    return errors


def main(argv=None) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T: tokens of the loss (default 8192)")
    parser.add_argument("--vocab", type=int, default=151936, help="V (default 151936, Qwen2.5's)")
    parser.add_argument("--hidden", type=int, default=896, help="E (default 896, Qwen2.5-0.5B's)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (the library's default 256)")
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=1024,
        help="run both programs at this many tokens and compare them (0: skip)",
    )
    args = parser.parse_args(argv)
    for name in ("tokens", "vocab", "hidden", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.check_tokens < 0:
        parser.error("--check-tokens must be >= 0")

    t, v, e = args.tokens, args.vocab, args.hidden
    abstract = (
        jax.ShapeDtypeStruct((t, e), jnp.float32),
        jax.ShapeDtypeStruct((e, v), jnp.float32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.float32),
    )
    results = {name: memory(loss_and_grad(fn), *abstract) for name, fn in programs(chunk_size=args.chunk_size).items()}

    gib = 2.0**30
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}: GRPO loss + gradient w.r.t. hidden [T, E] and "
        f"output kernel [E, V], float32, T = {t}, V = {v}, E = {e}; XLA memory_analysis() of the compiled "
        f"programs (nothing allocated)"
    )
    print(
        f"[T, V] float32 logits alone: {t * v * 4 / gib:.2f} GiB; one chunk of them: "
        f"{min(args.chunk_size, t) * v * 4 / gib:.3f} GiB"
    )
    print()
    print("| program | temp GiB | arguments GiB | outputs GiB | peak GiB | of naive |")
    print("|---|---:|---:|---:|---:|---:|")
    naive_peak = results["naive"]["peak"]
    labels = {
        "naive": "naive: [T, V] float32 logits, log_softmax, gather",
        "chunked": f"chunked: ops.chunked_token_logprobs, chunk {args.chunk_size}",
    }
    for name in ("naive", "chunked"):
        parts = results[name]
        print(
            f"| {labels[name]} | {parts['temp'] / gib:.3f} | {parts['arguments'] / gib:.3f} | "
            f"{parts['outputs'] / gib:.3f} | {parts['peak'] / gib:.3f} | {parts['peak'] / naive_peak:.1%} |"
        )
    share = results["chunked"]["peak"] / naive_peak
    print()
    print(f"target: chunked peak <= {TARGET:.0%} of naive: {share:.1%}, {'met' if share <= TARGET else 'NOT met'}")

    if args.check_tokens:
        errors = check(tokens=args.check_tokens, vocab=v, hidden=e, chunk_size=args.chunk_size)
        print()
        print(
            f"numerical check, both programs run at T = {args.check_tokens} (V = {v}, E = {e}; the naive "
            f"program at T = {t} would need its {naive_peak / gib:.1f} GiB): chunked - naive within "
            f"rtol {RTOL:g} + atol {ATOL:g} x max|naive|"
        )
        print()
        print("| output | max abs error | relative to max abs |")
        print("|---|---:|---:|")
        for name, (error, relative) in errors.items():
            print(f"| {name} | {error:.2e} | {relative:.2e} |")
    return results


if __name__ == "__main__":
    main()
