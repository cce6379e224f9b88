r"""The train state and the two jitted halves of a train step: ``score`` and ``update``.

After the rollout and the host's rewards, a train step is

1. ``score(state, batch) -> (scored, metrics)``: log-probs under the reference (when the
   method or a metric needs it) and, only when they can differ from the sampler's, under
   the old params; the critic's values; the advantages
   (:func:`jaxrl_llm.algorithms.compute_advantages`) and the running baseline after them;
2. ``update(state, scored) -> (state, metrics)``: ``num_iterations`` passes over shuffled
   minibatches in one ``lax.scan`` of optax steps (or one TRPO natural-gradient step),
   plus the critic's steps for PPO. The state is donated, except its reference: a state
   from :func:`~jaxrl_llm.training.train` holds the caller's params as its reference
   (not a copy), so donate ``state._replace(ref_params=None)`` as ``train`` does
   (``update`` never reads the reference).

Both are pure functions built once per run by :func:`make_train_step` and jitted once.
Every change to the state happens inside them: the next PRNG key (the rollout draws
from :func:`rollout_key`), the running baseline, the prompts consumed, the optimizer's
step, so a step is a function of ``(state, batch)`` alone.

**The batch** carries each of its ``P`` prompts once, ``[P, S]``, beside the ``B = P G``
completions ``[B, N]``: row ``b`` continues prompt ``b // G``. Split over devices, a
group stays with its prompt.

**Old log-probs.** With ``num_iterations = 1`` and one minibatch, the single gradient is
taken at the params that sampled the batch, so :math:`\log\pi_{old} = \operatorname{sg}
(\log\pi_\theta)`: the ratio is exactly 1 and no old-policy forward pass is paid for.
Otherwise ``score`` recomputes them at the snapshot (the same teacher-forced path as the
update, so the first minibatch's ratios are exactly 1 too).

**Shared prompts.** With ``TrainConfig.share_prompts``, every teacher-forced pass over
whole groups (``score``'s, the update's when its (micro-)batches hold whole groups,
TRPO's) runs each prompt once for its ``G`` completions
(:func:`jaxrl_llm.models.group_completion_hidden_states`). Shuffled minibatches mix
groups: each of their rows runs its own prompt.

**Gradient accumulation.** With ``TrainConfig.micro_batch_size``, each optimizer step's
gradient is the sum of its micro-batches' gradients weighted by their share of the
loss's normaliser (:func:`jaxrl_llm.ops.aggregation_count`): the whole minibatch's
gradient, for a fraction of its activations' memory.

**Non-finite updates.** A minibatch whose loss, gradient or new parameters (policy's or
critic's) would not all be finite changes nothing: params and optimizer states keep their
values (a ``lax.cond`` whose other branch is the identity) and ``skipped_updates`` counts
it; TRPO keeps its params when no finite candidate passes the line search. So the state
only ever holds finite params. ``consecutive_skips`` counts the train steps in a row with
at least one skipped minibatch; the loop stops when that reaches
``TrainConfig.max_consecutive_skips``.

**Precision.** Optimizer moments, hyperparameters and updates are float32 whatever the
parameters' dtype, and low-precision params take their steps on float32 master copies
kept in the optimizer state (:func:`in_float32`).

**The reference** is kept and run only when it is used (:func:`uses_reference`): by the
method's KL term (in the loss or the reward), or by the metrics
``TrainConfig.reference_metrics`` (``kl_k3``) and ``TrainConfig.exact_kl``
(``kl_exact``: :math:`D_{KL}(\pi_{old}\|\pi_{ref})` over the vocabulary, chunked, once
per step in ``score``). Otherwise ``state.ref_params`` is ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _checks, algorithms, distributed, models, objectives, ops, sharding, trpo
from jaxrl_llm import advantages as adv_lib, kl as kl_lib
from jaxrl_llm.training import critic as critic_lib
from jaxrl_llm.training.config import LR_SCHEDULES, TrainConfig

Metrics = dict[str, jax.Array]


class TrainState(NamedTuple):
    """Everything a run carries between steps; a pytree (checkpointable, shardable)."""

    params: models.Params
    opt_state: Any  # optax state of the policy; () for TRPO, which has none
    ref_params: models.Params | None  # frozen: the initial policy by default (train: the caller's arrays, never
    # donated); None when unused
    critic_params: critic_lib.CriticParams | None  # methods with GAE only
    critic_opt_state: Any
    baseline: adv_lib.RunningMeanState
    key: jax.Array  # PRNG key for rollouts and minibatch shuffles
    step: jax.Array  # [] int32: train steps (rollout batches) done
    skipped_updates: jax.Array  # [] int32: non-finite minibatch updates skipped in all
    consecutive_skips: jax.Array  # [] int32: train steps in a row with a skipped update
    prompts_drawn: jax.Array  # [] int32: positions of the task's train stream consumed (tasks.draw)


class Batch(NamedTuple):
    """A rollout batch with its rewards, as ``score`` consumes it: ``P`` prompts, each
    carried once, and their ``G`` completions (``B = P * G``, row ``b`` of prompt ``b // G``)."""

    prompt_tokens: jax.Array  # [P, S] int32, left-padded
    prompt_mask: jax.Array  # [P, S] bool: real prompt tokens
    completion_tokens: jax.Array  # [B, N] int32
    completion_mask: jax.Array  # [B, N] bool: tokens that enter the loss
    sampling_logp: jax.Array  # [B, N] float32: log pi_T of the sampler (Rollout.logprobs)
    rewards: jax.Array  # [B] float32
    prompts_drawn: jax.Array  # [] int32: prompts taken from the task's stream for it (refills included)

    @classmethod
    def from_rollout(cls, prompt_tokens: jax.Array, prompt_mask: jax.Array, rollout, rewards: jax.Array, *,
                     prompts_drawn: int | None = None) -> Batch:
        """The batch of a :class:`jaxrl_llm.sampling.Rollout` of ``prompt_tokens`` /
        ``prompt_mask`` ``[P, S]`` with its ``rewards`` ``[B]``; ``prompts_drawn``
        defaults to ``P``."""
        num_prompts = prompt_tokens.shape[0]
        return cls(prompt_tokens=jnp.asarray(prompt_tokens), prompt_mask=jnp.asarray(prompt_mask, bool),
                   completion_tokens=jnp.asarray(rollout.completion_tokens),
                   completion_mask=jnp.asarray(rollout.completion_mask), sampling_logp=jnp.asarray(rollout.logprobs),
                   rewards=jnp.asarray(rewards, jnp.float32),
                   prompts_drawn=jnp.asarray(num_prompts if prompts_drawn is None else prompts_drawn, jnp.int32))


class ScoredBatch(NamedTuple):
    """A batch with everything ``update`` needs; ``None`` fields are not used by the run."""

    prompt_tokens: jax.Array  # [P, S] int32
    prompt_mask: jax.Array  # [P, S] bool
    completion_tokens: jax.Array  # [B, N] int32
    completion_mask: jax.Array  # [B, N] bool
    old_logp: jax.Array  # [B, N] float32: log pi_old (the sampler's when on-policy)
    ref_logp: jax.Array | None  # [B, N] float32; None without a reference
    advantages: jax.Array  # [B] or [B, N] float32
    returns: jax.Array | None  # [B, N] float32: the critic's targets (GAE)
    old_values: jax.Array | None  # [B, N] float32: the critic's values at scoring time
    baseline: adv_lib.RunningMeanState  # the running baseline after this batch
    prompts_drawn: jax.Array  # [] int32


_PROMPT_FIELDS = ("prompt_tokens", "prompt_mask")
_ROW_FIELDS = ("completion_tokens", "completion_mask", "old_logp", "ref_logp", "advantages", "returns", "old_values")


def _each_row_its_prompt(scored: ScoredBatch, rows: jax.Array) -> ScoredBatch:
    """The rows ``rows`` ``[b]`` of ``scored``, each with its own copy of its prompt
    (``P = b``): shuffled minibatches mix groups."""
    group = scored.completion_tokens.shape[0] // scored.prompt_tokens.shape[0]
    return scored._replace(
        **{name: getattr(scored, name)[rows // group] for name in _PROMPT_FIELDS},
        **{name: getattr(scored, name)[rows] for name in _ROW_FIELDS if getattr(scored, name) is not None})


def _split_rows(scored: ScoredBatch, parts: int) -> ScoredBatch:
    """``scored`` cut into ``parts`` consecutive micro-batches: every row and prompt field
    gets a leading ``[parts]`` axis. Micro-batches that would split a group carry a prompt
    per row."""
    num_prompts, batch = scored.prompt_tokens.shape[0], scored.completion_tokens.shape[0]
    group = batch // num_prompts
    if (batch // parts) % group:
        scored = scored._replace(**{name: jnp.repeat(getattr(scored, name), group, axis=0)
                                    for name in _PROMPT_FIELDS})
    split = {name: getattr(scored, name).reshape(parts, -1, *getattr(scored, name).shape[1:])
             for name in (*_PROMPT_FIELDS, *_ROW_FIELDS) if getattr(scored, name) is not None}
    return scored._replace(**split, baseline=None, prompts_drawn=None)  # the batch's, not the rows'


def batch_shardings(mesh: jax.sharding.Mesh) -> Batch:
    """Where a :class:`Batch` goes on ``mesh``: completions split by rows over ``data x
    fsdp``, prompts over ``data`` (a device's rows continue prompts of its ``data`` slice),
    the count replicated."""
    rows = distributed.rows_sharding(mesh)
    prompts = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(sharding.DATA if sharding.DATA in mesh.axis_names else None))
    return Batch(prompt_tokens=prompts, prompt_mask=prompts, completion_tokens=rows, completion_mask=rows,
                 sampling_logp=rows, rewards=rows, prompts_drawn=sharding.replicated(mesh))


def uses_reference(algorithm: algorithms.Algorithm, config: TrainConfig) -> bool:
    """Whether the run keeps and runs the reference model: for the method's KL term (in
    the loss or the reward) or for the KL metrics the config asks for."""
    return algorithm.needs_reference or config.reference_metrics or config.exact_kl


def rollout_key(state: TrainState) -> jax.Array:
    """The PRNG key the step's rollouts draw from; ``update`` moves ``state.key`` past it."""
    return jax.random.split(state.key)[1]


def learning_rate_schedule(*, learning_rate: float, warmup_steps: int, lr_schedule: str = "constant",
                           decay_steps: int | None = None, end_learning_rate_fraction: float = 0.0) -> optax.Schedule:
    r"""The learning rate of optimizer step ``k`` (from 0): a linear warm-up to the peak
    :math:`\eta` over ``warmup_steps`` :math:`W`, then ``lr_schedule`` down to
    :math:`f\eta` (``f = end_learning_rate_fraction``) over ``decay_steps`` :math:`D`:

    .. math::
        \eta_k = \eta \frac{k + 1}{W} \quad (k < W), \qquad
        \eta_k = \eta \left[f + (1 - f)\, d\!\left(\frac{\min(k - W + 1,\ D)}{D}\right)\right]
        \quad (k \ge W - 1)

    with :math:`d(x) = 1` (``"constant"``, which ignores ``D`` and ``f``), :math:`1 - x`
    (``"linear"``) or :math:`(1 + \cos \pi x) / 2` (``"cosine"``). The warm-up starts at
    :math:`\eta / W`, not 0 (a first step of rate 0 would do nothing), and peaks at its
    last step :math:`W - 1`, where the decay starts; the decay's end value is reached at
    step :math:`W - 1 + D` and kept after it. Built from optax's schedules. ``k`` counts
    the steps taken: a skipped update (non-finite, or a minibatch without tokens) takes none.
    """
    _checks.one_of("learning_rate_schedule", "lr_schedule", lr_schedule, LR_SCHEDULES)
    warmup = optax.linear_schedule(learning_rate / warmup_steps, learning_rate, warmup_steps - 1)
    if lr_schedule == "constant":
        return warmup  # stays at the peak after its last step
    if decay_steps is None:
        raise ValueError(f"learning_rate_schedule: lr_schedule={lr_schedule!r} decays over `decay_steps` optimizer "
                         "steps; got None. Set TrainConfig.decay_steps, or pass the run's length to "
                         "make_train_step(..., total_steps=).")
    _checks.positive_int("learning_rate_schedule", "decay_steps", decay_steps)
    end = end_learning_rate_fraction * learning_rate
    decay = (optax.linear_schedule(learning_rate, end, decay_steps) if lr_schedule == "linear" else
             optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=end_learning_rate_fraction))
    return optax.join_schedules([warmup, decay], boundaries=[warmup_steps - 1])


def _matrices(params):
    """Weight decay's mask: the weight matrices (embeddings, projections), not the norms'
    scales or the biases, whatever their rank (Qwen2's q/k/v biases are ``[heads, head_dim]``)."""

    def decayed(path, param) -> bool:
        names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
        name = next((n for n in reversed(names) if n and n != "value"), "")  # nnx leaves end in `.value`
        return param.ndim >= 2 and not name.endswith("bias") and "norm" not in name

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(*, learning_rate: float, warmup_steps: int, max_grad_norm: float, lr_schedule: str = "constant",
                   decay_steps: int | None = None, end_learning_rate_fraction: float = 0.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> optax.GradientTransformation:
    r"""Global-norm clipping to ``max_grad_norm``, then AdamW at the rate of
    :func:`learning_rate_schedule`, all in float32 whatever the parameters' dtype, with
    float32 master weights for low-precision params (:func:`in_float32`).

    With the clipped gradient :math:`g` and :math:`\eta_k` the step's rate (``k`` from 0):

    .. math::
        m &\leftarrow \beta_1 m + (1 - \beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2, \\
        \theta &\leftarrow \theta - \eta_k \left(\frac{m / (1 - \beta_1^{k+1})}
        {\sqrt{v / (1 - \beta_2^{k+1})} + \epsilon} + \lambda\, \theta\right)

    The decoupled weight decay :math:`\lambda` (``weight_decay``) applies to params with
    two or more axes (matrices, embeddings), as in GPT-2 and Hugging Face's ``Trainer``:
    decaying norm scales and biases towards 0 is not wanted.

    The rate in use is the state's ``learning_rate`` hyperparameter (``inner[1].hyperparams``).
    It also holds ``b1``, ``b2``, ``eps`` and ``weight_decay`` (optax's ``inject_hyperparams``),
    but every update uses the values given here, so a state restored from a checkpoint
    takes the current settings.
    """
    schedule = learning_rate_schedule(learning_rate=learning_rate, warmup_steps=warmup_steps,
                                      lr_schedule=lr_schedule, decay_steps=decay_steps,
                                      end_learning_rate_fraction=end_learning_rate_fraction)
    settings = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    adamw = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32, static_args=("mask",))(
        learning_rate=schedule, mask=_matrices, **settings)

    def update(updates, state, params=None):
        return adamw.update(updates, state._replace(hyperparams={**state.hyperparams, **settings}), params)

    return in_float32(optax.chain(optax.clip_by_global_norm(max_grad_norm),
                                  optax.GradientTransformation(adamw.init, update)))


class Float32State(NamedTuple):
    """The state of :func:`in_float32`."""

    inner: Any  # the wrapped optimizer's state, float32
    master: Any  # float32 master copies of the low-precision params; None at float32 params


def _is_none(x) -> bool:
    return x is None


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    r"""``inner`` run in float32, with float32 master weights for low-precision params.

    Optimizer state takes its dtype from the params it is initialised with, so bfloat16
    params would get bfloat16 moments and hyperparameters: :math:`\beta_2 = 0.999` rounds
    to 1, the bias correction :math:`1 - \beta_2^t` is 0 and the first update 0/0. And a
    bfloat16 weight cannot take a step under half its unit in the last place (about
    :math:`4 \cdot 10^{-3}` of its size): at RL's learning rates most steps would round
    away. So ``inner`` sees float32 gradients and float32 params, its state is float32,
    and every parameter of a narrower float dtype has a float32 master copy :math:`m` in
    the state (:class:`Float32State`) that takes the steps:

    .. math::
        m' = m + u, \qquad \theta' = \operatorname{round}(m')

    The updates returned are :math:`\operatorname{round}(m') - \theta`, so
    ``optax.apply_updates`` lands on :math:`\operatorname{round}(m')` exactly. Float32
    (and wider) params have no master copy: nothing changes for them. A bfloat16 parameter costs 4
    more bytes in the optimizer state (the master) besides its two float32 moments.
    """
    def to_float32(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        master = jax.tree.map(
            lambda p: p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) and jnp.finfo(p.dtype).bits < 32
            else None, params)
        return Float32State(inner=inner.init(to_float32(params)), master=master)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("in_float32: `params` are required (low-precision params take their steps on float32 "
                             "master copies).")
        full = jax.tree.map(lambda master, p: p if master is None else master, state.master, params,
                            is_leaf=_is_none)  # the params at full precision
        steps, inner_state = inner.update(to_float32(grads), state.inner, full)
        master = jax.tree.map(lambda master, u: None if master is None else master + u, state.master, steps,
                              is_leaf=_is_none)
        updates = jax.tree.map(  # round(m') - theta, exact in float32
            lambda master, u, p: u if master is None else master.astype(p.dtype).astype(jnp.float32) - p.astype(
                jnp.float32), master, steps, params, is_leaf=_is_none)
        return updates, Float32State(inner=inner_state, master=master)

    return optax.GradientTransformation(init, update)


def _copy(tree):
    # The update donates the state, so the state must own its buffers: the caller's
    # params stay valid, and the critic is a separate copy.
    return jax.tree.map(jnp.copy, tree)


def init_state(model: models.Model, params: models.Params, algorithm: algorithms.Algorithm, config: TrainConfig,
               *, ref_params: models.Params | None = None, copy_reference: bool = True) -> TrainState:
    """The state at step 0: policy and reference copied from ``params`` (or the given
    ``ref_params``), a critic initialised from the policy when the method has one. The
    reference is ``None`` when the run does not use one (:func:`uses_reference`); then
    ``ref_params`` must not be given.

    ``copy_reference=False`` makes the reference ``ref_params`` (or ``params``) itself,
    not a copy: one params-sized buffer less (2 GB at 0.5B parameters in float32). Then
    whatever donates the state must leave the reference out, as :func:`train` does
    (``update`` never reads it); donating it would delete the caller's arrays."""
    # The state does not depend on when the decay ends (its step-0 rate is the warm-up's).
    policy_optimizer, critic_optimizer = _optimizers(algorithm, config, decay_steps=1)
    critic_params = critic_lib.init_critic(model, params) if algorithm.needs_critic else None
    with_reference = uses_reference(algorithm, config)
    if ref_params is not None and not with_reference:
        raise ValueError(f"init_state: `ref_params` given, but algorithm {algorithm.name!r} has no KL term "
                         "(kl_coef = kl_reward_coef = 0) and no KL metric is asked for; set "
                         "TrainConfig.reference_metrics=True (kl_k3) or exact_kl=True to measure the KL to it.")
    reference = None
    if with_reference:
        reference = params if ref_params is None else ref_params
        reference = _copy(reference) if copy_reference else jax.tree.map(jnp.asarray, reference)
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731 (one buffer each: the state is donated)
    return TrainState(
        params=_copy(params),
        opt_state=policy_optimizer.init(params) if policy_optimizer else (),
        ref_params=reference,
        critic_params=critic_params,
        critic_opt_state=critic_optimizer.init(critic_params) if critic_params is not None else None,
        baseline=adv_lib.running_mean_init(),
        key=jax.random.key(config.seed),
        step=zero(), skipped_updates=zero(), consecutive_skips=zero(), prompts_drawn=zero(),
    )


def state_shardings(state: TrainState, algorithm: algorithms.Algorithm, config: TrainConfig,
                    mesh: jax.sharding.Mesh, rules: sharding.Rules) -> TrainState:
    """The ``NamedSharding`` of every leaf of ``state`` on ``mesh`` by ``rules``
    (:func:`jaxrl_llm.sharding.state_shardings` with the run's optimizers)."""
    policy, critic = _optimizers(algorithm, config, decay_steps=1)  # the state's structure only
    return sharding.state_shardings(state, mesh, rules, optimizer=policy, critic_optimizer=critic)


def check_params(model: models.Model, params: models.Params, *, name: str = "params") -> None:
    """Raises ValueError naming the first parameter whose path or shape is not the model's."""
    _check_tree(name, params, models.abstract(model.config)[1], "the model's config", dtypes=False,
                advice="Are they the params of another model?")


def check_state(state: TrainState, model: models.Model, params: models.Params, algorithm: algorithms.Algorithm,
                config: TrainConfig) -> None:
    """Raises ValueError, naming the first field, path, shape or dtype that differs, when
    ``state`` is not a state of this run: made for another method (a critic or an
    optimizer it lacks), another model size, or another optimizer."""
    if not isinstance(state, TrainState):
        raise ValueError(f"`state` must be a TrainState (from init_state or a previous train); got "
                         f"{type(state).__name__}.")
    expected = jax.eval_shape(lambda p: init_state(model, p, algorithm, config), params)
    for field in TrainState._fields:
        _check_tree(f"state.{field}", getattr(state, field), getattr(expected, field),
                    f"algorithm {algorithm.name!r} on this model", dtypes=True,
                    advice="Was the state made for another method, model or TrainConfig?")


def _check_tree(name: str, tree, expected, what: str, *, dtypes: bool, advice: str) -> None:
    """Raises ValueError at the first difference of structure, shape (or dtype) between
    ``tree`` and ``expected`` (abstract leaves)."""
    def describe(leaf) -> str:
        return f"{list(leaf.shape)}" + (f" {leaf.dtype}" if dtypes else "")

    if (tree is None) != (expected is None):
        needs = "has none" if expected is None else "needs one"
        raise ValueError(f"`{name}` is {'None' if tree is None else 'set'}, but {what} {needs}. {advice}")
    got_leaves, got_structure = jax.tree_util.tree_flatten_with_path(tree)
    want_leaves, want_structure = jax.tree_util.tree_flatten_with_path(expected)
    if got_structure != want_structure:
        got_paths = {jax.tree_util.keystr(path) for path, _ in got_leaves}
        want_paths = {jax.tree_util.keystr(path) for path, _ in want_leaves}
        if want_paths - got_paths:
            detail = f"it lacks {', '.join(sorted(want_paths - got_paths)[:3])}"
        elif got_paths - want_paths:
            detail = f"it has {', '.join(sorted(got_paths - want_paths)[:3])}, which {what} does not"
        else:
            detail = f"its structure is {got_structure}, not {want_structure}"
        raise ValueError(f"`{name}` does not fit {what}: {detail}. {advice}")
    for (path, got), (_, want) in zip(got_leaves, want_leaves):
        if got.shape != want.shape or (dtypes and got.dtype != want.dtype):
            raise ValueError(f"`{name}{jax.tree_util.keystr(path)}` is {describe(got)}, but {what} needs "
                             f"{describe(want)}. {advice}")


def _decay_steps(algorithm: algorithms.Algorithm, config: TrainConfig, total_steps: int | None) -> int | None:
    """``config.decay_steps``, or, when it is ``None`` and the schedule decays, the optimizer
    steps from the warm-up's last step to the run's last one:
    ``total_steps * num_iterations * num_minibatches - warmup_steps`` (at least 1: a run
    that ends within the warm-up never decays). ``None`` for ``"constant"`` and TRPO, which
    has no optax optimizer."""
    if total_steps is not None:
        _checks.nonnegative_int("make_train_step", "total_steps", total_steps)
    if config.decay_steps is not None or config.lr_schedule == "constant" or algorithm.update == "trpo":
        return config.decay_steps
    if total_steps is None:
        raise ValueError(
            f"make_train_step: TrainConfig.lr_schedule={config.lr_schedule!r} with decay_steps=None decays until "
            "the run's last step, but the run's length is unknown: pass total_steps=<the run's train steps> "
            "(train() does), or set TrainConfig.decay_steps.")
    optimizer_steps = total_steps * algorithm.num_iterations * config.num_minibatches
    return max(1, optimizer_steps - config.warmup_steps)


def _optimizers(algorithm, config, *, decay_steps):
    """The policy's optimizer (None for TRPO) and the critic's (None without one)."""
    def optimizer(learning_rate):
        return make_optimizer(
            learning_rate=learning_rate, warmup_steps=config.warmup_steps, max_grad_norm=config.max_grad_norm,
            lr_schedule=config.lr_schedule, decay_steps=decay_steps,
            end_learning_rate_fraction=config.end_learning_rate_fraction, weight_decay=config.weight_decay,
            b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)

    policy = None if algorithm.update == "trpo" else optimizer(config.learning_rate)
    critic = optimizer(config.critic_learning_rate) if algorithm.needs_critic else None
    return policy, critic


def check_supported(algorithm: algorithms.Algorithm, config: TrainConfig) -> None:
    """Raises if the run's settings cannot work together."""
    name = algorithm.name
    if algorithm.update == "trpo" and config.num_minibatches != 1:
        raise ValueError(
            f"Algorithm {name!r} takes one natural-gradient step on the whole batch: set "
            f"TrainConfig.minibatch_size=None (got {config.minibatch_size} of B={config.batch_size})."
        )
    if algorithm.update == "trpo" and config.micro_batch_size is not None:
        raise ValueError(f"Algorithm {name!r}: TRPO's conjugate gradient and line search take the whole batch at "
                         "once; gradient accumulation is not available: set TrainConfig.micro_batch_size=None.")
    if algorithm.update == "trpo" and algorithm.needs_critic:
        raise ValueError(f"Algorithm {name!r}: the TRPO update trains no critic, so GAE is not available with "
                         "update='trpo'; use a critic-free advantage (rloo, grpo, ...).")
    if config.group_size < 2 and algorithm.compares_within_groups:
        raise ValueError(
            f"Algorithm {name!r} compares each completion with the others sampled for its prompt (advantage="
            f"{algorithm.advantage!r}{', dynamic sampling' if algorithm.dynamic_sampling else ''}): with "
            "TrainConfig.group_size=1 every advantage is 0. Set group_size >= 2, or use a method without group "
            "baselines (pg, reinforce-baseline, ppo).")
    batch_statistics = algorithm.advantage in ("batch_mean_baseline", "running_mean_baseline") or (
        algorithm.advantage == "grpo" and algorithm.group_scale == "batch")
    if algorithm.dynamic_sampling and batch_statistics:
        raise ValueError(
            f"Algorithm {name!r}: dynamic sampling masks out groups without signal, but advantage="
            f"{algorithm.advantage!r} (group_scale={algorithm.group_scale!r}) takes statistics over every row of "
            "the batch, masked ones included; use a per-group estimator (rloo, or grpo with group_scale 'group' "
            "or 'none').")


def _step_is_finite(optimizer, grads, opt_state, params) -> jax.Array:
    """``[]`` bool: one step of ``optimizer`` would leave every parameter finite.

    The step is computed only to be checked and dropped: XLA fuses it into the reduction,
    and :func:`_apply_if` then takes it for real, in place. Checking the loss and the
    gradient is not enough: finite gradients can still give a non-finite update (a learning
    rate of inf, optimizer arithmetic that overflows or divides 0 by 0).
    """
    updates, _ = optimizer.update(grads, opt_state, params)
    return ops.all_finite(optax.apply_updates(params, updates))


def _apply_if(ok, optimizer, grads, opt_state, params):
    """One optimizer step if ``ok``, else params and optimizer state unchanged.

    A ``lax.cond``, not a ``jnp.where`` over the trees: the skipped branch is the
    identity, and the taken one updates the donated buffers in place (a select would
    keep the old state alive next to the new one, and XLA copies it).
    """
    def step(params_and_state):
        params, opt_state = params_and_state
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.lax.cond(ok, step, lambda params_and_state: params_and_state, (params, opt_state))


def _reduce(metrics: Metrics) -> Metrics:
    """Per-minibatch metrics ``[K]`` -> scalars: min of ``*_min``, max of ``*_max``, else mean."""
    def reduce(name, values):
        return jnp.min(values) if name.endswith("_min") else jnp.max(values) if name.endswith("_max") else jnp.mean(
            values)
    return {name: reduce(name, values) for name, values in metrics.items()}


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The pure halves of a train step for one (model, method, config); jit each once."""

    score: Callable[[TrainState, Batch], tuple[ScoredBatch, Metrics]]
    update: Callable[[TrainState, ScoredBatch], tuple[TrainState, Metrics]]


def _learning_rate(opt_state) -> jax.Array:
    """``[]``: the rate of the optimizer's last step, found by name in its state (optax's
    ``inject_hyperparams``), wherever the chain keeps it."""
    return optax.tree_utils.tree_get(opt_state, "learning_rate",
                                     filtering=lambda path, value: isinstance(value, jax.Array))


_LOSS_METRICS = ("loss", "policy_loss")
"""Metrics aggregated like the loss; the others are token means (:func:`ops.masked_mean`)."""


def _combine(metrics: Metrics, loss_weights: jax.Array, token_weights: jax.Array) -> Metrics:
    """Per-micro-batch metrics ``[k]`` -> the whole minibatch's: min of ``*_min``, max of
    ``*_max``, the loss weighted by its normaliser's shares (``loss_weights`` ``[k]``), the
    token means by the tokens' (``token_weights``); each set of weights sums to 1, or is 0."""
    def combine(name, values):
        if name.endswith("_min"):
            return jnp.min(values)
        if name.endswith("_max"):
            return jnp.max(values)
        weights = loss_weights if name in _LOSS_METRICS else token_weights
        return jnp.sum(values * weights.astype(values.dtype))
    return {name: combine(name, values) for name, values in metrics.items()}


def make_train_step(model: models.Model, algorithm: algorithms.Algorithm, config: TrainConfig, *,
                    total_steps: int | None = None) -> TrainStep:
    """Builds ``score`` and ``update`` (see the module docstring).

    ``total_steps``: the run's train steps (rollout batches), counted from step 0 (a
    resumed run counts those before it). A decaying ``config.lr_schedule`` with
    ``decay_steps=None`` ends its decay at the last optimizer step of the last of them,
    and raises ValueError without it.
    """
    check_supported(algorithm, config)
    a = algorithm
    policy_optimizer, critic_optimizer = _optimizers(a, config, decay_steps=_decay_steps(a, config, total_steps))
    num_steps = a.num_iterations * config.num_minibatches  # optimizer steps per batch
    on_policy = num_steps == 1  # the one gradient is taken at the sampling params
    whole_batch = config.num_minibatches == 1  # every optimizer step sees the batch, groups intact
    micro_batches = config.num_micro_batches
    with_reference = uses_reference(a, config)
    logprob_options = dict(chunk_size=config.chunk_size, temperature=config.temperature)

    def kernel(params) -> jax.Array:
        """The output projection as stored: a tied embedding stays ``[V, E]`` (no transposed copy)."""
        return models.output_kernel(model, params, as_stored=True)

    def tied() -> bool:  # then `kernel` is [V, E]
        return model.config.tie_word_embeddings

    def hidden_states(params, rows: Batch | ScoredBatch) -> jax.Array:
        """``[b, N, E]`` states before each completion token (each prompt once if shared)."""
        return models.group_completion_hidden_states(model, params, rows.prompt_tokens, rows.prompt_mask,
                                                     rows.completion_tokens, share_prompts=config.share_prompts)

    def token_logprobs(params, hidden, rows, **options):
        return ops.chunked_token_logprobs(hidden, kernel(params), rows.completion_tokens, transposed_kernel=tied(),
                                          **logprob_options, **options)

    def values(critic_params, rows) -> jax.Array:
        return critic_lib.completion_values(model, critic_params, rows.prompt_tokens, rows.prompt_mask,
                                            rows.completion_tokens, share_prompts=config.share_prompts)

    def score(state: TrainState, batch: Batch):
        mask = batch.completion_mask
        metrics = {}
        ref_logp = ref_hidden = policy_hidden = None
        if with_reference:
            ref_hidden = hidden_states(state.ref_params, batch)  # [B, N, E]
            ref_logp = token_logprobs(state.ref_params, ref_hidden, batch)
        if on_policy or a.update == "trpo" or not a.needs_old_logp:
            old_logp = batch.sampling_logp  # TRPO recomputes its own in `update`
        else:
            policy_hidden = hidden_states(state.params, batch)
            old_logp = token_logprobs(state.params, policy_hidden, batch)
        if config.exact_kl:
            if policy_hidden is None:
                policy_hidden = hidden_states(state.params, batch)
            per_token = ops.chunked_categorical_kl(policy_hidden, kernel(state.params), ref_hidden,
                                                   kernel(state.ref_params), transposed_kernels=tied(),
                                                   **logprob_options)  # [B, N]
            metrics["kl_exact"] = ops.masked_mean(per_token, mask)
        old_values = values(state.critic_params, batch) if a.needs_critic else None
        advantages, returns, baseline = algorithms.compute_advantages(
            a, batch.rewards, mask, group_size=config.group_size, logp=old_logp, ref_logp=ref_logp,
            values=old_values, baseline=state.baseline)
        token_advantages = jnp.broadcast_to(advantages.reshape(advantages.shape[0], -1), mask.shape)  # [B, N]
        metrics.update(
            advantage_mean=ops.masked_mean(token_advantages, mask),
            advantage_std=jnp.sqrt(ops.masked_mean(
                jnp.square(token_advantages - ops.masked_mean(token_advantages, mask)), mask)),
            advantage_min=ops.masked_min(token_advantages, mask),
            advantage_max=ops.masked_max(token_advantages, mask),
        )
        scored = ScoredBatch(
            prompt_tokens=batch.prompt_tokens, prompt_mask=batch.prompt_mask,
            completion_tokens=batch.completion_tokens, completion_mask=mask, old_logp=old_logp, ref_logp=ref_logp,
            advantages=advantages, returns=returns, old_values=old_values, baseline=baseline,
            prompts_drawn=batch.prompts_drawn)
        return scored, metrics

    def policy_loss(params, rows: ScoredBatch, old_logp=None):
        """``(loss, metrics)`` on some rows; ``old_logp`` overrides theirs."""
        n = rows.completion_tokens.shape[1]
        logp, entropy = token_logprobs(params, hidden_states(params, rows), rows, with_entropy=True)
        if old_logp is None:
            old_logp = jax.lax.stop_gradient(logp) if on_policy else rows.old_logp
        if a.entropy_coef == 0:
            entropy = jax.lax.stop_gradient(entropy)  # a metric only
        loss, metrics = algorithms.policy_loss(a, logp, old_logp, rows.advantages, rows.completion_mask,
                                               ref_logp=rows.ref_logp, entropy=entropy, max_len=n)
        if rows.ref_logp is not None and "kl_k3" not in metrics:  # the KL metric of every run with a reference
            metrics["kl_k3"] = ops.masked_mean(jax.lax.stop_gradient(kl_lib.k3(logp, rows.ref_logp)),
                                               rows.completion_mask)
        return loss, metrics

    def critic_loss(critic_params, rows: ScoredBatch):
        return objectives.value_loss(values(critic_params, rows), rows.old_values, rows.returns,
                                     rows.completion_mask, clip=a.value_clip)

    def gradients(params, critic_params, rows: ScoredBatch):
        """``((loss, metrics, grads), critic)`` of one optimizer step's rows, ``critic`` the
        critic's ``(loss, metrics, grads)`` or None, over ``micro_batches`` passes weighted
        by their share of each loss's normaliser (the value loss is a token mean)."""
        def one_pass(rows):
            (loss, metrics), grads = jax.value_and_grad(policy_loss, has_aux=True)(params, rows)
            if not a.needs_critic:
                return ((loss, metrics, grads),)
            (value_loss, critic_metrics), critic_grads = jax.value_and_grad(critic_loss, has_aux=True)(
                critic_params, rows)
            return (loss, metrics, grads), (value_loss, critic_metrics, critic_grads)

        if micro_batches == 1:
            results = one_pass(rows)
            return results[0], (results[1] if a.needs_critic else None)
        modes = (a.agg, "token-mean") if a.needs_critic else (a.agg,)  # the policy's, the critic's

        def share(part_mask, mode):  # the part's share of the minibatch's count
            return ops.aggregation_count(part_mask, mode=mode) / jnp.maximum(
                ops.aggregation_count(rows.completion_mask, mode=mode), 1.0)

        def accumulate(totals, part):
            results = one_pass(part)
            tokens = share(part.completion_mask, "token-mean")
            sums, outputs = [], []
            for (loss, metrics, grads), (loss_sum, grad_sum), mode in zip(results, totals, modes):
                weight = share(part.completion_mask, mode)
                sums.append((loss_sum + weight * loss,
                             jax.tree.map(lambda total, g: total + weight * g.astype(jnp.float32), grad_sum, grads)))
                outputs.append((metrics, weight, tokens))
            return tuple(sums), tuple(outputs)

        zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
        trees = (params, critic_params)[:len(modes)]
        totals = tuple((jnp.zeros((), jnp.float32), zeros(tree)) for tree in trees)
        sums, outputs = jax.lax.scan(accumulate, totals, _split_rows(rows, micro_batches))
        results = tuple((loss, _combine(metrics, weights, tokens), grads)
                        for (loss, grads), (metrics, weights, tokens) in zip(sums, outputs))
        return results[0], (results[1] if a.needs_critic else None)

    def update(state: TrainState, scored: ScoredBatch):
        key, _ = jax.random.split(state.key)  # the other half was the rollout's (rollout_key)
        state = state._replace(key=key, baseline=scored.baseline,
                               prompts_drawn=state.prompts_drawn + scored.prompts_drawn)
        if a.update == "trpo":
            return trpo_update(state, scored)
        key, shuffle_key = jax.random.split(state.key)
        batch_size = scored.completion_tokens.shape[0]
        if whole_batch:  # the rows' order changes no full-batch loss: keep the groups intact
            order = jnp.broadcast_to(jnp.arange(batch_size), (a.num_iterations, batch_size))  # [mu, B]
        else:
            keys = jax.random.split(shuffle_key, a.num_iterations)
            permutations = jax.vmap(lambda k: jax.random.permutation(k, batch_size))(keys)  # [mu, B]
            order = permutations.reshape(num_steps, -1)  # [mu * M, B / M]

        def one_minibatch(carry, indices):
            params, opt_state, critic_params, critic_opt_state, skipped = carry
            rows = scored if whole_batch else _each_row_its_prompt(scored, indices)
            (loss, metrics, grads), critic = gradients(params, critic_params, rows)
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _step_is_finite(
                policy_optimizer, grads, opt_state, params)
            # A minibatch of padding rows only (dynamic sampling) has a zero gradient, but an
            # AdamW step would still move the params by momentum: it takes no step.
            has_tokens = jnp.any(rows.completion_mask)
            if a.needs_critic:
                value_loss, critic_metrics, critic_grads = critic
                metrics.update(critic_metrics)
                finite = finite & jnp.isfinite(value_loss) & jnp.isfinite(optax.tree.norm(critic_grads)) & (
                    _step_is_finite(critic_optimizer, critic_grads, critic_opt_state, critic_params))
                # Policy and critic step together or not at all.
                critic_params, critic_opt_state = _apply_if(finite & has_tokens, critic_optimizer, critic_grads,
                                                            critic_opt_state, critic_params)
            params, opt_state = _apply_if(finite & has_tokens, policy_optimizer, grads, opt_state, params)
            metrics.update(grad_norm=grad_norm, learning_rate=_learning_rate(opt_state))
            skipped = skipped + (~finite).astype(jnp.int32)
            return (params, opt_state, critic_params, critic_opt_state, skipped), metrics

        carry = (state.params, state.opt_state, state.critic_params, state.critic_opt_state, state.skipped_updates)
        carry, metrics = jax.lax.scan(one_minibatch, carry, order)
        params, opt_state, critic_params, critic_opt_state, skipped = carry
        # A train step counts as skipped if any of its minibatch updates was.
        step_skipped = skipped > state.skipped_updates
        state = state._replace(params=params, opt_state=opt_state, critic_params=critic_params,
                               critic_opt_state=critic_opt_state, key=key, step=state.step + 1,
                               skipped_updates=skipped,
                               consecutive_skips=jnp.where(step_skipped, state.consecutive_skips + 1, 0))
        return state, _reduce(metrics)

    def trpo_update(state: TrainState, scored: ScoredBatch):
        old_params = state.params
        old_hidden = jax.lax.stop_gradient(hidden_states(old_params, scored))
        old_kernel = jax.lax.stop_gradient(kernel(old_params))
        old_logp = ops.chunked_token_logprobs(old_hidden, old_kernel, scored.completion_tokens,
                                              transposed_kernel=tied(), **logprob_options)

        def surrogate(p):
            return policy_loss(p, scored, old_logp=old_logp)[0]

        def kl_from_old(p):  # exact mean KL(pi_old || pi_p) over the batch's completion states
            per_token = ops.chunked_categorical_kl(old_hidden, old_kernel, hidden_states(p, scored), kernel(p),
                                                   transposed_kernels=tied(), **logprob_options)
            return ops.masked_mean(per_token, scored.completion_mask)

        params, info = trpo.natural_gradient_step(
            old_params, surrogate_fn=surrogate, kl_fn=kl_from_old, max_kl=a.max_kl, damping=a.cg_damping,
            cg_iters=a.cg_iters, backtrack_coef=a.backtrack_coef, max_backtracks=a.max_backtracks)
        _, metrics = policy_loss(params, scored, old_logp=old_logp)  # diagnostics after the step
        metrics.update({f"trpo_{name}": value.astype(jnp.float32) for name, value in info.items()})
        # A non-finite gradient counts as a skip; a candidate with a non-finite parameter, KL
        # or surrogate is rejected by the line search and the params stay.
        finite = jnp.isfinite(info["grad_norm"])
        # theta' = theta + step_size * s, s the natural-gradient direction: its learning rate.
        metrics.update(grad_norm=info["grad_norm"], learning_rate=metrics["trpo_step_size"])
        state = state._replace(
            params=params, step=state.step + 1,
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
            consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1))
        return state, metrics

    return TrainStep(score=score, update=update)
