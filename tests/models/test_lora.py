"""LoRA adapters over a frozen base: the adapted model is the base at initialisation, the
merged model computes what the unmerged one does, gradients reach the adapters as the
chain rule through :math:`W' = W + s A B` says they should, and dropout masks the
adapters' inputs only. In the stacked layout (``scan_layers``) the adapters are stacked
like their kernels: initialised, merged, saved and loaded as the unrolled ones."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxrl_llm import models, sharding
from jaxrl_llm.models import decoder, lora
from tests.models.hf_fixtures import hf_logits, left_padded_batch, tiny_hf_model
from tests.models.test_extend import FAMILIES  # llama, mistral, qwen2, qwen3 and llama with stacked layers

KERNELS = {  # each target's module
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def tokens(vocab, batch=3, length=9, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


def perturbed(adapters, scale=0.05, seed=3):
    """The adapters with every leaf moved off its initial value (B is zero at first)."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    )


def numpy_merged(config, base, adapters, lora_config):
    """The base's params with every targeted kernel replaced by W + s A B, in float64 NumPy,
    layer by layer (in the base's layout)."""
    stacked = config.scan_layers
    base, adapters = decoder.unstack_layers(base), decoder.unstack_layers(adapters)
    merged = jax.tree.map(np.asarray, nnx.to_pure_dict(base))
    pure = nnx.to_pure_dict(adapters)
    for i in range(config.num_layers):
        for target in lora_config.targets:
            module = KERNELS[target]
            a = np.asarray(pure["layers"][i][module][f"{target}_lora_a"], np.float64)
            b = np.asarray(pure["layers"][i][module][f"{target}_lora_b"], np.float64)
            kernel = merged["layers"][i][module][target]
            delta = a.reshape(-1, lora_config.rank) @ b.reshape(lora_config.rank, -1)
            merged["layers"][i][module][target] = (
                kernel.astype(np.float64) + lora_config.scale * delta.reshape(kernel.shape)
            ).astype(np.float32)
    state = jax.tree.map(jnp.asarray, base)
    nnx.replace_by_pure_dict(state, merged)
    return decoder.stack_layers(state) if stacked else state


def adapter_pairs(adapters) -> int:
    """The number of (layer, target) adapters: a per-layer leaf counts once, a stacked
    ``[L, ...]`` one ``L`` times."""
    count = 0
    for path, leaf in nnx.to_flat_state(adapters):
        if path[-1].endswith("_lora_a"):
            assert path[0] == decoder.LAYERS
            count += leaf.shape[0] if decoder.is_stacked(path) else 1
    return count


@pytest.mark.parametrize("family", list(FAMILIES))
def test_at_initialisation_the_adapted_model_is_the_base_exactly(family):
    config = FAMILIES[family]
    model, base = models.init(config, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=4), jax.random.key(1))
    params = lora.combine(base, adapters)
    ids = tokens(config.vocab_size)
    np.testing.assert_array_equal(models.forward(lora_model, params, ids), models.forward(model, base, ids))
    # Decoding too: the prefill's and a decode step's logits.
    mask = jnp.ones(ids.shape, bool)
    expected, cache = models.prefill(model, base, ids, mask, cache_size=12)
    got, lora_cache = models.prefill(lora_model, params, ids, mask, cache_size=12)
    np.testing.assert_array_equal(got, expected)
    step = ids[:, 0]
    np.testing.assert_array_equal(
        models.decode_step(lora_model, params, step, lora_cache)[0], models.decode_step(model, base, step, cache)[0]
    )
    # B starts at zero, A does not; only the adapters are LoraParams. One pair per target and
    # layer: 7 L leaves, or (stacked) 7 leaves of leading dimension L.
    a_leaves = [v for p, v in nnx.to_flat_state(adapters) if p[-1].endswith("_lora_a")]
    b_leaves = [v for p, v in nnx.to_flat_state(adapters) if p[-1].endswith("_lora_b")]
    assert all(isinstance(v, decoder.LoraParam) for v in a_leaves + b_leaves)
    # flax's LoRA type selects them, as Tunix's and qwix's filters do, and nothing of the base.
    flax_lora, rest = nnx.split_state(params, nnx.LoRAParam, ...)
    assert {path for path, _ in nnx.to_flat_state(flax_lora)} == {path for path, _ in nnx.to_flat_state(adapters)}
    assert {path for path, _ in nnx.to_flat_state(rest)} == {path for path, _ in nnx.to_flat_state(base)}
    assert adapter_pairs(adapters) == 7 * config.num_layers
    assert len(a_leaves) == len(b_leaves) == (7 if config.scan_layers else 7 * config.num_layers)
    assert all(not np.any(b[...]) for b in b_leaves) and all(np.all(np.abs(a[...]) > 0) for a in a_leaves[:3])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_and_unmerged_adapters_compute_the_same_logits(family):
    config = FAMILIES[family]
    model, base = models.init(config, jax.random.key(0))
    lora_config = models.LoraConfig(rank=4, alpha=12.0)
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    adapters = perturbed(adapters)
    params = lora.combine(base, adapters)
    ids = tokens(config.vocab_size)
    unmerged = models.forward(lora_model, params, ids)
    assert float(jnp.max(jnp.abs(unmerged - models.forward(model, base, ids)))) > 1e-2  # the adapters matter
    merged_model, merged = lora.merge(lora_model, params)
    assert merged_model.config == config
    np.testing.assert_allclose(models.forward(merged_model, merged, ids), unmerged, atol=2e-5, rtol=1e-5)
    reference = numpy_merged(config, base, adapters, lora_config)  # an independent merge, in float64
    np.testing.assert_allclose(models.forward(model, reference, ids), unmerged, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lora_config",
    [
        models.LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj")),
        models.LoraConfig(rank=3, alpha=5.0, targets="down_proj", rslora=True),
        models.LoraConfig(rank=4, targets=("o_proj", "gate_proj", "up_proj", "k_proj")),
    ],
    ids=["q-v", "down-rslora", "o-gate-up-k"],
)
def test_some_targets_and_rslora(lora_config):
    model, base = models.init(FAMILIES["qwen2"], jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    names = {path[-1] for path, _ in nnx.to_flat_state(adapters)}
    assert names == {f"{t}_lora_{ab}" for t in lora_config.targets for ab in "ab"}
    adapters = perturbed(adapters)
    ids = tokens(model.config.vocab_size)
    got = models.forward(lora_model, lora.combine(base, adapters), ids)
    reference = numpy_merged(model.config, base, adapters, lora_config)
    np.testing.assert_allclose(models.forward(model, reference, ids), got, atol=2e-5, rtol=1e-5)


def test_the_scale_is_alpha_over_rank_or_its_square_root():
    assert models.LoraConfig(rank=16, alpha=32).scale == 2.0
    assert models.LoraConfig(rank=16, alpha=32, rslora=True).scale == 8.0
    assert models.LoraConfig().targets == models.config.LORA_TARGETS  # all-linear


@pytest.mark.parametrize("family", ["qwen3", "llama-scanned"])
def test_gradients_reach_the_adapters_through_the_chain_rule(family):
    # dL/dA = s dL/dW' B^T and dL/dB = s A^T dL/dW', with dL/dW' the merged model's gradient
    # (both stacked in the stacked layout: compared layer by layer).
    config = FAMILIES[family]
    model, base = models.init(config, jax.random.key(0))
    lora_config = models.LoraConfig(rank=3, alpha=6.0)
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    adapters = perturbed(adapters)
    ids = tokens(config.vocab_size)
    weights = jax.random.normal(jax.random.key(5), (*ids.shape, config.vocab_size))

    def loss(model, params):
        return jnp.sum(weights * jax.nn.log_softmax(models.forward(model, params, ids)))

    grads = jax.grad(lambda a: loss(lora_model, lora.combine(base, a)))(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # stacked like the adapters
    merged_model, merged = lora.merge(lora_model, lora.combine(base, adapters))
    merged_grads = jax.grad(lambda p: loss(merged_model, p))(merged)
    grads, merged_grads, pure = (nnx.to_pure_dict(decoder.unstack_layers(t)) for t in (grads, merged_grads, adapters))
    s, r = lora_config.scale, lora_config.rank
    for i in range(config.num_layers):
        for target, module in KERNELS.items():
            layer, grad = pure["layers"][i][module], grads["layers"][i][module]
            d_kernel = np.asarray(merged_grads["layers"][i][module][target]).reshape(
                np.prod(layer[f"{target}_lora_a"].shape[:-1]), -1
            )
            a = np.asarray(layer[f"{target}_lora_a"]).reshape(-1, r)
            b = np.asarray(layer[f"{target}_lora_b"]).reshape(r, -1)
            np.testing.assert_allclose(
                np.asarray(grad[f"{target}_lora_a"]).reshape(-1, r), s * d_kernel @ b.T, rtol=2e-4, atol=2e-5
            )
            np.testing.assert_allclose(
                np.asarray(grad[f"{target}_lora_b"]).reshape(r, -1), s * a.T @ d_kernel, rtol=2e-4, atol=2e-5
            )


def test_split_and_combine_take_the_params_apart_without_copies():
    model, base = models.init(FAMILIES["llama"], jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2), jax.random.key(1))
    params = lora.combine(base, adapters)
    again_base, again_adapters = lora.split(params)
    assert jax.tree.structure(again_base) == jax.tree.structure(base)
    assert all(x is y for x, y in zip(jax.tree.leaves(again_base), jax.tree.leaves(base), strict=True))
    assert all(x is y for x, y in zip(jax.tree.leaves(again_adapters), jax.tree.leaves(adapters), strict=True))
    assert lora.base_model(lora_model).config == model.config and lora.base_model(model) is model
    # The adapters' rank axis stays whole on any mesh; their other axes follow the rules.
    logical = nnx.to_pure_dict(sharding.logical_axes(adapters))["layers"][0]["self_attn"]
    assert tuple(logical["q_proj_lora_a"]) == ("embed", "lora") and tuple(logical["o_proj_lora_b"]) == ("lora", "embed")
    # Stacked, the layers' axis comes first (never split).
    stacked = models.with_scan_layers(lora_model, params, True)[1]
    logical = nnx.to_pure_dict(sharding.logical_axes(lora.split(stacked)[1]))["layers"]["self_attn"]
    assert tuple(logical["q_proj_lora_a"]) == ("layers", "embed", "lora")
    assert tuple(logical["o_proj_lora_b"]) == ("layers", "lora", "embed")


def test_bad_settings_are_refused():
    for bad, message in [
        (dict(rank=0), "rank"),
        (dict(alpha=0), "alpha"),
        (dict(targets=("q_proj", "lm_head")), "targets"),
        (dict(targets=()), "targets"),
        (dict(rslora="yes"), "rslora"),
        (dict(dtype="int8"), "dtype"),
    ]:
        with pytest.raises(ValueError, match=message):
            models.LoraConfig(**bad)
    model, base = models.init(FAMILIES["llama"], jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2), jax.random.key(1))
    with pytest.raises(ValueError, match="already has adapters"):
        lora.add_adapters(lora_model, models.LoraConfig(rank=2), jax.random.key(1))
    with pytest.raises(ValueError, match="no adapters"):
        lora.merge(model, base)
    with pytest.raises(TypeError, match="LoraConfig"):
        lora.add_adapters(model, {"rank": 2}, jax.random.key(1))


# ----------------------------------------------------------------------------------------
# Dropout


class _Projection:
    """A stand-in module holding one adapter, as ``decoder._with_lora`` reads it."""

    def __init__(self, a, b):
        self.q_proj_lora_a, self.q_proj_lora_b = nnx.Param(a), nnx.Param(b)


def test_dropout_scales_the_kept_adapter_inputs_and_leaves_the_adapter_unbiased():
    from jaxrl_llm.models.decoder import _with_lora

    rate, rank = 0.3, 4
    config = dataclasses.replace(FAMILIES["llama"], lora=models.LoraConfig(rank=rank, alpha=8.0, dropout=rate))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    a, b = rng.normal(size=(16, rank)).astype(np.float32), rng.normal(size=(rank, 12)).astype(np.float32)
    module, base = _Projection(jnp.asarray(a), jnp.asarray(b)), jnp.zeros((2, 5, 12), jnp.float32)
    s = config.lora.scale

    key = jax.random.key(7)
    got = np.asarray(_with_lora(module, "q_proj", jnp.asarray(x), base, config, dropout_key=key))
    kept = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, 0), 1 - rate, x.shape))  # q_proj's stream
    expected = s * (np.where(kept, x / (1 - rate), 0).astype(np.float64) @ a) @ b
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert 0.2 < 1 - kept.mean() < 0.4

    no_dropout = s * (x.astype(np.float64) @ a) @ b
    np.testing.assert_allclose(
        _with_lora(module, "q_proj", jnp.asarray(x), base, config),
        no_dropout,
        rtol=0,
        atol=1e-5 * np.abs(no_dropout).max(),
    )
    draws = jax.vmap(lambda k: _with_lora(module, "q_proj", jnp.asarray(x), base, config, dropout_key=k))(
        jax.random.split(jax.random.key(1), 2000)
    )
    spread = np.asarray(draws).std(axis=0) / np.sqrt(2000)
    assert np.all(np.abs(np.asarray(draws).mean(axis=0) - no_dropout) < 5 * spread + 1e-4)  # E[mask / (1 - p)] = 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dropout_touches_only_the_adapters_and_scanned_layers_draw_the_unrolled_masks(family):
    config = FAMILIES[family]
    lora_config = models.LoraConfig(rank=4, alpha=8.0, dropout=0.2)
    model, base = models.init(config, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    ids = tokens(config.vocab_size)
    prompts, completions = ids[:1, :5], ids[:, 5:]
    mask = jnp.ones(prompts.shape, bool)

    def states(model_, adapters_, key):
        return models.functional.group_completion_hidden_states(
            model_, lora.combine(base, adapters_), prompts, mask, completions, dropout_key=key
        )

    plain = models.functional.group_completion_hidden_states(model, base, prompts, mask, completions)
    key = jax.random.key(3)
    np.testing.assert_array_equal(states(lora_model, adapters, key), plain)  # B = 0: the base, whatever the masks
    moved = perturbed(adapters)
    with_key, again, other = (states(lora_model, moved, k) for k in (key, key, jax.random.key(4)))
    np.testing.assert_array_equal(with_key, again)
    assert not np.allclose(with_key, other) and not np.allclose(with_key, states(lora_model, moved, None))
    no_rate = lora.adapted(model, dataclasses.replace(lora_config, dropout=0.0))
    np.testing.assert_array_equal(states(no_rate, moved, key), states(lora_model, moved, None))
    # The stacked layout draws each layer's masks as the unrolled layers do.
    scanned, stacked = models.with_scan_layers(lora_model, lora.combine(base, moved), True)
    scanned_states = models.functional.group_completion_hidden_states(
        scanned, stacked, prompts, mask, completions, dropout_key=key
    )
    np.testing.assert_allclose(scanned_states, with_key, atol=1e-5, rtol=1e-5)


def test_dropout_is_a_number_in_zero_one_and_travels_in_pefts_config(tmp_path):
    with pytest.raises(ValueError, match=r"`dropout` must be a number in \[0, 1\); got 1.0"):
        models.LoraConfig(dropout=1.0)
    model, base = models.init(FAMILIES["llama"], jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2, dropout=0.05), jax.random.key(1))
    lora.save_adapter(tmp_path, lora_model, adapters)
    assert lora.load_adapter(tmp_path, model)[0].config.lora.dropout == 0.05


# ----------------------------------------------------------------------------------------
# The stacked layout


def test_adapters_of_a_stacked_model_are_the_stacked_adapters_of_the_unrolled_model():
    model, _ = models.init(FAMILIES["qwen2"], jax.random.key(0))
    scanned, _ = models.init(dataclasses.replace(FAMILIES["qwen2"], scan_layers=True), jax.random.key(0))
    lora_config = models.LoraConfig(rank=3, targets=("q_proj", "down_proj"))
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    scanned_lora, stacked = lora.add_adapters(scanned, lora_config, jax.random.key(1))
    assert scanned_lora.config == dataclasses.replace(lora_model.config, scan_layers=True)
    assert adapter_pairs(stacked) == adapter_pairs(adapters) == 2 * FAMILIES["qwen2"].num_layers
    expected = decoder.stack_layers(adapters)
    assert jax.tree.structure(stacked) == jax.tree.structure(expected)
    chex.assert_trees_all_equal(stacked, expected)  # the same draws, bit for bit
    assert jax.tree.structure(lora.abstract_adapters(scanned_lora)) == jax.tree.structure(stacked)


def test_merging_a_stacked_lora_model_gives_the_stacked_merge_of_the_unrolled_one(tmp_path):
    config = FAMILIES["qwen3"]
    model, base = models.init(config, jax.random.key(0))
    lora_config = models.LoraConfig(rank=4, alpha=6.0, targets=("q_proj", "o_proj", "up_proj"))
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(1))
    params = lora.combine(base, perturbed(adapters))
    merged_model, merged = lora.merge(lora_model, params)
    scanned, stacked = models.with_scan_layers(lora_model, params, True)
    stacked_model, stacked_merged = lora.merge(scanned, stacked)
    assert stacked_model.config == dataclasses.replace(merged_model.config, scan_layers=True)
    expected = decoder.stack_layers(merged)
    assert jax.tree.structure(stacked_merged) == jax.tree.structure(expected)
    chex.assert_trees_all_equal(stacked_merged, expected)
    # The adapters moved the targeted kernels only.
    stacked_base = dict(nnx.to_flat_state(decoder.stack_layers(base)))
    moved = {p for p, leaf in nnx.to_flat_state(stacked_merged) if not np.array_equal(leaf[...], stacked_base[p][...])}
    assert {path[-1] for path in moved} == set(lora_config.targets)
    # Saved as full weights (merged on the way), both layouts write the same tensors.
    models.save_pretrained(tmp_path / "unrolled", lora_model, params)
    models.save_pretrained(tmp_path / "stacked", scanned, stacked)
    expected_tensors = safetensors.numpy.load_file(tmp_path / "unrolled" / "model.safetensors")
    written = safetensors.numpy.load_file(tmp_path / "stacked" / "model.safetensors")
    assert sorted(written) == sorted(expected_tensors)
    for name, tensor in expected_tensors.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)


@pytest.mark.parametrize(
    "family, lora_config",
    [
        ("llama", models.LoraConfig(rank=4, alpha=8.0)),
        ("qwen2", models.LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj"), rslora=True)),
    ],
    ids=["llama-all-linear", "qwen2-q-v-rslora"],
)
def test_a_stacked_lora_model_saves_and_loads_the_peft_adapter_of_the_unrolled_one(family, lora_config, tmp_path):
    import peft
    import torch
    import transformers

    tiny_hf_model(family).save_pretrained(tmp_path / "base")
    model, base = models.from_pretrained(tmp_path / "base")
    lora_model, adapters = lora.add_adapters(model, lora_config, jax.random.key(0))
    adapters = perturbed(adapters)
    scanned, stacked = models.with_scan_layers(lora_model, lora.combine(base, adapters), True)
    lora.save_adapter(tmp_path / "unrolled", lora_model, adapters)
    lora.save_adapter(tmp_path / "stacked", scanned, stacked)
    # The same files: PEFT's config and one tensor per layer, target and factor, bit for bit.
    config_file = lora.ADAPTER_CONFIG
    assert (tmp_path / "stacked" / config_file).read_text() == (tmp_path / "unrolled" / config_file).read_text()
    written = safetensors.numpy.load_file(tmp_path / "stacked" / lora.ADAPTER_WEIGHTS)
    expected = safetensors.numpy.load_file(tmp_path / "unrolled" / lora.ADAPTER_WEIGHTS)
    assert sorted(written) == sorted(expected)
    assert len(written) == model.config.num_layers * len(lora_config.targets) * 2
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)

    # Loaded into a stacked base: the adapters saved, stacked, and PEFT's logits.
    stacked_base_model, stacked_base = models.from_pretrained(tmp_path / "base", scan_layers=True)
    loaded_model, loaded = lora.load_adapter(tmp_path / "unrolled", stacked_base_model)
    assert loaded_model.config == scanned.config
    assert jax.tree.structure(loaded) == jax.tree.structure(lora.split(stacked)[1])
    chex.assert_trees_all_equal(loaded, lora.split(stacked)[1])
    chex.assert_trees_all_equal(loaded, decoder.stack_layers(lora.load_adapter(tmp_path / "stacked", model)[1]))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "stacked").eval()
    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    valid = mask.astype(bool)
    got = models.forward(
        loaded_model, lora.combine(stacked_base, loaded), jnp.asarray(tokens), attention_mask=jnp.asarray(mask)
    )
    np.testing.assert_allclose(
        np.asarray(got)[valid], hf_logits(peft_model, tokens, mask, positions)[valid], atol=1e-5, rtol=1e-5
    )
