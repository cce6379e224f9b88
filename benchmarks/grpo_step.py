"""One full GRPO train step on a small decoder: time split and model FLOP utilisation.

The step is what :func:`jaxrl_llm.training.train` runs: the jitted KV-cache rollout
(``G`` completions per prompt), host rewards, ``score`` (reference log-probs and
advantages) and the donated ``update`` (the GRPO preset: k3 KL to the reference, mu = 1,
one minibatch). Configuration: 8 prompts x 4 completions, prompt 16 tokens,
completion 32 tokens, 4 layers, d_model 256, 4 heads of 64, MLP 1024, vocab 512, float32.
EOS is a token the random model rarely draws, so every completion has all 32 tokens
(the prefill's logits give the first, 31 decode steps the rest).

Model FLOPs (``GFLOP``) count the matmuls of the model (projections, attention scores
and values, the output layer where it is used) for every one of the B = P x G sequences:
the rollout's prefill and 31 decode steps, the reference's forward pass, and 3x that for
the update (forward + backward). The FLOP floor is that count at the float32 matmul peak
measured in the same run (the best of a few square matmuls and of the model's own
projection shapes), and MFU is model FLOPs / (seconds x peak): the usual convention
(PaLM's), which counts the model's FLOPs for the sequences processed whatever the
implementation saves. ``run GFLOP`` counts the matmuls that execute, and HFU and
``x run floor`` measure the time against those: the sampler prefills each prompt once
for its G samples and attends over every slot of its cache, and with
``TrainConfig.share_prompts`` (the default) the teacher-forced passes also run each
prompt once per group.

A decode step multiplies only the rows one device decodes by each weight matrix, a shape
no CPU kernel runs at the peak. The line under the table gives the rate of such
products (a loop of ``[rows, E] @ [E, F]`` and ``[rows, F] @ [F, E]``, on every rollout
device at once) and the rollout's time at that rate.

The rollout is decoded data-parallel over ``--rollout-devices`` devices (default: 2 on a
CPU, the host split into two devices, one per core of the 2-core machines this targets,
whose programs run concurrently, which suits decode steps' small matmuls better than
splitting each of them over both cores; 1 on an accelerator). ``score`` and ``update``
run on one device.

    python benchmarks/grpo_step.py [--repeats 10] [--rollout-devices 2] [--no-share-prompts]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

from jaxrl_llm import algorithms, host, models, sampling, sharding, training

CONFIG = models.ModelConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 4, 16, 32


def matmul_peak_flops(config: models.ModelConfig, tokens: int) -> tuple[float, str]:
    """Best float32 matmul throughput, in FLOP/s, and the shape that reached it: square
    matmuls of a few sizes, and the model's own projections over ``tokens`` rows
    (forward ``[T, E] @ [E, F]``, input gradient ``[T, F] @ [F, E]``, and the three
    ``[E, F]`` kernels side by side), which on some CPUs run faster than any square one."""
    d, f = config.hidden_size, config.intermediate_size
    shapes = [(n, n, n) for n in (512, 1024, 2048)] + [(tokens, d, f), (tokens, f, d), (tokens, d, 3 * f)]
    best, best_shape = 0.0, ""
    for m, k, n in shapes:
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        seconds = median_seconds(jax.jit(jnp.matmul), a, b, repeats=10)
        if 2 * m * k * n / seconds > best:
            best, best_shape = 2 * m * k * n / seconds, f"[{m}, {k}] @ [{k}, {n}]"
    return best, best_shape


def decode_matmul_flops(config: models.ModelConfig, *, rows: int, devices: list[jax.Device]) -> float:
    """Float32 FLOP/s of decode-shaped matmuls on ``devices`` at once: on each, a loop of
    64 ``[rows, E] @ [E, F]``, ``tanh``, ``[rows, F] @ [F, E]``, the products of a decode
    step's MLP for the ``rows`` it decodes."""
    d, f, steps = config.hidden_size, config.intermediate_size, 64

    @jax.jit
    def loop(x, w_in, w_out):  # x [rows, E], w_in [E, F], w_out [F, E]
        return jax.lax.fori_loop(0, steps, lambda _, x: jnp.tanh(x @ w_in) @ w_out, x)

    operands = [
        jax.device_put((jnp.ones((rows, d)), jnp.full((d, f), 1 / d), jnp.full((f, d), 1 / f)), device)
        for device in devices
    ]
    seconds = median_seconds(lambda: [loop(*args) for args in operands], repeats=30)  # dispatched concurrently
    return len(devices) * steps * 2 * (2 * rows * d * f) / seconds


def forward_flops(config: models.ModelConfig, *, queries: int, keys: int, logits: int) -> float:
    """Model FLOPs of one sequence's forward pass: ``queries`` new positions attending to
    ``keys`` positions, with output logits at ``logits`` of them."""
    d, hidden_heads = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_token = config.num_layers * (
        d * hidden_heads + 2 * d * kv + hidden_heads * d + 3 * d * config.intermediate_size
    )
    attention = config.num_layers * 2 * queries * keys * hidden_heads  # scores and values
    return 2.0 * (per_token * queries + attention + logits * d * config.vocab_size)


def step_flops(
    config: models.ModelConfig,
    *,
    executed: bool = False,
    share_prompts: bool = True,
    prompts: int = PROMPTS,
    group: int = GROUP,
    prompt_len: int = PROMPT_LEN,
    new_tokens: int = NEW_TOKENS,
) -> dict[str, float]:
    """Model FLOPs of each phase of a step of ``prompts x group`` completions of
    ``new_tokens`` tokens after ``prompt_len``-token prompts or, with ``executed``, those of
    the matmuls that run: the sampler's attention over every slot of its cache, and with
    ``share_prompts`` the teacher-forced passes' prompts once per group (then ``N - 1``
    completion inputs per row attending to ``S + N - 1`` slots)."""
    batch, total = prompts * group, prompt_len + new_tokens
    cache = total  # the sampler's cache: prompt and completion buffers, both multiples of its bucket here
    prefill = forward_flops(config, queries=prompt_len, keys=cache if executed else prompt_len, logits=1)
    decode = sum(
        forward_flops(config, queries=1, keys=cache if executed else prompt_len + t + 1, logits=1)
        for t in range(new_tokens - 1)
    )
    teacher_forced = batch * forward_flops(config, queries=total, keys=total, logits=new_tokens)
    if executed and share_prompts:
        teacher_forced = prompts * forward_flops(config, queries=prompt_len, keys=total - 1, logits=1) + (
            batch * forward_flops(config, queries=new_tokens - 1, keys=total - 1, logits=new_tokens - 1)
        )
    # The model count prefills all B sequences; the sampler runs each of the P prompts once.
    prefills = prompts if executed else batch
    return {"rollout": prefills * prefill + batch * decode, "logprobs": teacher_forced, "update": 3 * teacher_forced}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--rollout-devices",
        type=int,
        default=None,
        help="decode the rollout over a 'data' mesh of this many devices (1: one device; default: 2 on a CPU, else 1)",
    )
    parser.add_argument(
        "--no-share-prompts",
        dest="share_prompts",
        action="store_false",
        help="run every sequence's prompt in the teacher-forced passes (TrainConfig.share_prompts)",
    )
    args = parser.parse_args(argv)
    if args.rollout_devices is not None and args.rollout_devices < 1:
        parser.error(f"--rollout-devices must be >= 1; got {args.rollout_devices}")
    jax.config.update("jax_num_cpu_devices", args.rollout_devices or 2)  # a CPU host as several devices
    if args.rollout_devices is None:
        args.rollout_devices = 2 if jax.default_backend() == "cpu" else 1
    mesh = sharding.make_mesh(args.rollout_devices) if args.rollout_devices > 1 else None

    model, params = models.init(CONFIG, jax.random.key(0))
    eos = CONFIG.vocab_size - 1
    run = training.TrainConfig(
        num_prompts=PROMPTS,
        group_size=GROUP,
        sampling=sampling.SamplingConfig(max_new_tokens=NEW_TOKENS),
        share_prompts=args.share_prompts,
    )
    halves = training.make_train_step(model, algorithms.GRPO, run)
    score, update = jax.jit(halves.score), jax.jit(halves.update, donate_argnums=0)
    state = training.init_state(model, params, algorithms.GRPO, run)
    fixed = training.fixed_params(params, algorithms.GRPO, run)
    sampler = sampling.Sampler(model=model, eos_ids=(eos,), pad_id=0, mesh=mesh)
    state_device = jax.devices()[0]
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, eos, size=(PROMPTS, PROMPT_LEN)), jnp.int32)
    prompt_mask = jnp.ones(prompts.shape, bool)

    timings: dict[str, list[float]] = {"rollout": [], "logprobs": [], "update": [], "step": []}
    for repeat in range(args.repeats + 1):  # the first step compiles; it is not counted
        started = time.perf_counter()
        rollout = sampler(
            state.params, prompts, prompt_mask, jax.random.key(repeat), num_samples=GROUP, max_new_tokens=NEW_TOKENS
        )
        rollout = jax.device_put(rollout, state_device)  # to score and update (a no-op without a mesh)
        completion = np.asarray(rollout.completion_tokens)  # waits for the rollout
        rewards = (completion[:, 0] % 2).astype(np.float32)  # a stand-in verifier on the host
        rolled = time.perf_counter()
        batch = training.Batch.from_rollout(prompts, prompt_mask, rollout, rewards)
        scored, _ = jax.block_until_ready(score(state, fixed, batch))
        scored_at = time.perf_counter()
        state, metrics = jax.block_until_ready(update(state, fixed, scored))
        done = time.perf_counter()
        assert int(rollout.lengths.max()) == NEW_TOKENS and np.isfinite(float(metrics["loss"]))
        if repeat:
            for name, seconds in (
                ("rollout", rolled - started),
                ("logprobs", scored_at - rolled),
                ("update", done - scored_at),
                ("step", done - started),
            ):
                timings[name].append(seconds)

    peak, peak_shape = matmul_peak_flops(CONFIG, PROMPTS * GROUP * (PROMPT_LEN + NEW_TOKENS))
    rollout_devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    decode_rows = PROMPTS * GROUP // len(rollout_devices)
    decode_rate = decode_matmul_flops(CONFIG, rows=decode_rows, devices=rollout_devices)
    flops = step_flops(CONFIG)
    executed = step_flops(CONFIG, executed=True, share_prompts=args.share_prompts)
    flops["step"], executed["step"] = sum(flops.values()), sum(executed.values())
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device"
        f"{'s' if jax.device_count() > 1 else ''}), "
        f"float32 matmul peak {peak / 1e9:.1f} GFLOP/s (measured, {peak_shape})"
    )
    print(
        f"GRPO step: {PROMPTS} prompts x {GROUP} completions, prompt {PROMPT_LEN}, completion {NEW_TOKENS}; "
        f"{CONFIG.num_layers} layers, d_model {CONFIG.hidden_size}, vocab {CONFIG.vocab_size}; "
        f"median of {args.repeats} steps"
    )
    print(
        f"rollout on {args.rollout_devices} device{'s' if args.rollout_devices > 1 else ''}; prompts "
        f"{'shared' if args.share_prompts else 'not shared'} in the teacher-forced passes"
    )
    header = (
        f"{'phase':<10} {'median s':>9} {'share':>7} {'GFLOP':>8} {'run GFLOP':>10} {'floor s':>8} {'MFU':>6} "
        f"{'HFU':>6} {'x floor':>8} {'x run floor':>12}"
    )
    print(header)
    print("-" * len(header))
    step_s = float(np.median(timings["step"]))
    for name in ("rollout", "logprobs", "update", "step"):
        seconds = float(np.median(timings[name]))
        floor = flops[name] / peak
        print(
            f"{name:<10} {seconds:>9.4f} {seconds / step_s:>6.0%} {flops[name] / 1e9:>8.2f} "
            f"{executed[name] / 1e9:>10.2f} {floor:>8.4f} {floor / seconds:>5.0%} "
            f"{executed[name] / peak / seconds:>5.0%} {seconds / floor:>7.2f}x "
            f"{seconds * peak / executed[name]:>11.2f}x"
        )
    print(
        f"decode-shaped matmuls ([{decode_rows}, {CONFIG.hidden_size}] @ [{CONFIG.hidden_size}, "
        f"{CONFIG.intermediate_size}] and back, on {len(rollout_devices)} device"
        f"{'s' if len(rollout_devices) > 1 else ''} at once): {decode_rate / 1e9:.1f} GFLOP/s, "
        f"{decode_rate / peak:.0%} of the peak; the rollout's executed FLOPs at that rate: "
        f"{executed['rollout'] / decode_rate:.4f} s"
    )
    print(
        "targets: update MFU >= 50%; step <= 1.6x its FLOP floor. The same step in TRL 1.16's GRPOTrainer on "
        "this machine: make bench-trl (an earlier spell measured ~0.49 s for TRL, ~0.67 s for Tunix 0.1.7)."
    )


if __name__ == "__main__":
    host.reuse_freed_memory()  # before JAX's first computation
    main()
