r"""GRPO train steps through :func:`jaxrl_llm.training.train` with its defaults, as a user
runs them: the side-by-side entry for jaxrl_llm next to ``trl_grpo_step.py`` and
``tunix_grpo_step.py`` (same work, same JSON line; ``side_by_side.py`` runs all three).

Shapes (``--shape``):

* ``tiny`` (``grpo_step.py``'s): Llama, 4 layers, d_model 256, 4 heads of 64, MLP 1024,
  vocab 512, untied output layer; 8 prompts x 4 completions, prompt 16, completion 32.
* ``qwen05b``: Qwen2.5-0.5B's shape with random weights (24 layers, hidden 896, 14 query /
  2 key-value heads of 64, MLP 4864, vocab 151,936, tied embeddings, q/k/v biases);
  2 prompts x 4 completions, prompt 32, completion 64.
* ``gpu``: the same model, 16 prompts x 8 completions, prompt 128, completion 256, mixed
  precision (``gpu_side_by_side.py``'s).

``--layers``, ``--group-size``, ``--new-tokens`` override the shape's (the scaling
curves of ``side_by_side.py``). ``--precision``: ``float32`` (the CPU shapes' default) or
``mixed``, float32 weights with bfloat16 compute (``ModelConfig(param_dtype=float32,
dtype=bfloat16)``, what TRL's ``bf16=True`` does). ``--scan-layers``: the stacked layers'
layout (``ModelConfig.scan_layers``). The GRPO preset (k3 KL to the reference,
beta 0.04, mu 1, one minibatch), learning rate 1e-6, every other setting
:class:`~jaxrl_llm.training.TrainConfig`'s default (so each group's prompt runs once in
the teacher-forced passes, and the persistent compilation cache is on: point
``$JAXRL_LLM_COMPILATION_CACHE`` at a fresh directory for a cold start).

The task (:class:`WordParityTask`) is the peers': a word-level tokenizer (token ``i`` is
the word ``w{i}``), prompts of random words, and a reward on the host, the parity of the
first completion token. Its EOS is the last id, which a random model draws about once in
``V`` tokens: a row that draws it ends early, but the batch decodes until every row has
finished (all of them, in practice), so the step's work is the peers' (TRL's script sets
``min_new_tokens``, Tunix's an EOS it cannot sample; the sampler here refuses ids outside
the vocabulary). ``completion_length`` in the JSON is the mean.

Times are ``train``'s own metrics: ``step_seconds``, split as the peers' scripts split
theirs into rollout (``rollout_seconds`` + ``reward_seconds``), log-probs
(``logprob_seconds``) and update (the rest: ``update_seconds`` and the loop's host
bookkeeping, a few milliseconds). The first step (compilation)
is left out of the medians and reported as ``first_step_s``, and ``to_first_step_s`` is
the time from this process's start (imports included) to the end of that step.
``peak_rss_gb`` is the process's peak resident memory and ``peak_device_gb`` the device's
(``memory_stats()``'s ``peak_bytes_in_use``; ``None`` where the backend keeps no such count,
as on a CPU). The last line of output is one JSON object.

``--profile DIR`` traces the steps after the warm-up with ``jax.profiler`` (a Perfetto trace
in ``DIR``) and adds ``trace_summary.summarize``'s time by op to the JSON as ``profile``; those
steps' times then include the profiler's overhead.

    python benchmarks/train_step.py [--shape tiny|qwen05b|gpu] [--repeats 10] [--precision float32|mixed]
                                    [--scan-layers] [--layers L] [--group-size G] [--new-tokens N]
                                    [--profile DIR] [--micro-batch-size ROWS]
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()  # before the imports: they count toward the first step

import dataclasses  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import step_report  # noqa: E402
import trace_summary  # noqa: E402
import transformers  # noqa: E402
from grpo_step import CONFIG as TINY_CONFIG  # noqa: E402
from layer_scan import qwen25_05b  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402
from tokenizers import models as tokenizer_models  # noqa: E402

from jaxrl_llm import algorithms, models, sampling, tasks, training  # noqa: E402
from jaxrl_llm.training.config import OptimizerConfig  # noqa: E402

SHAPES = {
    "tiny": dict(config=lambda: TINY_CONFIG, prompts=8, group=4, prompt_len=16, new_tokens=32),
    "qwen05b": dict(config=qwen25_05b, prompts=2, group=4, prompt_len=32, new_tokens=64),
    "gpu": dict(config=qwen25_05b, prompts=16, group=8, prompt_len=128, new_tokens=256, precision="mixed"),
}
COMPUTE_DTYPES = {"float32": jnp.float32, "mixed": jnp.bfloat16}  # step_report.PRECISIONS; weights float32
WARMUP = 1  # steps not counted (compilation)
PHASES = ("rollout", "logprobs", "update", "step")


def word_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Token ``i`` is the word ``w{i}``; pad ``w0``; no BOS, EOS or chat template."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="w0", padding_side="left")


def parity_reward(completion_ids, **kwargs) -> list[float]:
    """A stand-in verifier on the host: the parity of the first completion token."""
    return [float(ids[0] % 2) for ids in completion_ids]


@dataclasses.dataclass(frozen=True, eq=False)
class WordParityTask:
    """Prompts of ``prompt_len`` random words (neither pad nor the last id), example ``i``
    drawn from ``(seed, i)``; one reward, :func:`parity_reward`."""

    vocab_size: int
    prompt_len: int
    tokenizer: transformers.PreTrainedTokenizerBase = dataclasses.field(init=False, repr=False)
    pad_id: int = 0
    stop_strings: tuple[str, ...] = ()
    reward_fns: tuple = (parity_reward,)
    reward_weights: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        object.__setattr__(self, "tokenizer", word_tokenizer(self.vocab_size))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.vocab_size - 1,)

    def split_size(self, split: str) -> int | None:
        return None

    def examples(self, split: str, indices: np.ndarray, *, seed: int) -> tasks.PromptBatch:
        ids = np.stack(
            [np.random.default_rng([seed, int(i)]).integers(1, self.vocab_size - 1, self.prompt_len) for i in indices]
        ).astype(np.int32)  # [P, S]
        prompts = [" ".join(f"w{t}" for t in row) for row in ids]
        return tasks.PromptBatch(
            tokens=ids,
            mask=np.ones(ids.shape, bool),
            prompts=prompts,
            columns={},
            indices=np.asarray(indices, np.int64),
        )


def peak_device_gb(device: jax.Device) -> float | None:
    """The most memory ``device`` has held at once (its allocator's ``peak_bytes_in_use``),
    in GB; ``None`` where the backend keeps no count (a CPU)."""
    stats = device.memory_stats() or {}
    return stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None


def main(argv=None) -> dict:
    args, shape = step_report.parse(
        __doc__.split("\n\n")[0],
        SHAPES,
        argv,
        precision=True,
        flags=(
            ("--scan-layers", dict(action="store_true", help="the stacked layers' layout")),
            ("--profile", dict(default=None, help="trace the steps after the warm-up into this directory")),
            ("--micro-batch-size", dict(type=int, default=None, help="TrainConfig.micro_batch_size (rows)")),
        ),
    )
    config = dataclasses.replace(shape["config"](), dtype=COMPUTE_DTYPES[args.precision], scan_layers=args.scan_layers)
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    prompts, prompt_len, group, new_tokens = shape["prompts"], shape["prompt_len"], args.group_size, args.new_tokens

    model, params = models.init(config, jax.random.key(0))
    run = training.TrainConfig(
        num_prompts=prompts,
        group_size=group,
        sampling=sampling.SamplingConfig(max_new_tokens=new_tokens, max_prompt_length=prompt_len),
        optimizer=OptimizerConfig(learning_rate=1e-6),
        micro_batch_size=args.micro_batch_size,
    )
    task = WordParityTask(vocab_size=config.vocab_size, prompt_len=prompt_len)
    first_step_done = []

    def on_step(end: training.StepEnd) -> None:
        if not first_step_done:
            first_step_done.append(time.perf_counter())
            if args.profile:  # the steady steps only: compilation is not traced
                jax.profiler.start_trace(args.profile, create_perfetto_trace=True)

    _, history = training.train(
        model, params, algorithms.GRPO, run, steps=WARMUP + args.repeats, task=task, callback=on_step
    )
    if args.profile:
        jax.profiler.stop_trace()
    for row in history:  # the peers' phases: rollout with rewards, log-probs, and the rest of the step
        row["rollout"] = row["rollout_seconds"] + row["reward_seconds"]
        row["logprobs"], row["step"] = row["logprob_seconds"], row["step_seconds"]
        row["update"] = row["step"] - row["rollout"] - row["logprobs"]  # update_seconds and the host's bookkeeping
    history[0]["since_start"] = first_step_done[0] - PROCESS_STARTED
    params_count = sum(x.size for x in jax.tree.leaves(params))

    lib = step_report.versions("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax")
    device = jax.devices()[0]
    print(
        f"jaxrl_llm on jax {lib['jax']} ({jax.default_backend()}: {device.device_kind}, {jax.device_count()} "
        f"device(s), {os.cpu_count()} cores), flax {lib['flax']}, optax {lib['optax']}; {config.architecture} "
        f"{params_count / 1e6:.1f}M params, {step_report.PRECISIONS[args.precision]}"
        f"{', stacked layers' if args.scan_layers else ''}, training.train defaults"
    )
    print(
        f"GRPO step through training.train ({args.shape}): {prompts} prompts x {group} completions, prompt "
        f"{prompt_len}, completion {new_tokens}; {config.num_layers} layers, d_model {config.hidden_size}, vocab "
        f"{config.vocab_size}; {args.repeats} steps after {WARMUP} warm-up"
    )
    results = {
        "library": "jaxrl_llm",
        "shape": args.shape,
        "versions": lib,
        "prompts": prompts,
        "group": group,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "layers": config.num_layers,
        "params": params_count,
        "repeats": args.repeats,
        "warmup": WARMUP,
        "precision": args.precision,
        "scan_layers": args.scan_layers,
        "micro_batch": args.micro_batch_size or prompts * group,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "platform_version": device.client.platform_version,  # on a GPU, the CUDA version JAX runs
        "devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "completion_length": statistics.mean(row["completion_length"] for row in history),
        "peak_device_gb": peak_device_gb(device),
    }
    if args.profile:  # the traced steps' times include the profiler's overhead
        results["profile"] = trace_summary.summarize(args.profile)
    return step_report.finish(results, history, warmup=WARMUP, phases=PHASES)


if __name__ == "__main__":
    main()
