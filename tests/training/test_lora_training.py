"""Training LoRA adapters over a frozen base: only the adapters move and hold optimizer state,
the base is the caller's arrays, bit for bit, the reference is the base, and a step's
gradient is the chain rule of the full model's through :math:`W' = W + s A B`. Over a
stacked base (``scan_layers``) the adapters are stacked too and train as the unrolled ones."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm import algorithms, models, training
from jaxrl_llm.models import decoder, lora
from jaxrl_llm.training import losses
from tests.models.test_lora import KERNELS, perturbed
from tests.training.test_step import CONFIG, RUN, TASK, _batch

LORA = models.LoraConfig(rank=4, alpha=8.0)


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_only_the_adapters_train_and_the_reference_is_the_base():
    model, params = models.init(CONFIG, jax.random.key(0))
    before = jax.tree.map(np.array, params)
    config = dataclasses.replace(
        RUN, reference_metrics=True, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-2)
    )
    state, history = training.train(
        model, params, algorithms.get("grpo"), config, steps=4, task=TASK, lora=LORA, compilation_cache=False
    )
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))  # the base is read, never donated
    assert _leaves_equal(params, before)  # bit for bit
    adapter_names = {path[-1] for path, _ in nnx.to_flat_state(state.params)}
    assert adapter_names == {f"{t}_lora_{ab}" for t in LORA.targets for ab in "ab"}
    # Optimizer state: Adam's two moments of every adapter leaf, and counters; nothing base-sized.
    adapter_sizes = sum(x.size for x in jax.tree.leaves(state.params))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * adapter_sizes
    fixed = training.fixed_params(state.params, algorithms.get("grpo"), config, base=params)
    assert all(x is y for x, y in zip(jax.tree.leaves(fixed.base), jax.tree.leaves(params), strict=True))
    assert all(not np.any(x) for x in jax.tree.leaves(fixed.reference))  # adapters of zeros: the base
    assert any(np.any(x) for path, x in nnx.to_flat_state(state.params) if path[-1].endswith("_lora_b"))
    assert history[-1]["kl_k3"] > 0  # the policy left the base, which the KL measures
    lora_model = lora.add_adapters(model, LORA, jax.random.key(0))[0]
    tokens = jnp.asarray(TASK.prompts(np.random.default_rng(0), 2).tokens)
    base_logits = models.forward(model, params, tokens)
    reference = lora.combine(params, fixed.reference)
    np.testing.assert_array_equal(models.forward(lora_model, reference, tokens), base_logits)
    policy = training.policy_params(state, base=params)
    assert not np.allclose(models.forward(lora_model, policy, tokens), base_logits)
    with pytest.raises(ValueError, match="LoRA adapters alone; pass `base=`"):
        training.policy_params(state)


def test_training_continues_an_adapter_saved_before_with_the_base_as_reference(tmp_path):
    model, params = models.init(CONFIG, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, LORA, jax.random.key(1))
    lora.save_adapter(tmp_path / "sft", lora_model, lora.combine(params, perturbed(adapters, scale=0.1)))
    loaded_model, loaded = lora.load_adapter(tmp_path / "sft", model)  # someone's SFT adapter
    config = dataclasses.replace(RUN, reference_metrics=True)

    def from_the_adapter(steps):
        return training.train(
            model, params, algorithms.get("grpo"), config, steps=steps, task=TASK, lora=loaded_model.config.lora,
            adapters=loaded,
        )  # fmt: skip

    start, _ = from_the_adapter(0)
    chex.assert_trees_all_equal(start.params, loaded)  # the run starts from the adapter
    reference = training.fixed_params(start.params, algorithms.get("grpo"), config, base=params).reference
    assert all(not np.any(x) for x in jax.tree.leaves(reference))  # the reference: the base alone
    _, history = from_the_adapter(1)
    assert history[0]["kl_k3"] > 0  # already away from the base at step 0
    with pytest.raises(ValueError, match="`adapters` need `lora=`"):
        training.train(model, params, algorithms.get("grpo"), config, steps=0, task=TASK, adapters=loaded)
    other = models.LoraConfig(rank=2, alpha=8.0)
    with pytest.raises(ValueError, match="adapters"):
        training.train(model, params, algorithms.get("grpo"), config, steps=0, task=TASK, lora=other, adapters=loaded)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "stacked"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_step_takes_the_chain_rule_of_the_full_models_gradient(quantization, scan_layers):
    # One Adam step from perturbed adapters: its first moment is (1 - b1) g. The reference g
    # is the full-parameter loss's gradient at the merged kernels, carried to A and B by
    # dA = s dW' B^T and dB = s A^T dW'. Over an int8 base, W is the dequantized s Q.
    # Stacked, g, the adapters and dW' are stacked and compared layer by layer.
    model, base = models.with_scan_layers(*models.init(CONFIG, jax.random.key(0)), scan_layers)
    if quantization:
        model, base = models.quantize.quantize(model, base, quantization=quantization)
    lora_model, adapters = lora.add_adapters(model, LORA, jax.random.key(1))
    adapters = perturbed(adapters, scale=0.1)
    config = dataclasses.replace(
        RUN, reference_metrics=True, optimizer=dataclasses.replace(RUN.optimizer, max_grad_norm=1e9)
    )
    algorithm = algorithms.get("grpo")
    state = training.init_state(lora_model, adapters, algorithm, config)
    fixed = training.fixed_params(adapters, algorithm, config, base=base)
    before = jax.tree.map(np.array, base)
    step = training.make_train_step(lora_model, algorithm, config)
    batch = _batch(lora_model, lora.combine(base, adapters), run=config)
    scored, _ = jax.jit(step.score)(state, fixed, batch)
    after, _ = jax.jit(step.update)(state, fixed, scored)
    assert _leaves_equal(base, before)
    mu = optax.tree_utils.tree_get(after.opt_state, "mu")
    assert jax.tree.structure(mu) == jax.tree.structure(adapters)
    gradient = nnx.to_pure_dict(decoder.unstack_layers(jax.tree.map(lambda m: m / (1 - config.optimizer.adam_b1), mu)))

    merged_model, merged = lora.merge(lora_model, lora.combine(base, adapters))
    full = losses.DecoderTeacherForcing(merged_model, config)
    merged_grads = jax.grad(
        lambda p: losses.policy_loss(p, scored, policy=full, algorithm=algorithm, on_policy=True)[0]
    )(merged)
    merged_grads, pure = (nnx.to_pure_dict(decoder.unstack_layers(t)) for t in (merged_grads, adapters))
    s, r = LORA.scale, LORA.rank
    for i in range(CONFIG.num_layers):
        for target, module in KERNELS.items():
            layer, got = pure["layers"][i][module], gradient["layers"][i][module]
            a = np.asarray(layer[f"{target}_lora_a"]).reshape(-1, r)
            b = np.asarray(layer[f"{target}_lora_b"]).reshape(r, -1)
            d_kernel = np.asarray(merged_grads["layers"][i][module][target]).reshape(a.shape[0], -1)
            scale = np.abs(s * a.T @ d_kernel).max()
            np.testing.assert_allclose(
                np.asarray(got[f"{target}_lora_a"]).reshape(-1, r), s * d_kernel @ b.T, rtol=1e-3, atol=1e-4 * scale
            )
            np.testing.assert_allclose(
                np.asarray(got[f"{target}_lora_b"]).reshape(r, -1), s * a.T @ d_kernel, rtol=1e-3, atol=1e-4 * scale
            )


def test_a_lora_run_over_a_stacked_base_trains_the_adapters_of_the_unrolled_run():
    model, params = models.init(CONFIG, jax.random.key(0))
    scanned, stacked = models.with_scan_layers(model, params, True)
    before = jax.tree.map(np.array, stacked)
    config = dataclasses.replace(
        RUN, reference_metrics=True, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-2)
    )
    run = dict(steps=3, task=TASK, lora=LORA, compilation_cache=False)
    expected, expected_history = training.train(model, params, algorithms.get("grpo"), config, **run)
    state, history = training.train(scanned, stacked, algorithms.get("grpo"), config, **run)
    # The base is the caller's stacked arrays, bit for bit; the adapters and their moments stacked.
    assert not any(x.is_deleted() for x in jax.tree.leaves(stacked))
    assert _leaves_equal(stacked, before)
    assert {path for path, _ in nnx.to_flat_state(state.params)} == {
        ("layers", KERNELS[t], f"{t}_lora_{ab}") for t in LORA.targets for ab in "ab"
    }
    assert all(x.shape[0] == CONFIG.num_layers for x in jax.tree.leaves(state.params))
    assert jax.tree.structure(optax.tree_utils.tree_get(state.opt_state, "mu")) == jax.tree.structure(state.params)
    # The same rollouts (sampled from the same adapters) and, up to rounding, the same adapters.
    assert [h["reward"] for h in history] == [h["reward"] for h in expected_history]
    for name in ("loss", "kl_k3", "grad_norm"):
        np.testing.assert_allclose(
            [h[name] for h in history], [h[name] for h in expected_history], rtol=1e-4, atol=1e-6, err_msg=name
        )
    adapters = decoder.unstack_layers(state.params)
    assert jax.tree.structure(adapters) == jax.tree.structure(expected.params)
    assert any(np.any(x[...]) for path, x in nnx.to_flat_state(adapters) if path[-1].endswith("_lora_b"))
    for got, want in zip(jax.tree.leaves(adapters), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_stopped_lora_run_continues_where_the_straight_one_goes():
    model, params = models.init(CONFIG, jax.random.key(0))
    config = dataclasses.replace(
        RUN, reference_metrics=True, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=1e-2)
    )
    run = dict(task=TASK, lora=LORA, compilation_cache=False)
    straight, straight_history = training.train(model, params, algorithms.get("grpo"), config, steps=4, **run)
    half, first = training.train(model, params, algorithms.get("grpo"), config, steps=2, **run)
    resumed, second = training.train(model, params, algorithms.get("grpo"), config, steps=2, state=half, **run)
    assert _leaves_equal(resumed.params, straight.params) and _leaves_equal(resumed.opt_state, straight.opt_state)
    assert [h["reward"] for h in first + second] == [h["reward"] for h in straight_history]


# One preset per way an update reaches the params: a plain policy gradient, group advantages
# with a clipped token ratio, a sequence ratio, a critic of its own, and TRPO's own update over
# the param tree. (The other presets differ from these in their loss only, which every preset's
# full-parameter tests cover; adapters change which leaves the gradient reaches, not the loss.)
UPDATE_PATHS = ("pg", "grpo", "gspo", "ppo", "trpo")


@pytest.mark.parametrize("name", UPDATE_PATHS)
def test_each_way_of_updating_trains_adapters(name):
    algorithm = algorithms.get(name)
    model, params = models.init(CONFIG, jax.random.key(0))
    before = jax.tree.map(np.array, params)
    run = dict(steps=1, task=TASK, lora=LORA, compilation_cache=False)
    state, history = training.train(model, params, algorithm, RUN, **run)
    assert np.isfinite(history[0]["grad_norm"]) and int(state.skipped_updates) == 0
    assert _leaves_equal(params, before)
    if algorithm.needs_critic:  # adapters of its own and a value head over the same base, no copy of it
        backbone = state.critic_params["backbone"]
        assert {path[-1] for path, _ in nnx.to_flat_state(backbone)} == {
            path[-1] for path, _ in nnx.to_flat_state(state.params)
        }
        sizes = sum(x.size for x in jax.tree.leaves(state.critic_params) if x.ndim)  # the head's bias aside
        assert sum(x.size for x in jax.tree.leaves(state.critic_opt_state) if x.ndim) == 2 * sizes  # Adam's moments
        assert np.isfinite(history[0]["value_loss"])


def test_a_lora_critic_values_its_adapters_over_the_base_as_the_merged_critic_does():
    model, base = models.init(CONFIG, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, LORA, jax.random.key(1))
    critic_adapters = perturbed(adapters, scale=0.1, seed=5)
    head = {"kernel": jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,)), "bias": jnp.float32(0.3)}
    config = dataclasses.replace(RUN, reference_metrics=True)
    batch = _batch(lora_model, lora.combine(base, adapters), run=config)
    policy = losses.over_base(losses.DecoderTeacherForcing(lora_model, config), base)
    values = policy.values({"backbone": critic_adapters, "head": head}, batch)
    merged_model, merged = lora.merge(lora_model, lora.combine(base, critic_adapters))
    merged_critic = losses.DecoderTeacherForcing(merged_model, config)
    expected = merged_critic.values({"backbone": merged, "head": head}, batch)
    np.testing.assert_allclose(values, expected, atol=1e-4 * float(jnp.abs(expected).max()), rtol=0)

    # The value's gradient reaches the critic's adapters as the chain rule through W + s A B says.
    got = nnx.to_pure_dict(
        jax.grad(lambda c: jnp.sum(policy.values({"backbone": c, "head": head}, batch)))(critic_adapters)
    )
    merged_grads = nnx.to_pure_dict(
        jax.grad(lambda m: jnp.sum(merged_critic.values({"backbone": m, "head": head}, batch)))(merged)
    )
    pure, s, r = nnx.to_pure_dict(critic_adapters), LORA.scale, LORA.rank
    for i in range(CONFIG.num_layers):
        for target, module in KERNELS.items():
            a = np.asarray(pure["layers"][i][module][f"{target}_lora_a"]).reshape(-1, r)
            b = np.asarray(pure["layers"][i][module][f"{target}_lora_b"]).reshape(r, -1)
            d_kernel = np.asarray(merged_grads["layers"][i][module][target]).reshape(a.shape[0], -1)
            layer = got["layers"][i][module]
            for name, want in ((f"{target}_lora_a", s * d_kernel @ b.T), (f"{target}_lora_b", s * a.T @ d_kernel)):
                np.testing.assert_allclose(
                    np.asarray(layer[name]).reshape(want.shape), want, rtol=1e-3, atol=1e-4 * np.abs(want).max()
                )


def test_what_lora_runs_cannot_take_is_refused():
    model, params = models.init(CONFIG, jax.random.key(0))
    run = dict(steps=1, task=TASK, lora=LORA, compilation_cache=False)
    with pytest.raises(ValueError, match="ref_params"):
        training.train(model, params, algorithms.get("grpo"), RUN, ref_params=params, **run)
    state = training.init_state(model, params, algorithms.get("grpo"), RUN)
    with pytest.raises(ValueError, match="LoRA run's state"):
        training.train(model, params, algorithms.get("grpo"), RUN, state=state, **run)
    lora_state, _ = training.train(model, params, algorithms.get("grpo"), RUN, **run)
    other = dataclasses.replace(LORA, rank=2)
    with pytest.raises(ValueError, match="state.params"):
        training.train(model, params, algorithms.get("grpo"), RUN, state=lora_state, **{**run, "lora": other})
    lora_model, adapters = lora.add_adapters(model, LORA, jax.random.key(0))
    with pytest.raises(ValueError, match="already has adapters"):
        training.train(lora_model, lora.combine(params, adapters), algorithms.get("grpo"), RUN, **run)


def test_adapters_train_over_an_int8_base_that_stays_as_it_was():
    model, params = models.quantize.quantize(*models.init(CONFIG, jax.random.key(0)))
    before = jax.tree.map(np.array, params)
    config = dataclasses.replace(
        RUN, reference_metrics=True, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-2)
    )
    state, history = training.train(
        model, params, algorithms.get("grpo"), config, steps=3, task=TASK, lora=LORA, compilation_cache=False
    )
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))  # read, never donated
    assert _leaves_equal(params, before)
    assert {x.dtype for path, x in nnx.to_flat_state(params) if path[-1] in KERNELS} == {jnp.dtype(jnp.int8)}
    assert any(np.any(x[...]) for path, x in nnx.to_flat_state(state.params) if path[-1].endswith("_lora_b"))
    assert all(np.isfinite(h["loss"]) for h in history) and int(state.skipped_updates) == 0
    tokens = jnp.asarray(TASK.prompts(np.random.default_rng(0), 2).tokens)
    lora_model = lora.adapted(model, LORA)
    reference = lora.combine(
        params, training.fixed_params(state.params, algorithms.GRPO, config, base=params).reference
    )
    base_logits = models.forward(model, params, tokens)
    np.testing.assert_array_equal(models.forward(lora_model, reference, tokens), base_logits)
    assert not np.allclose(models.forward(lora_model, training.policy_params(state, base=params), tokens), base_logits)
    with pytest.raises(ValueError, match="projections are int8"):
        training.train(model, params, algorithms.get("grpo"), config, steps=1, task=TASK, compilation_cache=False)


def test_dropout_masks_the_update_only_and_a_run_with_it_continues_bitwise():
    model, params = models.init(CONFIG, jax.random.key(0))
    config = dataclasses.replace(RUN, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=1e-2))
    with_dropout = dataclasses.replace(LORA, dropout=0.3)
    run = dict(task=TASK, compilation_cache=False)
    grpo = algorithms.get("grpo")
    straight, history = training.train(model, params, grpo, config, steps=3, lora=with_dropout, **run)
    half, _ = training.train(model, params, grpo, config, steps=2, lora=with_dropout, **run)
    resumed, _ = training.train(model, params, grpo, config, steps=1, state=half, lora=with_dropout, **run)
    assert _leaves_equal(resumed.params, straight.params)  # the masks come from the state's key
    plain, plain_history = training.train(model, params, grpo, config, steps=3, lora=LORA, **run)
    # The rollouts of step 0 are the same (no dropout in decoding), the updates are not.
    assert history[0]["reward"] == plain_history[0]["reward"]
    assert not _leaves_equal(straight.params, plain.params)

    # Scoring (the log-probs the update compares against) takes no dropout: the same with or without it.
    lora_model, adapters = lora.add_adapters(model, with_dropout, jax.random.key(1))
    adapters = perturbed(adapters, scale=0.1)
    fixed = training.fixed_params(adapters, grpo, config, base=params)
    state = training.init_state(lora_model, adapters, grpo, config)
    batch = _batch(lora_model, lora.combine(params, adapters), run=config)
    scored = jax.jit(training.make_train_step(lora_model, grpo, config).score)(state, fixed, batch)[0]
    no_dropout_model = lora.adapted(model, LORA)
    state_without = training.init_state(no_dropout_model, adapters, grpo, config)
    scored_without = jax.jit(training.make_train_step(no_dropout_model, grpo, config).score)(
        state_without, fixed, batch
    )[0]
    assert _leaves_equal(scored, scored_without)


def test_merged_decoding_samples_what_unmerged_decoding_does(monkeypatch):
    merges = []
    merge = lora.merge
    monkeypatch.setattr(lora, "merge", lambda *args, **kwargs: merges.append(1) or merge(*args, **kwargs))
    model, params = models.init(CONFIG, jax.random.key(0))
    config = dataclasses.replace(
        RUN, eval_every=2, eval_samples=2, optimizer=dataclasses.replace(RUN.optimizer, learning_rate=3e-2)
    )
    run = dict(task=TASK, lora=LORA, compilation_cache=False, steps=3)
    results = {}
    for decoding in ("unmerged", "merged"):
        tokens = []
        state, history = training.train(
            model,
            params,
            algorithms.get("grpo"),
            dataclasses.replace(config, lora_decoding=decoding),
            callback=lambda end, tokens=tokens: tokens.append(np.asarray(end.collected.rollouts.completion_tokens)),
            **run,
        )
        results[decoding] = state, history, tokens
        assert bool(merges) == (decoding == "merged")  # traced once by the merged run's decoding
    (unmerged, unmerged_history, unmerged_tokens), (merged, merged_history, merged_tokens) = results.values()
    # float32 kernels merged: the same tokens (the logits differ by rounding only), the same adapters trained.
    for a, b in zip(unmerged_tokens, merged_tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(x[...]) for path, x in nnx.to_flat_state(merged.params) if path[-1].endswith("_lora_b"))
    for a, b in zip(jax.tree.leaves(merged.params), jax.tree.leaves(unmerged.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert merged_history[1]["eval_greedy_accuracy"] == unmerged_history[1]["eval_greedy_accuracy"]
    with pytest.raises(ValueError, match=r"`lora_decoding` must be one of 'unmerged', 'merged'; got 'fused'"):
        dataclasses.replace(config, lora_decoding="fused")
