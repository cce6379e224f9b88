"""One GRPO optimizer step of Tunix's ``GRPOLearner`` (JAX, CPU): the side-by-side
reference for ``grpo_step.py``, like ``trl_grpo_step.py`` for TRL. Run it with
``make bench-tunix``, which builds its own venv (``.venv-tunix``, from
``benchmarks/tunix/requirements.txt``: google-tunix 0.1.7 and the CPU build of JAX);
this file imports no jaxrl_llm.

Configuration (``--shape tiny``, the default, grpo_step.py's): Tunix's own ``Llama3``
model class, 4 layers, d_model 256, 4 heads of 64 (4 KV heads), MLP 1024, vocab 512,
untied output layer (``weight_tying=False``), float32; 8 prompts x 4 completions per
optimizer step, prompt 16 tokens, completion 32 tokens, beta 0.04 (so the reference model
runs), mu = 1 (``num_iterations=1``), temperature 1.0 (top-p 1, no top-k: plain
categorical sampling), AdamW (lr 1e-6), one minibatch per step (``mini_batch_size`` =
``train_micro_batch_size`` = 8 prompts, so no gradient accumulation), the ``vanilla``
rollout engine (Tunix's own JAX sampler), no remat, no LoRA, no CPU offload.
``--shape qwen05b``: Tunix's ``Qwen2`` class with Qwen2.5-0.5B's sizes
(``ModelConfig.qwen2p5_0p5b()``: 24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP
4864, vocab 151,936, tied embeddings, q/k/v biases), float32; 2 prompts x 4, prompt 32,
completion 64. Weights are random (``tunix.models.dummy_model_creator``: N(0, 0.02) for
every parameter), built twice from one seed for the policy and the reference; nothing is
downloaded. The tokenizer is a word-level one over ``w000`` ... (token i is the word
``w{i}``; pad ``w000`` = 0, EOS the last id, as in grpo_step.py, no BOS), so a prompt of
16 words is 16 tokens. The rollout's ``eos_tokens`` is set to the vocabulary size, an id
the model cannot sample, so every completion runs all 32 (64) tokens (Tunix's sampler has
no ``min_new_tokens``). The reward is the parity of the first completion token, computed
on the host from the decoded text.

Each optimizer step is the learner's ``_run_global_step`` (the data-loading thread's
rollout, rewards, reference log-probs and advantages, then the actor's jitted
``train_step``; Tunix waits for it before returning). The split wraps Tunix's own methods
and maps onto grpo_step.py's phases:

* rollout: ``RLCluster.generate`` (tokenise, the sampler's jitted prefill and
  ``while_loop`` decode, decode to text) and ``_compute_rewards``;
* logprobs: the rest of ``GRPOLearner._generate_and_compute_advantage``: the reference
  model's forward pass (``RLCluster.get_ref_per_token_logps``, also shown alone; the
  wrapper blocks on its result, which Tunix leaves in flight while it scores on the host)
  and the advantages;
* update: the rest of the step (``RLCluster.update_actor``: the policy's forward and
  backward pass through ``compute_per_token_logps``, the loss, the AdamW step).

With mu = 1 Tunix computes no "old" log-probs (the loss takes ``stop_gradient`` of the
policy's own), and actor and rollout share one mesh, so they share the weights and no
``sync_weights`` runs between steps (asserted).

Where Tunix's own choices make the work differ from grpo_step.py (kept as Tunix runs):
the sampler prefills all B x G rows (prompts are repeated, not shared per group), the
prefill computes the output layer at every prompt position (these model classes lack
``decode_only_last_token``), and its ``while_loop`` runs until the token buffer is full,
so N completion tokens take the prefill plus N decode steps (the last token is dropped);
each decode step attends over every cache slot. The teacher-forced passes (reference and
update) also compute the output layer at every prompt position, the loss adds a
per-token entropy over the full logits (logged only), and the KL is ``kl_loss_mode="kl"``
(``logp - ref_logp``), not k3. Masks come from the token ids: a sampled pad token (id 0)
is dropped from the loss and from later decode steps' attention (no cost change). The
layers are a Python loop (unrolled, no scan), and the learner keeps a full extra copy of
the policy's state (``RLCluster._anchor_policy_state``, on ``pinned_host``, which on a CPU
is another host buffer): one model's worth of memory more.

Workarounds this needs with Tunix 0.1.7 and JAX 0.10.2 (each checked by undoing it):

* Prompts are passed as numpy arrays, not lists. The learner repeats each batch G times
  with ``jax.tree.map(lambda x: np.repeat(x, G, axis=0), batch)``: on a list every string
  is its own leaf, so B prompts become B arrays of G copies (not B x G strings), and the
  sampler hands each whole array to the tokenizer as one "prompt".
* The mesh is built with ``AxisType.Auto`` axes, as Tunix's quickstart does:
  ``jax.make_mesh`` now defaults to ``Explicit`` axes, and under them the model's first
  embedding lookup fails with ``ShardingTypeError: Use .at[...].get(out_sharding=) to
  provide output PartitionSpec for the gather indexing ...`` (the embedding is annotated
  ``('tp', 'fsdp')``).
* The rollout gets an explicit seed (``RolloutConfig.seed``), here a new key before each
  step's rollout. Nothing fails without one, but the sampler then uses ``PRNGKey(0)`` on
  every call, so every step would sample with the same key (TRL's generator advances).
* The reward function must be a plain function, not a ``functools.partial``: Tunix logs
  each reward under ``reward_fn.__name__``.

CPU settings: Tunix's quickstart says ``pip install google-tunix "jax[cpu]"`` and a
``(1, 1)`` mesh over ``("fsdp", "tp")``; it recommends no thread or XLA flags, so none are
set: one CPU device, XLA's own thread pool over every core (grpo_step.py instead splits
the rollout over two host devices). On a 2-core machine the step times are noisy (and
anything else running skews them); the minimum shows an undisturbed step.

``--layers``, ``--group-size`` and ``--new-tokens`` override the shape's
(``side_by_side.py``'s scaling curves). The first step (compilation included) is left out
of the medians and reported as ``first_step_s``; ``to_first_step_s`` counts from the
process's start, imports and model creation included. The last line of output is one
JSON object (``side_by_side.py`` reads it).

    .venv-tunix/bin/python benchmarks/tunix_grpo_step.py [--shape tiny|qwen05b] [--repeats 10]
                                                         [--layers L] [--group-size G] [--new-tokens N]
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()  # before the imports: they count toward the first step

import os  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Tunix imports transformers: nothing is fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import step_report  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models import dummy_model_creator  # noqa: E402
from tunix.models.llama3 import model as llama3_lib  # noqa: E402
from tunix.models.qwen2 import model as qwen2_lib  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

SHAPES = {
    "tiny": dict(
        model="llama3",
        prompts=8,
        group=4,
        prompt_len=16,
        new_tokens=32,
        config=lambda: llama3_lib.ModelConfig(
            num_layers=4,
            vocab_size=512,
            embed_dim=256,
            hidden_dim=1024,
            num_heads=4,
            head_dim=64,
            num_kv_heads=4,
            rope_theta=500_000,
            norm_eps=1e-5,
            weight_tying=False,
        ),
    ),
    "qwen05b": dict(
        model="qwen2",
        prompts=2,
        group=4,
        prompt_len=32,
        new_tokens=64,
        config=lambda: qwen2_lib.ModelConfig.qwen2p5_0p5b(),  # float32 params and compute by default
    ),
}
MODEL_CLASSES = {"llama3": llama3_lib.Llama3, "qwen2": qwen2_lib.Qwen2}
WARMUP = 1  # optimizer steps not counted (compilation)
PHASES = ("rollout", "logprobs", "reference", "update", "step")


class WordTokenizer:
    """Token i is the word ``w{i}``; no BOS. Tunix wraps any object with these five methods."""

    def __init__(self, vocab_size: int):
        self.width, self.eos = len(str(vocab_size - 1)), vocab_size - 1

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(f"w{int(i):0{self.width}d}" for i in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.eos

    def pad_id(self) -> int:
        return 0


def make_batches(tokenizer: WordTokenizer, steps: int, prompts: int, prompt_len: int) -> list[dict]:
    """``steps`` batches of ``prompts`` prompts of ``prompt_len`` random words, neither pad nor
    EOS; each batch's prompts are a numpy array (see the docstring)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, tokenizer.eos, size=(steps, prompts, prompt_len))
    return [{"prompts": np.array([tokenizer.decode(row) for row in batch])} for batch in ids]


def make_parity_reward(new_tokens: int):
    def parity_reward(prompts, completions, **kwargs) -> list[float]:  # Tunix logs rewards by __name__
        """A stand-in verifier on the host: the parity of the first completion token."""
        words = [completion.split() for completion in completions]
        assert all(len(w) == new_tokens for w in words), "a completion ended early"
        return [float(int(w[0][1:]) % 2) for w in words]

    return parity_reward


class StepTimer:
    """Wall time of each optimizer step and of the Tunix methods wrapped by :meth:`wrap`."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, phase: str, block: bool = False, before=None) -> None:
        """Add the time of ``obj.name(...)`` calls to ``phase`` (``block``: wait for the
        result's arrays; ``before``: called first, untimed)."""
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            if before is not None:
                before()
            start = time.perf_counter()
            try:
                result = method(*args, **kwargs)
                if block:
                    jax.block_until_ready(result)
                return result
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def wrap_step(self, obj, name: str) -> None:
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            self.current = defaultdict(float)
            start = time.perf_counter()
            result = method(*args, **kwargs)
            now = time.perf_counter()
            self.current["step"], self.current["since_start"] = now - start, now - PROCESS_STARTED
            self.steps.append(dict(self.current))
            return result

        setattr(obj, name, timed)


def make_mesh() -> jax.sharding.Mesh:
    """Tunix's quickstart mesh: (1, 1) over ("fsdp", "tp"), Auto axes."""
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def main(argv=None) -> None:
    args, shape = step_report.parse(__doc__.split("\n\n")[0], SHAPES, argv)
    prompts, prompt_len, group, new_tokens = shape["prompts"], shape["prompt_len"], args.group_size, args.new_tokens

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the sampler's _init_cache fallback
    steps = WARMUP + args.repeats
    config = shape["config"]()
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    tokenizer = WordTokenizer(config.vocab_size)
    batches = make_batches(tokenizer, steps, prompts, prompt_len)
    assert all(len(tokenizer.encode(p)) == prompt_len for p in batches[0]["prompts"])

    mesh = make_mesh()
    model_class = MODEL_CLASSES[shape["model"]]
    with jax.set_mesh(mesh):
        actor = dummy_model_creator.create_dummy_model(model_class, config, mesh=mesh, random_seed=0)
        reference = dummy_model_creator.create_dummy_model(model_class, config, mesh=mesh, random_seed=0)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))

    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        seed=jax.random.PRNGKey(0),
        eos_tokens=[config.vocab_size],  # an id the model cannot sample: no completion stops early
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            role: mesh
            for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(1e-6),
            eval_every_n_steps=10**9,
            max_steps=steps,
            mini_batch_size=prompts,
            train_micro_batch_size=prompts,
        ),
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=0.04),
        reward_fns=make_parity_reward(new_tokens),
    )
    assert not learner.should_sync_weights and not learner.can_enable_async_rollout

    seeds = iter(range(10**9))

    def next_seed():  # a fresh sampling key for each rollout (see the docstring)
        rollout_config.seed = jax.random.PRNGKey(next(seeds))

    timer = StepTimer()
    timer.wrap_step(learner, "_run_global_step")
    timer.wrap(cluster, "generate", "rollout", before=next_seed)
    timer.wrap(learner, "_compute_rewards", "rollout")
    timer.wrap(learner, "_generate_and_compute_advantage", "scoring")
    timer.wrap(cluster, "get_ref_per_token_logps", "reference", block=True)
    timer.wrap(cluster, "update_actor", "actor")
    learner.train(batches)

    assert len(timer.steps) == steps, (len(timer.steps), steps)
    for step in timer.steps:  # the three phases partition the step
        step["logprobs"] = step["scoring"] - step["rollout"]
        step["update"] = step["step"] - step["scoring"]

    lib = step_report.versions("google-tunix", "jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "qwix")
    print(
        f"google-tunix {lib['google-tunix']}, jax {lib['jax']} ({jax.default_backend()}, {jax.device_count()} "
        f"device(s), {os.cpu_count()} cores), flax {lib['flax']}, optax {lib['optax']}; "
        f"{model_class.__name__} {params / 1e6:.1f}M params, float32, optimizer adamw, rollout engine vanilla"
    )
    print(
        f"Tunix GRPOLearner step ({args.shape}): {prompts} prompts x {group} completions, prompt {prompt_len}, "
        f"completion {new_tokens}; {config.num_layers} layers, d_model {config.embed_dim}, vocab "
        f"{config.vocab_size}; {args.repeats} steps after {WARMUP} warm-up"
    )
    results = {
        "library": "tunix",
        "shape": args.shape,
        "versions": lib,
        "prompts": prompts,
        "group": group,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "layers": config.num_layers,
        "params": params,
        "repeats": args.repeats,
        "warmup": WARMUP,
        "devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "decode_steps": new_tokens,
    }  # the while_loop fills the buffer: the prefill and N decode steps
    step_report.finish(results, timer.steps, warmup=WARMUP, phases=PHASES)


if __name__ == "__main__":
    main()
