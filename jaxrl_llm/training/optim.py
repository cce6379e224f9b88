r"""The policy's and the critic's optimizer, and the guard that keeps a step's params finite.

* :func:`learning_rate_schedule`: a linear warm-up, then constant, linear or cosine;
* :func:`make_optimizer`: global-norm clipping, then AdamW at that schedule, decaying only
  :func:`weight_decay_mask`'s leaves, in float32 with float32 master weights for
  low-precision params (:func:`in_float32`);
* :func:`run_optimizers`: the two optimizers of a (method, :class:`TrainConfig`);
* the non-finite guard: :func:`update_is_finite` checks a step before it is taken,
  :func:`apply_update_if` takes it or leaves params and state as they are.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import _checks, algorithms
from jaxrl_llm.ops.trees import all_finite
from jaxrl_llm.training.config import LR_SCHEDULES, TrainConfig


def learning_rate_schedule(
    *,
    learning_rate: float,
    warmup_steps: int,
    lr_schedule: str = "constant",
    decay_steps: int | None = None,
    end_learning_rate_fraction: float = 0.0,
) -> optax.Schedule:
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
        raise ValueError(
            f"learning_rate_schedule: lr_schedule={lr_schedule!r} decays over `decay_steps` optimizer "
            "steps; got None. Set TrainConfig.optimizer.decay_steps, or pass the run's length to "
            "make_train_step(..., total_steps=)."
        )
    _checks.positive_int("learning_rate_schedule", "decay_steps", decay_steps)
    end = end_learning_rate_fraction * learning_rate
    decay = (
        optax.linear_schedule(learning_rate, end, decay_steps)
        if lr_schedule == "linear"
        else optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=end_learning_rate_fraction)
    )
    return optax.join_schedules([warmup, decay], boundaries=[warmup_steps - 1])


def weight_decay_mask(params):
    """``True`` at the leaves weight decay applies to: the weight matrices (embeddings,
    projections), not the norms' scales or the biases, whatever their rank (Qwen2's q/k/v
    biases are ``[heads, head_dim]``)."""

    def decayed(path, param) -> bool:
        names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
        name = next((n for n in reversed(names) if n and n != "value"), "")  # nnx leaves end in `.value`
        return param.ndim >= 2 and not name.endswith("bias") and "norm" not in name

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
    *,
    learning_rate: float,
    warmup_steps: int,
    max_grad_norm: float,
    lr_schedule: str = "constant",
    decay_steps: int | None = None,
    end_learning_rate_fraction: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
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
    two or more axes (matrices, embeddings; :func:`weight_decay_mask`), as in GPT-2 and
    Hugging Face's ``Trainer``: decaying norm scales and biases towards 0 is not wanted.

    The rate in use is the state's ``learning_rate`` hyperparameter (:func:`learning_rate_in`).
    The state also holds ``b1``, ``b2``, ``eps`` and ``weight_decay`` (optax's
    ``inject_hyperparams``), but every update uses the values given here, so a state
    restored from a checkpoint takes the current settings.
    """
    schedule = learning_rate_schedule(
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        lr_schedule=lr_schedule,
        decay_steps=decay_steps,
        end_learning_rate_fraction=end_learning_rate_fraction,
    )
    settings = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    adamw = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32, static_args=("mask",))(
        learning_rate=schedule, mask=weight_decay_mask, **settings
    )

    def update(updates, state, params=None):
        return adamw.update(updates, state._replace(hyperparams={**state.hyperparams, **settings}), params)

    return in_float32(
        optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.GradientTransformation(adamw.init, update))
    )


def learning_rate_in(opt_state) -> jax.Array:
    """``[]``: the rate of the optimizer's last step, found by name in its state (optax's
    ``inject_hyperparams``), wherever the chain keeps it."""
    return optax.tree_utils.tree_get(
        opt_state, "learning_rate", filtering=lambda path, value: isinstance(value, jax.Array)
    )


class Float32State(NamedTuple):
    """The state of :func:`in_float32`."""

    inner: Any  # the wrapped optimizer's state, float32
    master: Any  # float32 master copies of the low-precision params; None at float32 params


def _is_none(x) -> bool:
    return x is None


def _to_float32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


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

    def init(params):
        master = jax.tree.map(
            lambda p: (
                p.astype(jnp.float32)
                if jnp.issubdtype(p.dtype, jnp.floating) and jnp.finfo(p.dtype).bits < 32
                else None
            ),
            params,
        )
        return Float32State(inner=inner.init(_to_float32(params)), master=master)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError(
                "in_float32: `params` are required (low-precision params take their steps on float32 master copies)."
            )
        full = jax.tree.map(
            lambda master, p: p if master is None else master, state.master, params, is_leaf=_is_none
        )  # the params at full precision
        steps, inner_state = inner.update(_to_float32(grads), state.inner, full)
        master = jax.tree.map(
            lambda master, u: None if master is None else master + u, state.master, steps, is_leaf=_is_none
        )
        updates = jax.tree.map(  # round(m') - theta, exact in float32
            lambda master, u, p: (
                u if master is None else master.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)
            ),
            master,
            steps,
            params,
            is_leaf=_is_none,
        )
        return updates, Float32State(inner=inner_state, master=master)

    return optax.GradientTransformation(init, update)


def decay_steps_of_run(algorithm: algorithms.Algorithm, config: TrainConfig, total_steps: int | None) -> int | None:
    """``config.optimizer.decay_steps``, or, when it is ``None`` and the schedule decays, the
    optimizer steps from the warm-up's last step to the run's last one:
    ``total_steps * num_iterations * num_minibatches - warmup_steps`` (at least 1: a run
    that ends within the warm-up never decays). ``None`` for ``"constant"`` and TRPO, which
    has no optax optimizer."""
    if total_steps is not None:
        _checks.nonnegative_int("make_train_step", "total_steps", total_steps)
    settings = config.optimizer
    if settings.decay_steps is not None or settings.lr_schedule == "constant" or algorithm.update == "trpo":
        return settings.decay_steps
    if total_steps is None:
        raise ValueError(
            f"make_train_step: TrainConfig.optimizer.lr_schedule={settings.lr_schedule!r} with decay_steps=None "
            "decays until the run's last step, but the run's length is unknown: pass total_steps=<the run's train "
            "steps> (train() does), or set TrainConfig.optimizer.decay_steps."
        )
    optimizer_steps = total_steps * algorithm.num_iterations * config.num_minibatches
    return max(1, optimizer_steps - settings.warmup_steps)


class RunOptimizers(NamedTuple):
    """The optimizers of a run."""

    policy: optax.GradientTransformation | None  # None for TRPO, which takes natural-gradient steps
    critic: optax.GradientTransformation | None  # None without a critic


def run_optimizers(algorithm: algorithms.Algorithm, config: TrainConfig, *, decay_steps: int | None) -> RunOptimizers:
    """The policy's and the critic's :func:`make_optimizer` with ``config.optimizer``'s settings."""
    settings = config.optimizer

    def optimizer(learning_rate):
        return make_optimizer(
            learning_rate=learning_rate,
            warmup_steps=settings.warmup_steps,
            max_grad_norm=settings.max_grad_norm,
            lr_schedule=settings.lr_schedule,
            decay_steps=decay_steps,
            end_learning_rate_fraction=settings.end_learning_rate_fraction,
            weight_decay=settings.weight_decay,
            b1=settings.adam_b1,
            b2=settings.adam_b2,
            eps=settings.adam_eps,
        )

    return RunOptimizers(
        policy=None if algorithm.update == "trpo" else optimizer(settings.learning_rate),
        critic=optimizer(settings.critic_learning_rate) if algorithm.needs_critic else None,
    )


def update_is_finite(optimizer: optax.GradientTransformation, grads, opt_state, params) -> jax.Array:
    """``[]`` bool: one step of ``optimizer`` would leave every parameter finite.

    The step is computed only to be checked and dropped: XLA fuses it into the reduction,
    and :func:`apply_update_if` then takes it for real, in place. Checking the loss and the
    gradient is not enough: finite gradients can still give a non-finite update (a learning
    rate of inf, optimizer arithmetic that overflows or divides 0 by 0).
    """
    updates, _ = optimizer.update(grads, opt_state, params)
    return all_finite(optax.apply_updates(params, updates))


def apply_update_if(ok: jax.Array, optimizer: optax.GradientTransformation, grads, opt_state, params):
    """``(params, opt_state)`` after one optimizer step if ``ok`` (``[]`` bool), else as given.

    A ``lax.cond``, not a ``jnp.where`` over the trees: the skipped branch is the
    identity, and the taken one updates the donated buffers in place (a select would
    keep the old state alive next to the new one, and XLA copies it).
    """

    def step(params_and_state):
        params, opt_state = params_and_state
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.lax.cond(ok, step, lambda params_and_state: params_and_state, (params, opt_state))
