"""The optimizer of a run: learning-rate schedules, AdamW's settings and weight decay,
against plain Python and NumPy references."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import algorithms, training
from jaxrl_llm.training import optim
from jaxrl_llm.training.config import LR_SCHEDULES


def reference_rate(k: int, *, lr: float, warmup: int, schedule: str, decay: int | None, end: float) -> float:
    """Step ``k``'s learning rate, written out."""
    if k < warmup:
        return lr * (k + 1) / warmup
    x = min(k - warmup + 1, decay) / decay if decay else 0.0
    shape = {"constant": 1.0, "linear": 1.0 - x, "cosine": 0.5 * (1.0 + math.cos(math.pi * x))}[schedule]
    if schedule == "constant":
        return lr
    return lr * (end + (1.0 - end) * shape)


def rates_used(optimizer, num_steps: int) -> np.ndarray:
    """``[num_steps]``: the learning rate each optimizer step used, as the train step reads it."""
    params = {"w": jnp.zeros((2, 2))}

    def one_step(state, _):
        updates, state = optimizer.update({"w": jnp.ones((2, 2))}, state, params)
        return state, state.inner[1].hyperparams["learning_rate"]

    _, rates = jax.jit(lambda s: jax.lax.scan(one_step, s, length=num_steps))(optimizer.init(params))
    return np.asarray(rates)


@pytest.mark.parametrize(
    "schedule, warmup, end",
    [("constant", 3, 0.0), ("linear", 3, 0.0), ("cosine", 3, 0.1), ("cosine", 1, 0.0), ("linear", 1, 0.25)],
)
def test_each_step_takes_the_scheduled_learning_rate(schedule, warmup, end):
    lr, decay, num_steps = 0.2, 6, 12  # past the end of the decay
    optimizer = training.make_optimizer(
        learning_rate=lr,
        warmup_steps=warmup,
        max_grad_norm=1.0,
        lr_schedule=schedule,
        decay_steps=decay,
        end_learning_rate_fraction=end,
    )
    expected = [
        reference_rate(k, lr=lr, warmup=warmup, schedule=schedule, decay=decay, end=end) for k in range(num_steps)
    ]
    np.testing.assert_allclose(rates_used(optimizer, num_steps), expected, rtol=1e-6, atol=1e-8)
    # The warm-up peaks at its last step; a decay ends at step W - 1 + D and stays there.
    assert math.isclose(expected[warmup - 1], lr)
    if schedule != "constant":
        assert math.isclose(expected[warmup - 1 + decay], end * lr, abs_tol=1e-12)
        assert expected[-1] == expected[warmup - 1 + decay]


def test_the_default_schedule_is_the_linear_warm_up_then_constant():
    schedule = optim.learning_rate_schedule(learning_rate=1.0, warmup_steps=4)
    np.testing.assert_allclose([float(schedule(k)) for k in range(7)], [0.25, 0.5, 0.75, 1, 1, 1, 1])


def test_a_decay_needs_its_length():
    with pytest.raises(ValueError, match="decay_steps"):
        training.make_optimizer(learning_rate=0.1, warmup_steps=2, max_grad_norm=1.0, lr_schedule="cosine")


def numpy_adamw(params, grads_per_step, *, rates, max_grad_norm, b1, b2, eps, weight_decay):
    """Clip by global norm, then AdamW with decay on params of two or more axes (float64)."""
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, rates), start=1):
        grads = {k: np.asarray(g, np.float64) for k, g in grads.items()}
        norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
        grads = {k: g * min(1.0, max_grad_norm / norm) for k, g in grads.items()}
        for k, g in grads.items():
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            step = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            decay = weight_decay * params[k] if params[k].ndim >= 2 else 0.0
            params[k] = params[k] - lr * (step + decay)
    return params


def test_adamw_with_weight_decay_betas_and_eps_matches_numpy():
    settings = dict(b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(2, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    grads = [{k: rng.normal(size=p.shape).astype(np.float32) for k, p in params.items()} for _ in range(3)]
    optimizer = training.make_optimizer(learning_rate=0.1, warmup_steps=2, max_grad_norm=1.5, **settings)
    state, new = optimizer.init(params), params
    step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*optimizer.update(g, s, p)))
    for g in grads:
        new, state = step(g, state, new)
    expected = numpy_adamw(params, grads, rates=[0.05, 0.1, 0.1], max_grad_norm=1.5, **settings)
    for name in params:
        np.testing.assert_allclose(new[name], expected[name], rtol=1e-5, atol=1e-6)
    assert {name: float(state.inner[1].hyperparams[name]) for name in settings} == {
        name: float(np.float32(value)) for name, value in settings.items()
    }


def test_an_update_uses_the_optimizers_settings_not_those_stored_in_a_restored_state():
    params = {"w": jnp.ones((2, 2))}
    grads = {"w": jnp.array([[1.0, -2.0], [0.5, 0.0]])}
    kwargs = dict(learning_rate=0.1, warmup_steps=1, max_grad_norm=10.0)
    old = training.make_optimizer(**kwargs, b1=0.5, b2=0.5, eps=1.0, weight_decay=0.5)
    new = training.make_optimizer(**kwargs, b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.01)
    update = jax.jit(new.update)
    from_old_state, _ = update(grads, old.init(params), params)
    from_new_state, state = update(grads, new.init(params), params)
    jax.tree.map(np.testing.assert_array_equal, from_old_state, from_new_state)
    assert float(state.inner[1].hyperparams["weight_decay"]) == np.float32(0.01)


def test_bfloat16_weights_decay_by_less_than_their_precision_through_float32_master_weights():
    # With zero gradients Adam's step is 0 and only the decay moves the weight, by
    # lr * lambda * theta = 1e-4 of it per step: in bfloat16 (spacing 2^-8 below 1) each
    # step would round back to 1.0.
    params = {"w": jnp.ones((2, 2), jnp.bfloat16), "scale": jnp.ones((2,), jnp.bfloat16)}
    optimizer = training.make_optimizer(learning_rate=1e-2, warmup_steps=1, max_grad_norm=1.0, weight_decay=1e-2)
    state = optimizer.init(params)
    assert state.inner[1].hyperparams["weight_decay"].dtype == jnp.float32
    zeros = jax.tree.map(jnp.zeros_like, params)

    def one_step(carry, _):
        params, state = carry
        updates, state = optimizer.update(zeros, state, params)
        return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.jit(lambda c: jax.lax.scan(one_step, c, length=100))((params, state))
    master = np.float32(1.0)
    for _ in range(100):  # the same float32 steps, one at a time
        master = np.float32(master - np.float32(np.float32(1e-2) * np.float32(1e-2) * master))
    np.testing.assert_allclose(state.master["w"], np.full((2, 2), master), rtol=1e-6)
    assert abs(master - 0.99) < 1e-3 and params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params["w"], state.master["w"].astype(jnp.bfloat16))
    assert float(params["w"][0, 0]) < 1.0  # without the master copy it would still be 1.0
    np.testing.assert_array_equal(params["scale"], 1.0)  # norm scales are not decayed


def _recorded_optimizers(monkeypatch):
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        return optax.identity()

    monkeypatch.setattr(optim, "make_optimizer", record)
    return calls


def test_a_decay_without_decay_steps_ends_at_the_runs_last_optimizer_step(monkeypatch):
    calls = _recorded_optimizers(monkeypatch)
    run = training.TrainConfig(
        num_prompts=4,
        group_size=4,
        minibatch_size=8,
        optimizer=training.OptimizerConfig(
            warmup_steps=3,
            lr_schedule="cosine",
            critic_learning_rate=1e-3,
            weight_decay=0.1,
            adam_b1=0.8,
            adam_b2=0.9,
            adam_eps=1e-6,
        ),
    )
    training.make_train_step(None, algorithms.PPO, run, total_steps=10)
    per_train_step = algorithms.PPO.num_iterations * 2  # two minibatches of 8
    policy, critic = calls
    assert policy["decay_steps"] == critic["decay_steps"] == 10 * per_train_step - 3
    assert (policy["learning_rate"], critic["learning_rate"]) == (run.optimizer.learning_rate, 1e-3)
    for kwargs in calls:
        assert {k: kwargs[k] for k in ("lr_schedule", "warmup_steps", "weight_decay", "b1", "b2", "eps")} == dict(
            lr_schedule="cosine", warmup_steps=3, weight_decay=0.1, b1=0.8, b2=0.9, eps=1e-6
        )
    calls.clear()  # a run that ends within its warm-up never decays
    training.make_train_step(
        None,
        algorithms.GRPO,
        dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, warmup_steps=50)),
        total_steps=2,
    )
    assert calls[0]["decay_steps"] == 1
    calls.clear()  # decay_steps, when set, wins
    training.make_train_step(
        None,
        algorithms.GRPO,
        dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, decay_steps=7)),
        total_steps=10,
    )
    assert calls[0]["decay_steps"] == 7


def test_a_decay_without_decay_steps_or_total_steps_raises(monkeypatch):
    run = training.TrainConfig(optimizer=training.OptimizerConfig(lr_schedule="linear"))
    with pytest.raises(ValueError, match="total_steps"):
        training.make_train_step(None, algorithms.GRPO, run)
    training.make_train_step(
        None,
        algorithms.GRPO,
        dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, lr_schedule="constant")),
    )
    training.make_train_step(None, algorithms.TRPO, run)  # no optax optimizer, no schedule
    with pytest.raises(ValueError, match="total_steps"):
        training.make_train_step(None, algorithms.GRPO, run, total_steps=-1)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("weight_decay", -0.1, ">= 0"),
        ("weight_decay", float("nan"), "finite"),
        ("lr_schedule", "exponential", "'constant', 'linear', 'cosine'"),
        ("decay_steps", 0, ">= 1"),
        ("decay_steps", 2.5, "integer"),
        ("end_learning_rate_fraction", 1.5, r"\[0.0, 1.0\]"),
        ("end_learning_rate_fraction", -0.1, r"\[0.0, 1.0\]"),
        ("adam_b1", 1.0, r"\[0.0, 1.0\)"),
        ("adam_b2", -0.5, r"\[0.0, 1.0\)"),
        ("adam_eps", 0.0, "> 0"),
        ("adam_eps", float("inf"), "finite"),
    ],
)
def test_bad_optimizer_settings_are_refused_naming_the_field_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"OptimizerConfig: `{field}` must .*{allowed}"):
        training.TrainConfig(optimizer=training.OptimizerConfig(**{field: value}))


def test_decay_steps_are_allowed_and_ignored_with_a_constant_schedule():
    assert training.TrainConfig(optimizer=training.OptimizerConfig(decay_steps=10)).optimizer.lr_schedule == "constant"
    assert LR_SCHEDULES == ("constant", "linear", "cosine")


def test_weight_decay_reaches_the_weight_matrices_of_a_qwen2_model_and_not_its_biases_or_norms():
    from jaxrl_llm import models

    config = models.ModelConfig(
        architecture="qwen2",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        attention_bias=True,
    )
    _, params = models.init(config, jax.random.key(0))
    optimizer = training.make_optimizer(learning_rate=1e-1, warmup_steps=1, max_grad_norm=1.0, weight_decay=0.5)
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params), params)
    moved = {
        jax.tree_util.keystr(path): bool(jnp.any(u != 0))
        for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
    }
    # With zero gradients only the decay moves a parameter.
    assert {name for name, m in moved.items() if not m} == {
        "['layers'][0]['input_layernorm'].value",
        "['layers'][0]['post_attention_layernorm'].value",
        "['layers'][0]['self_attn']['q_bias'].value",
        "['layers'][0]['self_attn']['k_bias'].value",
        "['layers'][0]['self_attn']['v_bias'].value",
        "['norm'].value",
    }


def test_weight_decay_moves_the_stacked_layout_as_it_moves_each_layer():
    """Stacked (``scan_layers``), a norm's scale is ``[L, E]`` and a bias ``[L, H, D]``:
    still not decayed. Each stacked leaf's update is its layers' updates, bit for bit."""
    import chex
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.models import decoder

    config = models.ModelConfig(
        architecture="qwen2",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        attention_bias=True,
    )
    model, params = models.init(config, jax.random.key(0))
    _, stacked = models.with_scan_layers(model, params, True)
    optimizer = training.make_optimizer(learning_rate=1e-1, warmup_steps=1, max_grad_norm=1.0, weight_decay=0.5)

    def decay(p):  # with zero gradients only the decay moves a parameter
        return optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p)[0]

    updates, stacked_updates = decay(params), decay(stacked)
    chex.assert_trees_all_equal(decoder.unstack_layers(stacked_updates), updates)
    still = {path for path, u in nnx.to_flat_state(stacked_updates) if not jnp.any(u[...] != 0)}
    assert still == {
        ("layers", "input_layernorm"),
        ("layers", "post_attention_layernorm"),
        ("layers", "self_attn", "q_bias"),
        ("layers", "self_attn", "k_bias"),
        ("layers", "self_attn", "v_bias"),
        ("norm",),
    }
    assert all(stacked["layers"][path[1]].ndim >= 2 for path in still if len(path) == 2)  # stacked: two axes


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
def test_the_initial_state_is_the_optimizers_own_init_bit_for_bit(schedule):
    # init_state builds the copy and the optimizer state as one program; eagerly, every
    # operation (the schedule's step-0 rate among them) is a program of its own.
    from jaxrl_llm import models

    config = models.ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    model, params = models.init(config, jax.random.key(0))
    settings = training.OptimizerConfig(learning_rate=3e-6, warmup_steps=7, lr_schedule=schedule, weight_decay=0.01)
    run = training.TrainConfig(num_prompts=2, group_size=2, optimizer=settings)
    state = training.init_state(model, params, algorithms.GRPO, run)
    eager = optim.run_optimizers(algorithms.GRPO, run, decay_steps=1).policy.init(params)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(eager)
    for ours, theirs in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(eager), strict=True):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    first = reference_rate(0, lr=3e-6, warmup=7, schedule=schedule, decay=None, end=0.0)
    np.testing.assert_allclose(state.opt_state.inner[1].hyperparams["learning_rate"], first, rtol=1e-6)
    for copy, given in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        assert copy is not given and copy.unsafe_buffer_pointer() != given.unsafe_buffer_pointer()
        assert np.array_equal(copy, given)
