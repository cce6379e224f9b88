"""Gradient accumulation, the reference kept only when used, the exact KL, and the state
changed only inside the jitted halves."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, kl, models, ops, training
from tests.training.test_step import CONFIG, RUN, _batch, _rows


def _uneven(batch):
    """``batch`` with completions of 0 to 3 tokens (row 5 empty, as dynamic sampling's
    padding) and varied rewards: micro-batches then hold different token and row counts."""
    lengths = np.array([3, 1, 2, 3, 0, 0, 2, 1, 3, 3, 1, 2, 2, 3, 1, 1])
    mask = np.arange(batch.completion_mask.shape[1])[None] < lengths[:, None]
    return batch._replace(completion_mask=jnp.asarray(mask), rewards=jnp.linspace(-1.0, 2.0, 16) ** 2)


def _one_update(model, params, algorithm, run, batch):
    train_step = training.make_train_step(model, algorithm, run)
    state, fixed = training.init_state(model, params, algorithm, run), training.fixed_params(params, algorithm, run)
    scored, _ = jax.jit(train_step.score)(state, fixed, batch)
    return jax.jit(train_step.update)(state, fixed, scored)


@pytest.mark.parametrize(
    "method, minibatch_size, micro_batch_size, agg",
    [
        ("grpo", None, 8, None),  # seq-mean-token-mean; micro-batches of two whole groups
        ("grpo", None, 2, None),  # micro-batches split the groups of 4: each row runs its prompt
        ("dapo", None, 4, None),  # token-mean
        ("dr-grpo", None, 4, None),  # seq-mean-token-sum-norm
        ("dr-grpo", None, 4, "token-sum-norm"),  # verl's: the parts' losses add up
        ("ppo", 8, 2, None),  # shuffled minibatches, and the critic's token-mean value loss
    ],
)
def test_gradient_accumulation_over_micro_batches_equals_the_whole_minibatch(
    method, minibatch_size, micro_batch_size, agg
):
    algorithm = dataclasses.replace(algorithms.get(method), dynamic_sampling=False)
    if agg is not None:
        algorithm = dataclasses.replace(algorithm, agg=agg)
    model, params = models.init(CONFIG, jax.random.key(0))
    batch = _uneven(_batch(model, params, seed=3))
    # Adam's sqrt(v) + eps: with eps 1e-8 a coordinate whose gradient is rounding noise
    # steps by about +-lr on it; 1e-4 keeps the comparison on the accumulation.
    run = dataclasses.replace(
        RUN, minibatch_size=minibatch_size, optimizer=dataclasses.replace(RUN.optimizer, adam_eps=1e-4)
    )
    whole, whole_metrics = _one_update(model, params, algorithm, run, batch)
    accumulated_run = dataclasses.replace(run, micro_batch_size=micro_batch_size)
    assert accumulated_run.num_micro_batches == (minibatch_size or 16) // micro_batch_size
    accumulated, metrics = _one_update(model, params, algorithm, accumulated_run, batch)
    for name in ("loss", "grad_norm", "entropy", "ratio_mean", *(("value_loss",) if algorithm.needs_critic else ())):
        np.testing.assert_allclose(
            float(metrics[name]), float(whole_metrics[name]), rtol=2e-5, atol=1e-7, err_msg=name
        )  # the loss's normaliser, and token means
    chex.assert_trees_all_close(
        (accumulated.params, accumulated.critic_params), (whole.params, whole.critic_params), atol=2e-6, rtol=1e-5
    )
    assert float(whole_metrics["grad_norm"]) > 0


def test_micro_batches_must_divide_the_minibatch_and_trpo_takes_none():
    with pytest.raises(
        ValueError,
        match=r"`micro_batch_size` must divide the rows of an optimizer step "
        r"\(minibatch_size = 8\); got 3",
    ):
        dataclasses.replace(RUN, minibatch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="gradient accumulation is not available"):
        training.make_train_step(None, algorithms.TRPO, dataclasses.replace(RUN, micro_batch_size=8))


def _score_passes(monkeypatch, model, algorithm, run, params, batch) -> int:
    """Decoder passes ``score`` traces."""
    passes = []
    real = models.functional.group_completion_hidden_states
    counting = lambda *a, **k: passes.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(models.functional, "group_completion_hidden_states", counting)
    train_step = training.make_train_step(model, algorithm, run)
    state, fixed = training.init_state(model, params, algorithm, run), training.fixed_params(params, algorithm, run)
    jax.eval_shape(train_step.score, state, fixed, batch)
    monkeypatch.setattr(models.functional, "group_completion_hidden_states", real)
    return len(passes)


def test_a_method_without_kl_keeps_and_runs_no_reference_unless_a_metric_asks(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(0))
    batch = _batch(model, params)
    method = algorithms.DR_GRPO  # beta = 0, on-policy
    assert not training.state.uses_reference(method, RUN)
    assert training.fixed_params(params, method, RUN).reference is None
    assert _score_passes(monkeypatch, model, method, RUN, params, batch) == 0
    _, metrics = _one_update(model, params, method, RUN, batch)
    assert "kl_k3" not in metrics

    with_metric = dataclasses.replace(RUN, reference_metrics=True)
    assert _score_passes(monkeypatch, model, method, with_metric, params, batch) == 1  # the reference
    _, metrics = _one_update(model, params, method, with_metric, batch)
    assert float(metrics["kl_k3"]) == 0.0  # the policy is its reference at step 0
    exact = dataclasses.replace(RUN, exact_kl=True)
    assert _score_passes(monkeypatch, model, method, exact, params, batch) == 2  # reference and policy
    assert _score_passes(monkeypatch, model, algorithms.GRPO, RUN, params, batch) == 1  # beta > 0: reference

    with pytest.raises(ValueError, match=r"`ref_params` given, but algorithm 'dr-grpo' has no KL term"):
        training.fixed_params(params, method, RUN, ref_params=params)


def test_the_exact_kl_is_the_full_vocabulary_kl_of_the_sampling_policy_to_the_reference():
    model, params = models.init(CONFIG, jax.random.key(0))
    _, reference_params = models.init(CONFIG, jax.random.key(1))
    batch = _batch(model, params, seed=4)
    for method, run in (
        (algorithms.GRPO, RUN),  # on-policy: score runs the policy for the metric
        (algorithms.PPO, dataclasses.replace(RUN, minibatch_size=8)),
    ):  # old log-probs' pass
        run = dataclasses.replace(run, exact_kl=True, sampling=dataclasses.replace(run.sampling, temperature=0.7))
        train_step = training.make_train_step(model, method, run)
        state = training.init_state(model, params, method, run)
        fixed = training.fixed_params(params, method, run, ref_params=reference_params)
        _, metrics = jax.jit(train_step.score)(state, fixed, batch)
        # Independently: full logits of both models at the sampling temperature, exact KL, token mean.
        tokens, mask = _rows(batch)
        n = run.sampling.max_new_tokens
        policy = models.forward(model, params, tokens, attention_mask=mask)[:, -n - 1 : -1] / 0.7
        reference = models.forward(model, reference_params, tokens, attention_mask=mask)[:, -n - 1 : -1] / 0.7
        expected = ops.masked_mean(kl.categorical(policy, reference), batch.completion_mask)
        assert float(expected) > 1e-3
        np.testing.assert_allclose(float(metrics["kl_exact"]), float(expected), rtol=1e-5)


def test_the_update_advances_the_key_baseline_stream_and_learning_rate_itself():
    """Every piece of state a step changes is changed inside the jitted halves."""
    model, params = models.init(CONFIG, jax.random.key(0))
    method = algorithms.REINFORCE_BASELINE
    train_step = training.make_train_step(model, method, RUN)
    state, fixed = training.init_state(model, params, method, RUN), training.fixed_params(params, method, RUN)
    batch = _batch(model, params)._replace(prompts_drawn=jnp.asarray(12, jnp.int32))
    scored, _ = jax.jit(train_step.score)(state, fixed, batch)
    first_key = np.asarray(jax.random.key_data(training.state.rollout_key(state)))
    new, metrics = jax.jit(train_step.update)(state, fixed, scored)
    assert int(new.prompts_drawn) == 12 and int(new.step) == 1
    np.testing.assert_allclose(float(new.baseline.mean), float(jnp.mean(batch.rewards)), rtol=1e-6)  # first batch
    assert not np.array_equal(np.asarray(jax.random.key_data(training.state.rollout_key(new))), first_key)
    schedule = training.optim.learning_rate_schedule(
        learning_rate=RUN.optimizer.learning_rate, warmup_steps=RUN.optimizer.warmup_steps
    )
    np.testing.assert_allclose(float(metrics["learning_rate"]), float(schedule(0)), rtol=1e-6)
    again, _ = jax.jit(train_step.update)(new, fixed, jax.jit(train_step.score)(new, fixed, batch)[0])
    assert int(again.prompts_drawn) == 24
