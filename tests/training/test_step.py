"""The train step's mechanics: old log-probs, minibatches, TRPO's bound, skips, resume."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, kl, models, ops, rewards, sampling, sharding, training
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import DigitSumTask
from tests import reference

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


def _batch(model, params, seed=0, run=RUN):
    """A rollout of the digit task as the train step consumes it."""
    rng = np.random.default_rng(seed)
    prompts = TASK.prompts(rng, run.num_prompts)
    answers = np.asarray(prompts.columns["answer"])
    rollout = jax.device_get(
        sampling.sample(
            model,
            params,
            prompts.tokens,
            prompts.mask,
            jax.random.key(seed),
            num_samples=run.group_size,
            max_new_tokens=run.sampling.max_new_tokens,
            eos_ids=(TASK.eos_id,),
            pad_id=TASK.pad_id,
        )
    )
    rewards = TASK.rewards(np.asarray(rollout.completion_tokens), rollout.lengths, np.repeat(answers, run.group_size))
    return training.Batch.from_rollout(prompts.tokens, prompts.mask, rollout, rewards)


def _rows(batch):
    """``(tokens, mask)`` ``[B, S + N]``: each completion after its own copy of its prompt."""
    group = batch.completion_tokens.shape[0] // batch.prompt_tokens.shape[0]
    tokens = jnp.concatenate([jnp.repeat(batch.prompt_tokens, group, 0), batch.completion_tokens], axis=1)
    mask = jnp.concatenate(
        [jnp.repeat(batch.prompt_mask, group, 0), jnp.ones(batch.completion_tokens.shape, bool)], axis=1
    )
    return tokens, mask


class _Scored(DigitSumTask):
    """The digit task with one reward function of its own."""

    def __init__(self, fn):
        super().__init__()
        object.__setattr__(self, "fn", fn)

    @property
    def reward_fns(self):
        return (self.fn,)

    @property
    def reward_weights(self):
        return (1.0,)


def _rewards_reach_the_step(monkeypatch, values):
    """Each train step's rewards are the next of ``values``, as the jitted step receives them:
    past the reward functions' checks (which refuse NaN), as a bug in the loop would pass them."""
    values = iter(values)

    def constant(fns, weights, *, completions, **kwargs):
        reward = np.full(len(completions), next(values), np.float32)
        return rewards.RewardResult(total=reward, values={"constant": reward}, errors={})

    monkeypatch.setattr(training.collect.rewards, "compute_rewards", constant)


def _step(algorithm, run=RUN, seed=0):
    """The model, its params, ``score(state, batch)`` and ``update(state, scored)`` jitted
    over the run's fixed params (the reference: ``params``), and the state at step 0."""
    model, params = models.init(CONFIG, jax.random.key(seed))
    train_step = training.make_train_step(model, algorithm, run)
    state = training.init_state(model, params, algorithm, run)
    fixed = training.fixed_params(params, algorithm, run)
    score, update = jax.jit(train_step.score), jax.jit(train_step.update)
    return model, params, lambda s, b: score(s, fixed, b), lambda s, scored: update(s, fixed, scored), state


def _changed(tree_a, tree_b) -> bool:
    return any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), tree_a, tree_b)))


def test_on_policy_step_has_ratio_one_no_clipping_and_no_old_policy_forward(monkeypatch):
    model, params, score, update, state = _step(algorithms.GRPO)
    batch = _batch(model, params)
    scored, _ = score(state, batch)
    np.testing.assert_array_equal(scored.old_logp, batch.sampling_logp)  # reused, not recomputed
    state, metrics = update(state, scored)
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0
    assert float(metrics["clip_fraction"]) == 0.0

    # Count the decoder passes each half traces: score runs the reference only.
    passes = []
    real = models.functional.group_completion_hidden_states
    counting = lambda *a, **k: passes.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(models.functional, "group_completion_hidden_states", counting)  # what the train step calls
    for mu, expected_score_passes in ((1, 1), (2, 2)):
        passes.clear()
        method = dataclasses.replace(algorithms.GRPO, num_iterations=mu)
        train_step = training.make_train_step(model, method, RUN)
        state = training.init_state(model, params, method, RUN)
        jax.eval_shape(train_step.score, state, training.fixed_params(params, method, RUN), batch)
        assert len(passes) == expected_score_passes, (mu, len(passes))


def test_with_several_iterations_old_logprobs_come_from_the_snapshot():
    method = dataclasses.replace(algorithms.GRPO, num_iterations=3)
    model, params, score, update, state = _step(
        method, dataclasses.replace(RUN, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-2))
    )
    batch = _batch(model, params)
    tokens, mask = _rows(batch)
    snapshot = models.completion_logprobs(model, params, tokens, mask, RUN.sampling.max_new_tokens)
    scored, _ = score(state, batch)
    np.testing.assert_allclose(scored.old_logp, snapshot, atol=1e-6)  # teacher-forced at the sampling params
    state, metrics = update(state, scored)
    assert float(metrics["ratio_max"]) - float(metrics["ratio_min"]) > 1e-3  # later passes moved away
    after = models.completion_logprobs(model, state.params, tokens, mask, RUN.sampling.max_new_tokens)
    assert float(jnp.max(jnp.abs(after - snapshot) * batch.completion_mask)) > 1e-3


@pytest.mark.parametrize("name", ["GRPO", "PPO", "TRPO", "DAPO"])
def test_sharing_each_groups_prompt_changes_no_number_of_the_step(name):
    """``share_prompts`` runs each prompt once in every whole-batch pass (score, the
    update with one minibatch, PPO's critic, TRPO's KL): scores, metrics and the updated
    params equal those of the plain per-row passes."""
    method = getattr(algorithms, name)
    model, params = models.init(CONFIG, jax.random.key(0))
    batch = _batch(model, params, seed=2)
    results = []
    for share in (False, True):
        run = dataclasses.replace(RUN, share_prompts=share)
        train_step = training.make_train_step(model, method, run)
        state, fixed = training.init_state(model, params, method, run), training.fixed_params(params, method, run)
        scored, score_metrics = jax.jit(train_step.score)(state, fixed, batch)
        state, metrics = jax.jit(train_step.update)(state, fixed, scored)
        results.append((scored, {**score_metrics, **metrics}, state.params, state.critic_params))
    (plain, plain_metrics, *plain_params), (shared, shared_metrics, *shared_params) = results
    for field in ("old_logp", "ref_logp", "advantages", "returns", "old_values"):
        if getattr(plain, field) is not None:
            np.testing.assert_allclose(getattr(shared, field), getattr(plain, field), atol=2e-5, err_msg=field)
    assert shared_metrics.keys() == plain_metrics.keys()
    for key in plain_metrics:
        np.testing.assert_allclose(shared_metrics[key], plain_metrics[key], rtol=1e-4, atol=1e-5, err_msg=key)
    # 5e-5, under a tenth of the step's learning rate (6e-4): GRPO's KL gradient is rounding noise at step 0 (policy
    # = reference), which Adam turns into moves of lr |g| / (|g| + eps), 2.7e-5 with jax 0.12's XLA (1e-8 with 0.10).
    chex.assert_trees_all_close(shared_params, plain_params, atol=5e-5)
    assert _changed(plain_params[0], params)  # the step did something to compare


def test_a_rollout_mesh_must_split_the_prompts_evenly():
    model, params = models.init(CONFIG, jax.random.key(0))
    with pytest.raises(ValueError, match=r"num_prompts \(4\) must be a multiple of the rollout mesh's 8 'data'"):
        training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK, rollout_mesh=sharding.make_mesh())


def test_minibatches_take_one_optimizer_step_each_per_pass():
    run = dataclasses.replace(RUN, minibatch_size=4)  # B = 16: 4 minibatches
    method = dataclasses.replace(algorithms.RLOO, num_iterations=2)
    model, params, score, update, state = _step(method, run)
    scored, _ = score(state, _batch(model, params))
    state, metrics = update(state, scored)
    assert int(state.opt_state.inner[1].count) == 8  # mu * M Adam steps
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_trpo_step_respects_the_kl_bound_on_its_batch():
    model, params, score, update, state = _step(algorithms.TRPO)
    batch = _batch(model, params, seed=1)._replace(rewards=jnp.linspace(0.0, 1.5, 16))
    state, metrics = update(state, score(state, batch)[0])
    assert float(metrics["trpo_accepted"]) == 1.0
    # Independently: full logits of both params, exact categorical KL, token mean.
    n = RUN.sampling.max_new_tokens
    tokens, mask = _rows(batch)
    old = models.forward(model, params, tokens, attention_mask=mask)[:, -n - 1 : -1]
    new = models.forward(model, state.params, tokens, attention_mask=mask)[:, -n - 1 : -1]
    divergence = float(ops.masked_mean(kl.categorical(old, new), batch.completion_mask))
    assert 0 < divergence <= algorithms.TRPO.max_kl * (1 + 1e-4)
    np.testing.assert_allclose(divergence, float(metrics["trpo_kl"]), rtol=1e-3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_prompts=0), r"`num_prompts` must be an integer >= 1; got 0"),
        (dict(group_size=2.0), r"`group_size` must be an integer >= 1; got 2.0"),
        (dict(minibatch_size=3), r"`minibatch_size` must divide the batch B = num_prompts \* group_size = 16; got 3"),
        (dict(sampling=SamplingConfig(temperature=0.0)), r"`sampling.temperature` must be a finite number > 0"),
        (dict(max_refill_rounds=-1), r"`max_refill_rounds` must be an integer >= 0; got -1"),
        (dict(share_prompts="yes"), r"`share_prompts` must be True or False; got 'yes'"),
    ],
)
def test_bad_train_configs_say_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(RUN, **changes)


def test_combinations_the_step_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="one natural-gradient step on the whole batch: set TrainConfig.minibatch"):
        training.make_train_step(None, algorithms.TRPO, dataclasses.replace(RUN, minibatch_size=8))
    with pytest.raises(ValueError, match="the TRPO update trains no critic"):
        training.make_train_step(None, dataclasses.replace(algorithms.TRPO, advantage="gae"), RUN)
    with pytest.raises(ValueError, match="dynamic sampling masks out groups without signal, but advantage='grpo'"):
        training.make_train_step(None, dataclasses.replace(algorithms.DAPO, group_scale="batch"), RUN)


def test_advantage_metrics_match_numpy_and_stay_finite_for_equal_rewards():
    model, params, score, _, state = _step(algorithms.PG)
    batch = _batch(model, params)
    for values in (np.full(16, 1.1, np.float32), np.random.default_rng(0).normal(100.0, 0.01, 16).astype(np.float32)):
        _, metrics = score(state, batch._replace(rewards=jnp.asarray(values)))
        per_token = np.broadcast_to(values[:, None], batch.completion_mask.shape)[np.asarray(batch.completion_mask)]
        np.testing.assert_allclose(float(metrics["advantage_std"]), per_token.astype(np.float64).std(), atol=2e-6)
        np.testing.assert_allclose(float(metrics["advantage_mean"]), per_token.mean(), rtol=1e-6)


def test_ppo_critic_starts_at_zero_and_its_value_loss_falls_on_a_batch():
    model, params, score, update, state = _step(algorithms.PPO)
    batch = _batch(model, params, seed=2)._replace(rewards=jnp.linspace(0.0, 1.5, 16))
    values = training.critic.completion_values(
        model, state.critic_params, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens
    )
    np.testing.assert_array_equal(values, 0.0)
    losses = []
    for _ in range(6):
        scored, _ = score(state, batch)
        state, metrics = update(state, scored)
        losses.append(float(metrics["value_loss"]))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", ["GRPO", "TRPO"])
def test_non_finite_updates_are_skipped_counted_and_leave_params_unchanged(name):
    model, params, score, update, state = _step(getattr(algorithms, name))
    batch = _batch(model, params)
    poisoned = batch._replace(rewards=batch.rewards.at[0].set(jnp.nan))  # a NaN reward: NaN advantages
    before = jax.tree.map(np.asarray, state.params)
    before_opt = jax.tree.map(np.asarray, state.opt_state)
    for expected in (1, 2):
        state, _ = update(state, score(state, poisoned)[0])
        assert int(state.skipped_updates) == expected and int(state.consecutive_skips) == expected
        chex.assert_trees_all_equal(state.params, before)
        chex.assert_trees_all_equal(state.opt_state, before_opt)
    state, _ = update(state, score(state, batch)[0])
    assert int(state.consecutive_skips) == 0 and int(state.skipped_updates) == 2
    assert _changed(state.params, before)


@pytest.mark.parametrize("mu, minibatch_size", [(1, None), (2, 8)])
def test_the_loop_stops_after_max_consecutive_skipped_steps_and_keeps_the_state(monkeypatch, mu, minibatch_size):
    model, params = models.init(CONFIG, jax.random.key(4))
    _rewards_reach_the_step(monkeypatch, [np.nan] * 5)
    method = dataclasses.replace(algorithms.RLOO, num_iterations=mu)
    run = dataclasses.replace(RUN, max_consecutive_skips=2, minibatch_size=minibatch_size)
    with pytest.raises(training.NonFiniteUpdates, match="2 updates in a row had a non-finite loss") as error:
        training.train(model, params, method, run, steps=5, task=TASK)
    history = error.value.history
    assert len(history) == 2  # train steps, not minibatches
    assert history[-1]["skipped_updates"] == 2 * mu * run.num_minibatches
    chex.assert_trees_all_equal(error.value.state.params, params)


def test_the_running_baseline_is_carried_across_steps_and_a_non_finite_batch_does_not_poison_it(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(9))
    _rewards_reach_the_step(monkeypatch, [1.0, np.nan, 3.0, 5.0])  # one constant reward per step
    state, history = training.train(model, params, algorithms.REINFORCE_BASELINE, RUN, steps=4, task=TASK)
    assert [h["skipped_updates"] for h in history] == [0, 1, 1, 1]  # only the NaN step is skipped
    decay, expected = algorithms.REINFORCE_BASELINE.baseline_decay, 1.0  # the first batch sets b
    for reward in (3.0, 5.0):
        expected = decay * expected + (1 - decay) * reward
    np.testing.assert_allclose(float(state.baseline.mean), expected, rtol=1e-6)
    assert int(state.baseline.count) == 3 * RUN.batch_size


def test_reward_functions_must_return_one_number_per_completion():
    model, params = models.init(CONFIG, jax.random.key(5))

    def short(completions, **kwargs):
        return [0.0] * 3

    with pytest.raises(
        training.RunStopped,
        match=r"RewardFunctionError: In the rollout of train step 0: reward function 'short' "
        r"returned 3 values for 16 completions",
    ) as error:
        training.train(model, params, algorithms.RLOO, RUN, steps=1, task=_Scored(short))
    assert isinstance(error.value.__cause__, rewards.RewardFunctionError)
    assert error.value.__cause__.function is short


def test_a_run_continued_from_its_state_matches_the_uninterrupted_run():
    model, params = models.init(CONFIG, jax.random.key(6))
    method = dataclasses.replace(algorithms.GRPO, num_iterations=2)
    run = dataclasses.replace(RUN, minibatch_size=8)
    straight, _ = training.train(model, params, method, run, steps=4, task=TASK)
    half, _ = training.train(model, params, method, run, steps=2, task=TASK)
    resumed, history = training.train(model, params, method, run, steps=2, task=TASK, state=half)
    assert int(resumed.step) == 4 and history[-1]["update_traces"] == 1
    # The update donates the state: the buffers passed in were reused, not copied.
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((half.params, half.opt_state)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))  # `params` is copied, never donated
    chex.assert_trees_all_equal(resumed.params, straight.params)
    # The reference is `params`, read beside the state and never donated: intact.
    chex.assert_trees_all_equal(params, models.init(CONFIG, jax.random.key(6))[1])
    assert set(training.TrainState._fields).isdisjoint({"ref_params", "reference", "base"})


def test_the_state_copies_the_params_and_the_fixed_params_are_the_callers_arrays():
    model, params = models.init(CONFIG, jax.random.key(6))
    _, other = models.init(CONFIG, jax.random.key(7))
    host = jax.tree.map(np.asarray, other)
    state = training.init_state(model, params, algorithms.GRPO, RUN)
    for copy, leaf in zip(*map(jax.tree.leaves, (state.params, params)), strict=True):  # the state is donated
        assert copy is not leaf and copy.unsafe_buffer_pointer() != leaf.unsafe_buffer_pointer()
    shared = training.fixed_params(params, algorithms.GRPO, RUN)
    given = training.fixed_params(params, algorithms.GRPO, RUN, ref_params=host)
    assert all(ref is leaf for ref, leaf in zip(*map(jax.tree.leaves, (shared.reference, params)), strict=True))
    assert all(isinstance(ref, jax.Array) for ref in jax.tree.leaves(given.reference))  # put on the device once
    chex.assert_trees_all_equal(given.reference, other)
    assert shared.base is None and given.base is None
    assert training.fixed_params(params, algorithms.DAPO, RUN) == training.FixedParams(None, None)  # no KL term


def test_a_run_continued_with_its_current_params_as_reference_keeps_them_apart_from_the_donated_state():
    """``train(model, state.params, ..., state=state)``: the reference is the current policy,
    copied away from the state the update donates (sharing its buffers would delete them)."""
    model, params = models.init(CONFIG, jax.random.key(6))
    half, _ = training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK)
    current = jax.tree.map(np.array, half.params)
    resumed, history = training.train(model, half.params, algorithms.GRPO, RUN, steps=2, task=TASK, state=half)
    assert int(resumed.step) == 3
    assert history[0]["kl_k3"] == 0.0 and history[1]["kl_k3"] > 0  # the reference: the policy at the call
    assert _changed(resumed.params, current)


def test_a_step_refuses_fixed_params_without_what_it_reads():
    model, params, score, _, state = _step(algorithms.GRPO)
    train_step = training.make_train_step(model, algorithms.GRPO, RUN)
    batch = _batch(model, params)
    with pytest.raises(ValueError, match=r"`fixed.reference` is None: build `fixed` with training.fixed_params"):
        train_step.score(state, training.FixedParams(), batch)
    with pytest.raises(ValueError, match=r"`fixed` must be training.FixedParams"):
        train_step.score(state, params, batch)
    lora_model, adapters = models.lora.add_adapters(model, models.LoraConfig(rank=2), jax.random.key(1))
    lora_step = training.make_train_step(lora_model, algorithms.DAPO, RUN)
    lora_state = training.init_state(lora_model, adapters, algorithms.DAPO, RUN)
    with pytest.raises(ValueError, match=r"`fixed.base` is None"):
        lora_step.score(lora_state, training.FixedParams(), batch)


def test_rollouts_split_over_a_mesh_train_exactly_like_single_device_ones():
    model, params = models.init(CONFIG, jax.random.key(8))
    single, single_history = training.train(model, params, algorithms.GRPO, RUN, steps=2, task=TASK)
    split, split_history = training.train(
        model, params, algorithms.GRPO, RUN, steps=2, task=TASK, rollout_mesh=sharding.make_mesh(4)
    )
    for ours, theirs in zip(split_history, single_history):
        assert ours["reward"] == theirs["reward"] and ours["completion_length"] == theirs["completion_length"]
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-6), split.params, single.params)


class _HalfSolvable(DigitSumTask):
    """Prompts whose answer is < 5 are scored as usual; the others always get 0 (no signal)."""

    def reward_components(self, completion_tokens, lengths, answers):
        components = super().reward_components(completion_tokens, lengths, answers)
        return {name: np.where(np.asarray(answers) < 5, values, 0.0) for name, values in components.items()}


def test_dynamic_sampling_refills_the_batch_with_groups_that_carry_signal():
    model, params = models.init(CONFIG, jax.random.key(7))
    task = _HalfSolvable()
    sampler = sampling.Sampler(model=model, eos_ids=(task.eos_id,), pad_id=task.pad_id)
    run = dataclasses.replace(RUN, max_refill_rounds=6)
    collected = training.collect.collect_batch(
        sampler, params, task, algorithms.DAPO, run, key=jax.random.key(0), position=0
    )
    rollouts = collected.rollouts
    rewards = rollouts.rewards.reshape(RUN.num_prompts, RUN.group_size)
    kept = rollouts.completion_mask.reshape(RUN.num_prompts, RUN.group_size, -1).any(axis=(1, 2))
    assert collected.refill_rounds >= 1 and kept.any()
    assert collected.prompts_drawn == (1 + collected.refill_rounds) * RUN.num_prompts
    np.testing.assert_array_equal(kept, rewards.max(1) > rewards.min(1))  # exactly the groups with signal
    assert rollouts.prompt_tokens.shape == (RUN.num_prompts, 8)  # each prompt once, beside its completions
    assert rollouts.completion_tokens.shape == (RUN.batch_size, RUN.sampling.max_new_tokens)


def test_a_buffer_that_fits_the_budget_is_kept_and_the_presets_is_scaled_to_a_fifth():
    assert training.fit_overlong_buffer(algorithms.DAPO, 10).overlong_buffer == 2
    assert training.fit_overlong_buffer(algorithms.DAPO, 4).overlong_buffer == 0  # no room: off
    own = dataclasses.replace(algorithms.DAPO, overlong_buffer=7)
    assert training.fit_overlong_buffer(own, 10) is own
    assert training.fit_overlong_buffer(own, 7) is own


def test_overlong_shaping_enters_the_rewards_the_advantages_and_the_group_metric_see(monkeypatch):
    model, params = models.init(CONFIG, jax.random.key(10))

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    run = dataclasses.replace(RUN, sampling=dataclasses.replace(RUN.sampling, max_new_tokens=10))
    method = dataclasses.replace(algorithms.DAPO, overlong_buffer=4, overlong_penalty=0.5, dynamic_sampling=False)
    sampler = sampling.Sampler(model=model, eos_ids=(TASK.eos_id,), pad_id=TASK.pad_id)
    collected = training.collect.collect_batch(
        sampler, params, _Scored(zero), method, run, key=jax.random.key(0), position=0
    )
    expected = reference.overlong_penalty(collected.rollouts.lengths, max_len=10, buffer=4, penalty=0.5)
    assert np.any(expected < 0) and np.any(expected == 0)
    np.testing.assert_allclose(collected.rollouts.rewards, expected, rtol=1e-6)
    # The task's rewards are all 0, but the shaped ones, which the advantages use, differ in some groups.
    _, history = training.train(model, params, method, run, steps=1, task=_Scored(zero))
    assert history[0]["reward"] == 0 and history[0]["identical_reward_groups"] < 1


def test_a_minibatch_of_padding_rows_takes_no_optimizer_step():
    model, params, score, update, state = _step(algorithms.GRPO)
    batch = _batch(model, params)
    state, _ = update(state, score(state, batch)[0])  # one real step: Adam has momentum now
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    empty = batch._replace(completion_mask=jnp.zeros_like(batch.completion_mask))
    state, _ = update(state, score(state, empty)[0])
    chex.assert_trees_all_equal((state.params, state.opt_state), before)
    assert int(state.skipped_updates) == 0  # not a non-finite skip


def test_dynamic_sampling_reads_the_tasks_rewards_not_the_length_shaping():
    """Groups all right or all wrong carry no signal, whatever their overlong penalties (DAPO)."""
    model, params = models.init(CONFIG, jax.random.key(10))

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    run = dataclasses.replace(RUN, max_refill_rounds=1, sampling=dataclasses.replace(RUN.sampling, max_new_tokens=10))
    method = dataclasses.replace(algorithms.DAPO, overlong_buffer=4, overlong_penalty=0.5)
    sampler = sampling.Sampler(model=model, eos_ids=(TASK.eos_id,), pad_id=TASK.pad_id)
    collected = training.collect.collect_batch(
        sampler, params, _Scored(zero), method, run, key=jax.random.key(0), position=0
    )
    shaped = collected.first_round.rollouts.rewards.reshape(RUN.num_prompts, RUN.group_size)
    assert (shaped.max(1) > shaped.min(1)).any()  # the shaping differs within some group...
    assert collected.refill_rounds == 1 and not collected.rollouts.completion_mask.any()  # ...and counts for nothing
