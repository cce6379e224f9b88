"""Nothing silently wrong, nothing lost: low precision, non-finite updates, bad settings,
and runs that end early."""

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import algorithms, models, rewards, training, trpo
from jaxrl_llm.ops.trees import all_finite
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import DigitSumTask
from jaxrl_llm.training.config import GROUPED_FIELDS

TASK = DigitSumTask()
CONFIG = models.ModelConfig(
    vocab_size=len(TASK.tokenizer),
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=32,
)
RUN = training.TrainConfig(num_prompts=4, group_size=4, sampling=SamplingConfig(max_new_tokens=3))


def _finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(leaf, np.float32)))) for leaf in jax.tree.leaves(tree))


def _changed(tree_a, tree_b) -> bool:
    return any(
        bool(np.any(np.asarray(a) != np.asarray(b))) for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b))
    )


# --- Low precision ----------------------------------------------------------------------------


def test_the_optimizer_keeps_float32_moments_and_hyperparameters_for_bfloat16_params():
    params = {"w": jnp.full((3,), 0.5, jnp.bfloat16), "b": jnp.zeros((2,), jnp.float32)}
    optimizer = training.make_optimizer(learning_rate=1e-2, warmup_steps=1, max_grad_norm=1.0)
    state = optimizer.init(params)
    adam = state.inner[1]
    assert adam.hyperparams["b2"].dtype == jnp.float32 and float(adam.hyperparams["b2"]) == np.float32(0.999)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves((adam.inner_state[0].mu, adam.inner_state[0].nu)))
    assert state.master["w"].dtype == jnp.float32 and state.master["b"] is None  # float32 params need no copy
    grads = {"w": jnp.array([1.0, -2.0, 0.5], jnp.bfloat16), "b": jnp.ones(2)}
    updates, state = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # Adam's first step moves each weight by the learning rate against its gradient's sign.
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state.master["w"]), [0.49, 0.51, 0.49], rtol=1e-6)
    np.testing.assert_array_equal(new["w"], state.master["w"].astype(jnp.bfloat16))
    np.testing.assert_allclose(new["b"], [-0.01, -0.01], rtol=1e-5)


def test_bfloat16_params_take_steps_smaller_than_their_precision_through_float32_master_weights():
    # 1.0 - 1e-4 rounds back to 1.0 in bfloat16 (its spacing there is 2^-7): without a
    # master copy, 100 such steps would leave the weight at 1.0.
    params = {"w": jnp.ones((), jnp.bfloat16)}
    optimizer = training.optim.in_float32(optax.sgd(1e-4))
    state = optimizer.init(params)
    step = jax.jit(
        lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
            *optimizer.update({"w": jnp.ones((), jnp.bfloat16)}, s, p)
        )
    )
    for _ in range(100):
        params, state = step(params, state)
    master = np.float32(1.0)
    for _ in range(100):  # the same float32 steps, one at a time
        master = np.float32(master + np.float32(-1e-4))
    assert float(state.master["w"]) == master and abs(master - 0.99) < 1e-5
    assert params["w"] == jnp.asarray(master, jnp.bfloat16) == jnp.asarray(0.98828125, jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_every_preset_trains_bfloat16_params_to_finite_values_that_change(name):
    config = dataclasses.replace(CONFIG, num_layers=1, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    model, params = models.init(config, jax.random.key(0))
    state, history = training.train(model, params, algorithms.get(name), RUN, steps=2, task=TASK)
    assert history[-1]["skipped_updates"] == 0, name
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(state.params))
    assert _finite(state.params) and _changed(state.params, params), name
    if state.critic_params is not None:
        assert _finite(state.critic_params) and _changed(state.critic_params["backbone"], params)


# --- The non-finite guard -----------------------------------------------------------------------


def _poisoned(make_optimizer, *, learning_rate: float):
    """``make_optimizer`` whose optimizers of ``learning_rate`` turn finite gradients into
    NaN updates, as bfloat16 AdamW hyperparameters once did."""

    def factory(**kwargs):
        optimizer = make_optimizer(**kwargs)
        if kwargs["learning_rate"] != learning_rate:
            return optimizer

        def update(grads, state, params=None):
            updates, state = optimizer.update(grads, state, params)
            return jax.tree.map(lambda u: u * jnp.nan, updates), state

        return optax.GradientTransformation(optimizer.init, update)

    return factory


@pytest.mark.parametrize("name, poisoned", [("ppo", "learning_rate"), ("ppo", "critic_learning_rate")])
def test_an_update_that_would_make_params_non_finite_is_skipped(monkeypatch, name, poisoned):
    # Loss and gradients are finite; only the step would not be. Policy and critic move
    # together or not at all.
    run = dataclasses.replace(
        RUN,
        max_consecutive_skips=2,
        optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-3, critic_learning_rate=1e-3),
    )
    monkeypatch.setattr(
        training.optim,
        "make_optimizer",
        _poisoned(training.optim.make_optimizer, learning_rate=getattr(run.optimizer, poisoned)),
    )
    model, params = models.init(CONFIG, jax.random.key(1))
    with pytest.raises(training.NonFiniteUpdates, match="the state keeps the params of the last finite update") as e:
        training.train(model, params, algorithms.get(name), run, steps=3, task=TASK)
    state, history = e.value.state, e.value.history
    assert len(history) == 2 and all(np.isfinite(h["grad_norm"]) and np.isfinite(h["loss"]) for h in history)
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    if state.critic_params is not None:
        jax.tree.map(np.testing.assert_array_equal, state.critic_params["backbone"], params)
        assert _finite(state.critic_params)


def test_trpo_rejects_a_candidate_with_a_non_finite_parameter(monkeypatch):
    # A parameter neither the surrogate nor the KL reads, which the step would make NaN.
    params = {"used": jnp.array([0.3, -0.2]), "unused": jnp.ones(2)}
    target = jnp.array([1.0, 0.5])

    def surrogate(p):
        return jnp.sum((p["used"] - target) ** 2)

    def kl(p):
        return 0.5 * jnp.sum((p["used"] - params["used"]) ** 2)

    real_step = trpo._step
    monkeypatch.setattr(trpo, "_step", lambda p, scale, d: {**real_step(p, scale, d), "unused": jnp.full(2, jnp.nan)})
    new, info = trpo.natural_gradient_step(params, surrogate_fn=surrogate, kl_fn=kl, max_kl=0.01)
    assert not bool(info["accepted"])
    jax.tree.map(np.testing.assert_array_equal, new, params)
    monkeypatch.setattr(trpo, "_step", real_step)
    new, info = trpo.natural_gradient_step(params, surrogate_fn=surrogate, kl_fn=kl, max_kl=0.01)
    assert bool(info["accepted"]) and _changed(new["used"], params["used"])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(learning_rate=float("inf")), "`learning_rate` must be a finite number; got inf"),
        (dict(critic_learning_rate=float("nan")), "`critic_learning_rate` must be a finite number; got nan"),
        (dict(temperature=float("inf")), "`temperature` must be a finite number; got inf"),
        (dict(max_grad_norm=float("inf")), "`max_grad_norm` must be a finite number; got inf"),
        (dict(learning_rate="3e-3"), "`learning_rate` must be a finite number; got '3e-3'"),
    ],
)
def test_non_finite_rates_and_temperatures_are_refused(changes, message):
    (name,) = changes
    group = GROUPED_FIELDS[name]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(RUN, **{group: dataclasses.replace(getattr(RUN, group), **changes)})


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr-grpo", "dapo", "gspo", "cispo", "trpo"])
def test_group_methods_refuse_a_group_of_one_before_any_compute(monkeypatch, name):
    model, params = models.init(CONFIG, jax.random.key(2))
    monkeypatch.setattr(training.loop, "collect_batch", lambda *a, **k: pytest.fail("a rollout was drawn"))
    with pytest.raises(
        ValueError,
        match=f"Algorithm {name!r} compares each completion with the others .*group_size=1 every advantage is 0",
    ):
        training.train(model, params, algorithms.get(name), dataclasses.replace(RUN, group_size=1), steps=1, task=TASK)


def test_methods_without_group_baselines_run_with_a_group_of_one(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(2))
    monkeypatch.setattr(
        DigitSumTask,
        "reward_components",
        lambda self, c, lengths, a: {"correct": np.ones(len(c)), "stops": np.zeros(len(c))},
    )
    state, history = training.train(
        model, params, algorithms.PG, dataclasses.replace(RUN, group_size=1), steps=1, task=TASK
    )
    assert int(state.step) == 1 and _changed(state.params, params)


# --- Runs that end early keep their state and history -------------------------------------------


class _FailsAtCall(DigitSumTask):
    """The digit task whose `correct` reward function raises from its ``fail_at``-th call on."""

    def __init__(self, fail_at: int, error: BaseException):
        super().__init__()
        object.__setattr__(self, "state", {"calls": 0, "fail_at": fail_at, "error": error})

    def correct(self, **kwargs):
        self.state["calls"] += 1
        if self.state["calls"] >= self.state["fail_at"]:
            raise self.state["error"]
        return super().correct(**kwargs)


def test_an_exception_in_a_reward_function_keeps_the_state_and_history_of_the_steps_done():
    model, params = models.init(CONFIG, jax.random.key(3))
    straight, straight_history = training.train(model, params, algorithms.GRPO, RUN, steps=3, task=TASK)
    start = training.init_state(model, params, algorithms.GRPO, RUN)
    with pytest.raises(
        training.RunStopped,
        match=r"stopped at step 3 \(3 of 5 steps done\): RewardFunctionError: "
        "In the rollout of train step 3: reward function 'correct' raised ZeroDivisionError: broken reward "
        r"at row 0 \(prompt '\d\+\d=', completion",
    ) as error:
        training.train(
            model,
            params,
            algorithms.GRPO,
            RUN,
            steps=5,
            task=_FailsAtCall(4, ZeroDivisionError("broken reward")),
            state=start,
        )
    stopped = error.value
    assert isinstance(stopped.__cause__, rewards.RewardFunctionError)
    assert isinstance(stopped.__cause__.__cause__, ZeroDivisionError)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(stopped.state))
    # The state after the 3 steps done, exactly, key included: continued from it
    # (`train(..., state=stopped.state)`), the run is the uninterrupted one.
    jax.tree.map(
        np.testing.assert_array_equal, jax.random.key_data(stopped.state.key), jax.random.key_data(straight.key)
    )
    jax.tree.map(np.testing.assert_array_equal, stopped.state._replace(key=None), straight._replace(key=None))
    assert [h["reward"] for h in stopped.history] == [h["reward"] for h in straight_history]


def test_a_failure_before_the_first_update_leaves_the_callers_state_intact():
    model, params = models.init(CONFIG, jax.random.key(3))
    start = training.init_state(model, params, algorithms.GRPO, RUN)
    with pytest.raises(training.RunStopped) as error:
        training.train(
            model, params, algorithms.GRPO, RUN, steps=2, task=_FailsAtCall(1, RuntimeError("down")), state=start
        )
    assert error.value.state is start and error.value.history == []
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(start))
    state, _ = training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK, state=start)
    assert int(state.step) == 1


def test_a_keyboard_interrupt_stops_the_run_as_a_keyboard_interrupt_with_its_state():
    model, params = models.init(CONFIG, jax.random.key(3))

    def interrupt_after_step_1(end):
        if end.step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as error:
        training.train(model, params, algorithms.RLOO, RUN, steps=4, task=TASK, callback=interrupt_after_step_1)
    assert isinstance(error.value, training.RunInterrupted)
    assert int(error.value.state.step) == 2 and len(error.value.history) == 2  # step 1 completed before its callback
    copy = pickle.loads(pickle.dumps(error.value))  # e.g. across processes
    assert copy.history == error.value.history and int(copy.state.step) == 2


def test_ctrl_c_during_the_update_dispatch_is_delivered_once_its_result_is_held():
    done, handler = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with training.loop._interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs between bytecodes: here, if it were not held
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_second_ctrl_c_while_held_is_delivered_at_once():
    done, handler = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with training.loop._interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("held")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a hung callback: the second Ctrl-C gets out of it
            done.append("not reached")
    assert done == ["held"] and signal.getsignal(signal.SIGINT) is handler


def test_a_handler_that_does_not_raise_keeps_the_run_going(monkeypatch):
    """A caller's SIGINT handler that only sets a flag (a graceful-stop request) is theirs:
    the run is not stopped for it."""
    model, params = models.init(CONFIG, jax.random.key(3))
    requests = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: requests.append(signum))
    try:

        def ctrl_c_at_step_1(end):
            if end.step == 1:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)

        state, history = training.train(
            model, params, algorithms.RLOO, RUN, steps=3, task=TASK, callback=ctrl_c_at_step_1
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert requests == [signal.SIGINT] and len(history) == 3 and int(state.step) == 3


def test_a_ctrl_c_that_python_drops_still_stops_the_run_after_its_step():
    """Python prints and drops a KeyboardInterrupt raised in a garbage-collection callback
    (JAX registers one); here a reward function swallows it the same way at step 1."""
    model, params = models.init(CONFIG, jax.random.key(3))
    calls = []

    def swallowing_reward(completions, **kwargs):
        calls.append(len(calls))
        if len(calls) == 2:  # step 1's rewards
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs between bytecodes: here
            except KeyboardInterrupt:
                pass
        return [0.0] * len(completions)

    class SwallowingTask:  # the digit task with that reward
        reward_fns, reward_weights = (swallowing_reward,), (1.0,)

        def __getattr__(self, name):
            return getattr(TASK, name)

    task = SwallowingTask()
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(training.RunInterrupted) as error:
        training.train(model, params, algorithms.RLOO, RUN, steps=4, task=task)
    assert int(error.value.state.step) == 2 and len(error.value.history) == 2  # step 1 finished, then stopped
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_ctrl_c_during_the_callback_comes_after_it_returns():
    model, params = models.init(CONFIG, jax.random.key(3))
    finished = []

    def checkpoint_like(end):
        if end.step == 0:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a checkpoint being written: it must not stop half way
        finished.append(end.step)

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(training.RunInterrupted) as error:
        training.train(model, params, algorithms.RLOO, RUN, steps=4, task=TASK, callback=checkpoint_like)
    assert finished == [0] and int(error.value.state.step) == 1 and len(error.value.history) == 1
    assert signal.getsignal(signal.SIGINT) is handler


def test_sigint_mid_run_leaves_a_consistent_state(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent("""
        import jax
        from jaxrl_llm import algorithms, models, training
        from jaxrl_llm.sampling import SamplingConfig
        from jaxrl_llm.tasks import DigitSumTask
        task = DigitSumTask()
        config = models.ModelConfig(vocab_size=len(task.tokenizer), hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
        model, params = models.init(config, jax.random.key(0))
        run = training.TrainConfig(num_prompts=4, group_size=4, sampling=SamplingConfig(max_new_tokens=3))
        def started(end):
            if end.step == 1:
                print("running", flush=True)
        try:
            training.train(model, params, algorithms.GRPO, run, steps=100000, task=task, callback=started)
        except training.RunInterrupted as stop:
            steps = int(stop.state.step)
            assert steps == len(stop.history) >= 2, (steps, len(stop.history))
            assert all(not leaf.is_deleted() and bool(jax.numpy.isfinite(leaf).all())
                       for leaf in jax.tree.leaves(stop.state.params))
            print("stopped", steps, flush=True)
    """)
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stdout.readline().strip() == "running", process.stderr.read()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.split()[0] == "stopped", out


# --- Inputs that do not fit ---------------------------------------------------------------------


def test_a_state_from_another_method_or_model_is_refused_by_name_before_any_compute(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(6))
    big_model, big_params = models.init(
        dataclasses.replace(CONFIG, hidden_size=64, intermediate_size=128), jax.random.key(6)
    )
    grpo_state = training.init_state(model, params, algorithms.GRPO, RUN)
    monkeypatch.setattr(training.loop, "collect_batch", lambda *a, **k: pytest.fail("a rollout was drawn"))
    cases = [
        (model, params, algorithms.PPO, "`state.critic_params` is None, but algorithm 'ppo' on this model needs one"),
        (
            model,
            params,
            algorithms.TRPO,
            r"`state.opt_state` does not fit algorithm 'trpo' on this model: it has "
            r"\.inner\[1\]\.count",
        ),
        (
            big_model,
            big_params,
            algorithms.GRPO,
            r"`state.params\['embed_tokens'\].value` is \[21, 32\] float32, but "
            r"algorithm 'grpo' on this model needs \[21, 64\] float32",
        ),
    ]
    for run_model, run_params, method, message in cases:
        with pytest.raises(ValueError, match=message):
            training.train(run_model, run_params, method, RUN, steps=1, task=TASK, state=grpo_state)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(grpo_state))
    with pytest.raises(
        ValueError,
        match=r"`params\['embed_tokens'\].value` is \[21, 64\], but the model's config "
        r"needs \[21, 32\]. Are they the params of another model\?",
    ):
        training.train(model, big_params, algorithms.GRPO, RUN, steps=1, task=TASK)
    with pytest.raises(ValueError, match="`state` must be a TrainState"):
        training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK, state=params)


def test_all_finite_is_exact_for_large_values_and_ignores_integers():
    assert bool(all_finite({"a": jnp.full(3, 3e38), "b": jnp.arange(3)}))  # a norm would overflow
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    assert not bool(all_finite([jnp.array([jnp.nan], jnp.bfloat16)]))
    assert bool(all_finite({}))
