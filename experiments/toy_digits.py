r"""Every method of the functional core, end to end, on a task small enough for a CPU.

Task: the prompt is two digits ``(a, b)``; the right response is the single digit
``(a + b) mod 10`` followed by EOS. The reward is 1 for the right first digit plus 0.5
for stopping right after it (DAPO's preset also adds its soft overlong penalty).

Policy: a tiny autoregressive MLP over 11 tokens (digits and EOS),
:math:`\pi_\theta(a_t \mid a, b, t, a_{t-1})`, sampled token by token in a ``lax.scan``
and scored in parallel with teacher forcing, so the sampled and recomputed log-probs of
a response are the same numbers.

This file owns only the model, the sampler and the task's reward. The train step is the
library's, the one that trains the language model: :func:`jaxrl_llm.training.make_train_step`
reads the MLP through :class:`MLPTeacherForcing` (its
:class:`jaxrl_llm.training.losses.TeacherForcing`), and its ``score`` and ``update`` give the
advantages (``algorithms.compute_advantages``), the loss (``algorithms.policy_loss``), the
critic's value loss, TRPO's natural-gradient step and the optimizer
(``training.optim.make_optimizer``) on a :class:`jaxrl_llm.training.TrainState`. Each step is
one jitted function, built once per method: sample ``G`` completions for ``P`` prompts,
reward them, then ``score`` and ``update``. DAPO's shaping is
``rewards.length.overlong_penalty`` with ``training.fit_overlong_buffer``; its dynamic
sampling keeps the LM trainer's rule (``training.collect``: groups whose task rewards are
all equal become padding rows before the advantages) but, to stay inside the jit, does
not refill the batch.

Run ``python experiments/toy_digits.py --help`` for options.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from jaxrl_llm import _checks, algorithms, kl, ops, sampling, training
from jaxrl_llm.rewards.length import overlong_penalty

NUM_DIGITS = 10
EOS = NUM_DIGITS  # token ids 0..9 are digits, 10 is EOS
VOCAB = NUM_DIGITS + 1
BOS = VOCAB  # "previous token" id at t = 0 (not in the output vocabulary)

Params = dict[str, jax.Array]
ALL_METHODS = tuple(algorithms.PRESETS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """Settings of the toy run (defaults: every method in about a minute on 2 CPU cores)."""

    algorithms: tuple[str, ...] = ALL_METHODS
    """Methods to train, in this order: preset names, space- or comma-separated (grpo ppo, or grpo,ppo)."""
    steps: int = 150
    """Training steps (one rollout batch each) per method."""
    num_prompts: int = 16
    """P: prompts per batch."""
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 6
    """T: completion budget; a completion without EOS by then is truncated."""
    hidden: int = 64
    """Width of the policy (and critic) MLP."""
    learning_rate: float = 1e-2
    """Adam learning rate of the policy (and critic), from the first step (no warm-up)."""
    seed: int = 0
    """PRNG seed: initial params and every rollout derive from it."""

    def __post_init__(self):
        where = "ToyConfig"
        # `--algorithms grpo,ppo` arrives as one entry: split it, so both spellings mean the same.
        try:
            object.__setattr__(self, "algorithms", algorithms.preset_names(self.algorithms))
        except ValueError as error:
            raise ValueError(f"{where}: `algorithms`: {error}") from None
        for field in ("steps", "num_prompts", "group_size", "max_new_tokens", "hidden"):
            _checks.positive_int(where, field, getattr(self, field))
        if self.group_size < 2:
            raise ValueError(f"{where}: `group_size` must be >= 2 for group baselines; got {self.group_size}.")
        _checks.nonnegative_int(where, "seed", self.seed)
        _checks.finite_number(where, "learning_rate", self.learning_rate)
        _checks.positive(where, "learning_rate", self.learning_rate)

    def methods(self) -> list[algorithms.Algorithm]:
        """The presets named by ``algorithms``."""
        return [algorithms.get(name) for name in self.algorithms]

    def train_config(self) -> training.TrainConfig:
        """The library's settings of the step: the batch, Adam at ``learning_rate`` for the
        policy and the critic, and the reference kept for the ``kl_to_ref`` metric."""
        return training.TrainConfig(
            num_prompts=self.num_prompts,
            group_size=self.group_size,
            sampling=sampling.SamplingConfig(max_new_tokens=self.max_new_tokens),
            optimizer=training.OptimizerConfig(
                learning_rate=self.learning_rate, critic_learning_rate=self.learning_rate, warmup_steps=1
            ),
            seed=self.seed,
            reference_metrics=True,
        )


# --- Model ----------------------------------------------------------------------------------


def init_mlp(key: jax.Array, *, hidden: int, max_len: int, outputs: int) -> Params:
    """An MLP over summed embeddings of (a, b, position, previous token)."""
    keys = jax.random.split(key, 6)
    scale = 1.0 / np.sqrt(hidden)
    return {
        "embed_a": jax.random.normal(keys[0], (NUM_DIGITS, hidden)),
        "embed_b": jax.random.normal(keys[1], (NUM_DIGITS, hidden)),
        "embed_pos": jax.random.normal(keys[2], (max_len, hidden)),
        "embed_prev": jax.random.normal(keys[3], (VOCAB + 1, hidden)),
        "w_hidden": jax.random.normal(keys[4], (hidden, hidden)) * scale,
        "b_hidden": jnp.zeros((hidden,)),
        "w_out": jax.random.normal(keys[5], (hidden, outputs)) * scale * 0.1,
        "b_out": jnp.zeros((outputs,)),
    }


def features(params: Params, a: jax.Array, b: jax.Array, pos: jax.Array, prev: jax.Array) -> jax.Array:
    """``[...]`` integer inputs -> ``[..., hidden]``: what the output layer reads."""
    x = params["embed_a"][a] + params["embed_b"][b] + params["embed_pos"][pos] + params["embed_prev"][prev]
    leading = (1,) * (x.ndim - 1)  # biases broadcast over the leading axes explicitly
    return jnp.tanh(jnp.tanh(x) @ params["w_hidden"] + params["b_hidden"].reshape(*leading, -1))


def output(h: jax.Array, head: Params) -> jax.Array:
    """``[..., hidden] -> [..., outputs]`` with the output layer ``head`` (``w_out``, ``b_out``)."""
    leading = (1,) * (h.ndim - 1)
    return h @ head["w_out"] + head["b_out"].reshape(*leading, -1)


def mlp(params: Params, a: jax.Array, b: jax.Array, pos: jax.Array, prev: jax.Array) -> jax.Array:
    """``[...]`` integer inputs -> ``[..., outputs]``."""
    return output(features(params, a, b, pos, prev), params)


def teacher_forced_features(params: Params, prompts: jax.Array, tokens: jax.Array) -> jax.Array:
    """Features at every position of given completions: ``[B, 2], [B, T] -> [B, T, hidden]``."""
    batch, length = tokens.shape
    prev = jnp.concatenate([jnp.full((batch, 1), BOS), tokens[:, :-1]], axis=1)  # [B, T]
    pos = jnp.broadcast_to(jnp.arange(length)[None, :], (batch, length))  # [B, T]
    a = jnp.broadcast_to(prompts[:, :1], (batch, length))
    b = jnp.broadcast_to(prompts[:, 1:], (batch, length))
    return features(params, a, b, pos, prev)


@dataclasses.dataclass(frozen=True)
class MLPTeacherForcing:
    """How the library's train step reads the MLP policy and critic
    (:class:`jaxrl_llm.training.losses.TeacherForcing`). A batch's prompts are its ``[P, 2]``
    digit pairs, row ``b`` of the completions continuing prompt ``b // G``."""

    def states(self, params: Params, rows) -> jax.Array:
        group = rows.completion_tokens.shape[0] // rows.prompt_tokens.shape[0]
        prompts = jnp.repeat(rows.prompt_tokens, group, axis=0)  # [b, 2]
        return teacher_forced_features(params, prompts, rows.completion_tokens)  # [b, T, hidden]

    def head(self, params: Params) -> Params:
        return {"w_out": params["w_out"], "b_out": params["b_out"]}

    def logprobs(self, states: jax.Array, head: Params, rows, *, with_entropy: bool = False):
        logits = output(states, head)  # [b, T, V]
        logp = ops.token_logprobs(logits, rows.completion_tokens)
        return (logp, ops.entropy(logits)) if with_entropy else logp

    def categorical_kl(self, states: jax.Array, head: Params, other_states: jax.Array, other_head: Params) -> jax.Array:
        return kl.categorical(output(states, head), output(other_states, other_head))

    def values(self, critic_params: Params, rows) -> jax.Array:
        return output(self.states(critic_params, rows), critic_params)[..., 0]  # [b, T]


class Rollout(NamedTuple):
    tokens: jax.Array  # [B, T] int32, EOS-terminated, then padded with EOS
    mask: jax.Array  # [B, T] float32, 1 up to and including the first EOS
    logp: jax.Array  # [B, T] float32, log-probs under the sampling policy
    lengths: jax.Array  # [B] int32


def sample(params: Params, prompts: jax.Array, key: jax.Array, *, max_len: int) -> Rollout:
    """Autoregressive sampling at temperature 1, one ``lax.scan`` step per token."""
    batch = prompts.shape[0]

    def step(carry, inputs):
        prev, done = carry  # [B], [B]
        pos, step_key = inputs
        logits = mlp(params, prompts[:, 0], prompts[:, 1], jnp.full((batch,), pos), prev)  # [B, V]
        token = jax.random.categorical(step_key, logits).astype(jnp.int32)
        token = jnp.where(done, EOS, token)
        logp = jax.nn.log_softmax(logits)[jnp.arange(batch), token]
        valid = ~done
        return (token, done | (token == EOS)), (token, valid, logp)

    init = (jnp.full((batch,), BOS, jnp.int32), jnp.zeros((batch,), bool))
    _, (tokens, valid, logp) = jax.lax.scan(step, init, (jnp.arange(max_len), jax.random.split(key, max_len)))
    mask = valid.T.astype(jnp.float32)  # [T, B] -> [B, T]
    return Rollout(tokens=tokens.T, mask=mask, logp=logp.T * mask, lengths=mask.sum(1).astype(jnp.int32))


def rewards_of(prompts: jax.Array, rollout: Rollout) -> jax.Array:
    """1 for the right digit first, +0.5 for EOS right after it. ``-> [B]`` float32."""
    answer = (prompts[:, 0] + prompts[:, 1]) % NUM_DIGITS
    correct = rollout.tokens[:, 0] == answer
    stops = rollout.tokens[:, 1] == EOS if rollout.tokens.shape[1] > 1 else jnp.ones_like(correct)
    return correct.astype(jnp.float32) + 0.5 * (correct & stops).astype(jnp.float32)


# --- Train step -------------------------------------------------------------------------------


def init_state(config: ToyConfig, algorithm: algorithms.Algorithm) -> tuple[training.TrainState, training.FixedParams]:
    """The library's train state of the MLP policy (and its critic), from ``config.seed``, and
    its fixed params (the reference: the initial policy)."""
    # Three independent keys: initial weights drawn from the rollouts' key stream would be
    # correlated with the first prompts and samples.
    policy_key, critic_key, run_key = jax.random.split(jax.random.key(config.seed), 3)
    params = init_mlp(policy_key, hidden=config.hidden, max_len=config.max_new_tokens, outputs=VOCAB)
    critic = init_mlp(critic_key, hidden=config.hidden, max_len=config.max_new_tokens, outputs=1)
    state = training.init_state(None, params, algorithm, config.train_config(), critic_params=critic)
    return state._replace(key=run_key), training.fixed_params(params, algorithm, config.train_config())


def make_train_step(config: ToyConfig, algorithm: algorithms.Algorithm):
    """The pure step ``(state, fixed) -> (state, metrics)`` of one method: the toy's rollout
    and rewards, then the library's ``score`` and ``update``."""
    num_prompts, group, length = config.num_prompts, config.group_size, config.max_new_tokens
    step = training.make_train_step(MLPTeacherForcing(), algorithm, config.train_config())

    def train_step(
        state: training.TrainState, fixed: training.FixedParams
    ) -> tuple[training.TrainState, dict[str, jax.Array]]:
        prompt_key, sample_key = jax.random.split(training.state.rollout_key(state))
        prompts = jax.random.randint(prompt_key, (num_prompts, 2), 0, NUM_DIGITS)  # [P, 2]
        rows_prompts = jnp.repeat(prompts, group, axis=0)  # [B = P * G, 2], groups adjacent
        rollout = sample(state.params, rows_prompts, sample_key, max_len=length)
        mask = rollout.mask > 0
        task_rewards = rewards_of(rows_prompts, rollout)  # [B]
        rewards = task_rewards  # what the advantages see: plus DAPO's shaping, if any
        if algorithm.dynamic_sampling:
            # DAPO's filter, as in `training.collect`: a group whose *task* rewards are all
            # equal carries no signal (the overlong shaping does not count). Its rows become
            # padding (all-False mask) before the advantages, so they change no loss and no
            # token statistic; this toy does not refill the batch, the LM trainer does.
            grouped = task_rewards.reshape(num_prompts, group)
            informative = jnp.repeat(jnp.max(grouped, 1) > jnp.min(grouped, 1), group)  # [B]
            mask = mask & informative[:, None]
        if algorithm.overlong_buffer:
            rewards = rewards + overlong_penalty(
                rollout.lengths, max_len=length, buffer=algorithm.overlong_buffer, penalty=algorithm.overlong_penalty
            )
        batch = training.Batch(
            prompt_tokens=prompts,
            prompt_mask=jnp.ones(prompts.shape, bool),
            completion_tokens=rollout.tokens,
            completion_mask=mask,
            sampling_logp=rollout.logp,
            rewards=rewards,
            prompts_drawn=jnp.asarray(num_prompts, jnp.int32),
        )
        scored, score_metrics = step.score(state, fixed, batch)
        state, metrics = step.update(state, fixed, scored)
        policy = MLPTeacherForcing()
        new_logits = output(policy.states(state.params, batch), state.params)
        ref_logits = output(policy.states(fixed.reference, batch), fixed.reference)
        metrics.update(
            score_metrics,
            reward=jnp.mean(task_rewards),
            trained_rows=jnp.sum(jnp.any(mask, axis=1)),  # B, or fewer when dynamic sampling drops groups
            length=jnp.mean(rollout.lengths.astype(jnp.float32)),
            kl_to_ref=ops.masked_mean(kl.categorical(new_logits, ref_logits), rollout.mask > 0),
        )
        return state, metrics

    return train_step


def greedy_accuracy(params: Params, *, max_len: int) -> float:
    """Fraction of all 100 prompts answered exactly (right digit, then EOS) greedily."""
    a, b = jnp.meshgrid(jnp.arange(NUM_DIGITS), jnp.arange(NUM_DIGITS), indexing="ij")
    prompts = jnp.stack([a.ravel(), b.ravel()], axis=1)
    prev = jnp.full((prompts.shape[0],), BOS)
    tokens = []
    for pos in range(min(max_len, 2)):
        logits = mlp(params, prompts[:, 0], prompts[:, 1], jnp.full_like(prev, pos), prev)
        prev = jnp.argmax(logits, axis=-1)
        tokens.append(prev)
    answer = (prompts[:, 0] + prompts[:, 1]) % NUM_DIGITS
    exact = tokens[0] == answer
    if len(tokens) > 1:
        exact = exact & (tokens[1] == EOS)
    return float(jnp.mean(exact))


def train(config: ToyConfig, algorithm: algorithms.Algorithm) -> dict[str, Any]:
    """Trains one method; returns its reward curve and final numbers."""
    fitted = training.fit_overlong_buffer(algorithm, config.max_new_tokens)  # DAPO's 20% of its budget
    if fitted.overlong_buffer != algorithm.overlong_buffer:
        print(
            f"  ({algorithm.name}: overlong_buffer {algorithm.overlong_buffer} -> {fitted.overlong_buffer} tokens "
            f"for a {config.max_new_tokens}-token budget)"
        )
        algorithm = fitted
    state, fixed = init_state(config, algorithm)
    step = make_train_step(config, algorithm)
    traces = 0

    def counted_step(
        state: training.TrainState, fixed: training.FixedParams
    ) -> tuple[training.TrainState, dict[str, jax.Array]]:
        nonlocal traces
        traces += 1  # Python runs only while JAX traces
        return step(state, fixed)

    step_fn = jax.jit(counted_step, donate_argnums=0)
    initial_accuracy = greedy_accuracy(state.params, max_len=config.max_new_tokens)
    history = []
    start = time.perf_counter()
    for _ in range(config.steps):
        state, metrics = step_fn(state, fixed)
        history.append(jax.device_get(metrics))
    seconds = time.perf_counter() - start
    # Counted where the step is traced: the size of the jit's executable cache is only a proxy.
    assert traces == 1, f"the train step must trace once, traced {traces} times"
    rewards = np.array([m["reward"] for m in history])
    window = max(1, min(10, config.steps // 5))
    return {
        "algorithm": algorithm.name,
        "rewards": rewards,
        "reward_start": float(rewards[:window].mean()),
        "reward_end": float(rewards[-window:].mean()),
        "accuracy_start": initial_accuracy,
        "accuracy_end": greedy_accuracy(state.params, max_len=config.max_new_tokens),
        "kl_to_ref": float(history[-1]["kl_to_ref"]),
        "seconds": seconds,
        "history": history,
        "final_metrics": history[-1],
        "state": state,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    header = f"{'method':<20} {'reward start':>12} {'reward end':>10} {'greedy acc':>14} {'KL(ref)':>8} {'time':>7}"
    lines = [header, "-" * len(header)]
    for r in results:
        accuracy = f"{r['accuracy_start']:.2f} -> {r['accuracy_end']:.2f}"
        lines.append(
            f"{r['algorithm']:<20} {r['reward_start']:>12.3f} {r['reward_end']:>10.3f} {accuracy:>14} "
            f"{r['kl_to_ref']:>8.3f} {r['seconds']:>6.1f}s"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> ToyConfig:
    """The config from command-line flags (``--help`` lists them). A bad value ends the
    program with tyro's message and exit status 2, before any compute."""
    return tyro.cli(ToyConfig, args=argv, description=__doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    config = parse(argv)
    print(
        f"toy digits: P={config.num_prompts} prompts x G={config.group_size} completions, "
        f"{config.steps} steps per method, seed {config.seed}"
    )
    results = []
    for method in config.methods():
        results.append(train(config, method))
        r = results[-1]
        print(
            f"  {r['algorithm']:<20} reward {r['reward_start']:.3f} -> {r['reward_end']:.3f}  ({r['seconds']:.1f}s)",
            flush=True,
        )
    print()
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
