"""The train state, what a run's steps change, and its fixed params, what they only read.

:func:`init_state` builds the :class:`TrainState` at step 0, :func:`fixed_params` the
:class:`FixedParams` beside it, :func:`check_state` checks a given state against the run
(method, model, optimizer), :func:`state_shardings` places it on a mesh. Every change to
the state happens inside the jitted train step (:mod:`jaxrl_llm.training.step`): the next
PRNG key (the rollout draws from :func:`rollout_key`), the running baseline, the prompts
consumed, the optimizer's step, so a step is a function of ``(state, fixed, batch)`` alone.
The update donates the state and never the fixed params, which are the caller's arrays.

**The reference** is kept and run only when it is used (:func:`uses_reference`): by the
method's KL term (in the loss or the reward), or by the metrics
``TrainConfig.reference_metrics`` (``kl_k3``) and ``TrainConfig.exact_kl``. Otherwise
``fixed.reference`` is ``None``.

**LoRA** (:mod:`jaxrl_llm.models.lora`): ``fixed.base`` is the base's params and
``state.params`` the adapters alone, so the optimizer holds state for the adapters only.
The policy is ``lora.combine(base, params)`` (:func:`policy_params`), and the reference is
the base itself: adapters of zeros, whose share :math:`s (x 0) 0` is exactly 0, so no copy
of the weights is kept. PPO's critic is ``{"backbone": its own adapters, "head"}`` over the
same base.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm import advantages, algorithms, models, sharding
from jaxrl_llm.training import critic
from jaxrl_llm.training.config import TrainConfig
from jaxrl_llm.training.optim import run_optimizers


class TrainState(NamedTuple):
    """What a run's steps change, in one pytree (checkpointable, shardable, donated to each update)."""

    params: models.Params  # the policy's; with LoRA, its adapters alone
    opt_state: Any  # optax state of the policy; () for TRPO, which has none
    critic_params: critic.CriticParams | None  # methods with GAE only
    critic_opt_state: Any
    baseline: advantages.RunningMeanState
    key: jax.Array  # PRNG key for rollouts and minibatch shuffles
    step: jax.Array  # [] int32: train steps (rollout batches) done
    skipped_updates: jax.Array  # [] int32: non-finite minibatch updates skipped in all
    consecutive_skips: jax.Array  # [] int32: train steps in a row with a skipped update
    prompts_drawn: jax.Array  # [] int32: positions of the task's train stream consumed (tasks.base.draw)


class FixedParams(NamedTuple):
    """What a run's steps read and never change, passed beside the :class:`TrainState`
    (never in it, never donated, placed once): the caller's arrays, not copies."""

    reference: models.Params | None = None
    """The KL's reference policy (:func:`uses_reference`; else ``None``): the initial params,
    or with LoRA adapters of zeros over ``base``."""
    base: models.Params | None = None
    """LoRA: the base the adapters (``state.params``) adapt; ``None`` without LoRA."""


def uses_reference(algorithm: algorithms.Algorithm, config: TrainConfig) -> bool:
    """Whether the run keeps and runs the reference model: for the method's KL term (in
    the loss or the reward) or for the KL metrics the config asks for."""
    return algorithm.needs_reference or config.reference_metrics or config.exact_kl


def policy_params(state: TrainState, base: models.Params | None = None) -> models.Params:
    """The policy's whole params: ``state.params``, or for a LoRA run's state the ``base``
    and the adapters together (``lora.combine(base, state.params)``, no copy), for the LoRA
    model. Raises ValueError for adapters without their base."""
    if base is not None:
        return models.lora.combine(base, state.params)
    rest, adapters = models.lora.split(state.params)
    if jax.tree.leaves(adapters) and not jax.tree.leaves(rest):
        raise ValueError(
            "policy_params: `state.params` are LoRA adapters alone; pass `base=`, the params they were trained "
            "over (train's `params`)."
        )
    return state.params


def rollout_key(state: TrainState) -> jax.Array:
    """The PRNG key the step's rollouts draw from; ``update`` moves ``state.key`` past it."""
    return _second_half(state.key)


@jax.jit
def _second_half(key: jax.Array) -> jax.Array:  # one program, where eager ops would be three
    return jax.random.split(key)[1]


def _copy(tree):
    # The update donates the state, so the state must own its buffers: the caller's
    # params stay valid, and the critic is a separate copy.
    return jax.tree.map(jnp.copy, tree)


def _owned_with_optimizer_state(optimizer, params) -> tuple[Any, Any]:
    """``(a copy of params, optimizer.init(params))`` (``()`` for no optimizer).

    Params on one device: one program, where eagerly each leaf shape's copy and zeros
    would be a program of its own, which a warm start loads from the cache one by one
    (20 for a small Llama). Params split over devices (or abstract, or NumPy): eagerly, as
    there each zeros takes its param's sharding, which a jitted init would leave to XLA
    (it replicates them)."""

    def owned(params):
        return _copy(params), optimizer.init(params) if optimizer is not None else ()

    leaves = jax.tree.leaves(params)
    concrete = all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    on_one_device = concrete and len({device for leaf in leaves for device in leaf.sharding.device_set}) == 1
    return jax.jit(owned)(params) if on_one_device else owned(params)


def init_state(
    model: models.Model | None,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    critic_params: Any = None,
) -> TrainState:
    """The state at step 0: the policy copied from ``params``, and a critic when the method
    has one: ``critic_params``, by default initialised from the policy
    (:func:`jaxrl_llm.training.critic.init_critic`; another policy than ``model``'s brings
    its own, with ``model=None``).

    LoRA: ``model`` is the LoRA model and ``params`` its adapters (the base goes in
    :func:`fixed_params`); a method with GAE gets a critic of its own adapters over the same
    base (a copy of the policy's initial adapters, so its backbone starts as the base) and
    its value head: no copy of the base's weights."""
    # The state does not depend on when the decay ends (its step-0 rate is the warm-up's).
    optimizers = run_optimizers(algorithm, config, decay_steps=1)
    quantized = model is not None and model.config.quantization is not None  # model=None: another policy
    if quantized and model.config.lora is None:
        raise ValueError(
            f"init_state: the model's projections are {model.config.quantization} (quantization="
            f"{model.config.quantization!r}), which are not trained; train LoRA adapters over it "
            "(training.train(..., lora=models.LoraConfig(...))), or load it unquantized."
        )
    if not algorithm.needs_critic:
        critic_params = None
    elif critic_params is None:
        critic_params = critic.init_critic(model, params)
    else:
        critic_params = _copy(critic_params)
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731 (one buffer each: the state is donated)
    params, opt_state = _owned_with_optimizer_state(optimizers.policy, params)
    return TrainState(
        params=params,
        opt_state=opt_state,
        critic_params=critic_params,
        critic_opt_state=optimizers.critic.init(critic_params) if critic_params is not None else None,
        baseline=advantages.running_mean_init(),
        key=jax.random.key(config.seed),
        step=zero(),
        skipped_updates=zero(),
        consecutive_skips=zero(),
        prompts_drawn=zero(),
    )


def fixed_params(
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    ref_params: models.Params | None = None,
    base: models.Params | None = None,
) -> FixedParams:
    """The run's :class:`FixedParams`, of the caller's arrays (no copy). The reference, when
    the run uses one (:func:`uses_reference`; else ``ref_params`` must not be given), is
    ``ref_params``, by default ``params``. LoRA: ``params`` are the adapters and ``base`` the
    params they adapt; the reference is adapters of zeros (the base itself), and
    ``ref_params`` must not be given."""
    with_reference = uses_reference(algorithm, config)
    if base is not None and ref_params is not None:
        raise ValueError("fixed_params: with LoRA (`base`) the reference is the base itself; do not pass `ref_params`.")
    if ref_params is not None and not with_reference:
        raise ValueError(
            f"fixed_params: `ref_params` given, but algorithm {algorithm.name!r} has no KL term "
            "(kl_coef = kl_reward_coef = 0) and no KL metric is asked for; set "
            "TrainConfig.reference_metrics=True (kl_k3) or exact_kl=True to measure the KL to it."
        )
    reference = None
    if with_reference and base is not None:  # the base: every adapter's share exactly 0
        reference = jax.tree.map(jnp.zeros_like, params)
    elif with_reference:
        reference = jax.tree.map(jnp.asarray, params if ref_params is None else ref_params)
    return FixedParams(reference=reference, base=base)


def state_shardings(
    state: TrainState,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    mesh: jax.sharding.Mesh,
    rules: sharding.Rules,
) -> TrainState:
    """The ``NamedSharding`` of every leaf of ``state`` on ``mesh`` by ``rules``
    (:func:`jaxrl_llm.sharding.state_shardings` with the run's optimizers)."""
    optimizers = run_optimizers(algorithm, config, decay_steps=1)  # the state's structure only
    return sharding.state_shardings(state, mesh, rules, optimizer=optimizers.policy, critic_optimizer=optimizers.critic)


def fixed_shardings(fixed: FixedParams, mesh: jax.sharding.Mesh, rules: sharding.Rules) -> FixedParams:
    """The ``NamedSharding`` of every leaf of ``fixed`` on ``mesh``: each params by ``rules``
    (:func:`jaxrl_llm.sharding.param_shardings`), as the policy's."""
    return FixedParams(*(None if params is None else sharding.param_shardings(params, mesh, rules) for params in fixed))


def check_params(model: models.Model, params: models.Params, *, name: str = "params") -> None:
    """Raises ValueError naming the first parameter whose path or shape is not the model's."""
    check_tree(
        name,
        params,
        models.abstract(model.config)[1],
        "the model's config",
        dtypes=False,
        advice="Are they the params of another model?",
    )


def check_state(
    state: TrainState,
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
) -> None:
    """Raises ValueError, naming the first field, path, shape or dtype that differs, when
    ``state`` is not a state of this run: made for another method (a critic or an
    optimizer it lacks), another model size, or another optimizer. With LoRA, ``model`` is
    the LoRA model and ``params`` its adapters (see :func:`init_state`)."""
    if not isinstance(state, TrainState):
        raise ValueError(
            f"`state` must be a TrainState (from init_state or a previous train); got {type(state).__name__}."
        )
    expected = jax.eval_shape(lambda p: init_state(model, p, algorithm, config), params)
    for field in TrainState._fields:
        check_tree(
            f"state.{field}",
            getattr(state, field),
            getattr(expected, field),
            f"algorithm {algorithm.name!r} on this model",
            dtypes=True,
            advice="Was the state made for another method, model or TrainConfig?",
        )


def check_tree(name: str, tree, expected, what: str, *, dtypes: bool, advice: str) -> None:
    """Raises ValueError at the first difference of structure, shape (or dtype) between
    ``tree`` and ``expected`` (abstract leaves), naming ``name``'s path and ``what`` it must fit."""

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
            raise ValueError(
                f"`{name}{jax.tree_util.keystr(path)}` is {describe(got)}, but {what} needs {describe(want)}. {advice}"
            )
