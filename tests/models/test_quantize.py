"""The int8 base: per-output-channel quantization against a NumPy reference, the int8
model's logits against the float model of its dequantized weights (the scale applied in
the matmul), loading quantized as read, saving dequantized, decoding, and refusals. In
the stacked layout (``scan_layers``) each layer's kernel is quantized on its own: the
stacked int8 params are the per-layer ones, stacked."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxrl_llm import algorithms, models, sampling, sharding, training
from jaxrl_llm.models import decoder, quantize
from tests.models.test_extend import FAMILIES
from tests.models.test_lora import KERNELS, tokens


def numpy_quantized(w: np.ndarray, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8, written out in NumPy."""
    w = w.astype(np.float32)
    peak = np.abs(w).max(axis=tuple(range(inputs)))
    scale = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize(("shape", "inputs"), [((24, 40), 1), ((12, 4, 8), 1), ((4, 8, 12), 2)])
def test_kernels_quantize_per_output_channel_as_the_numpy_reference(shape, inputs):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    w[(slice(None),) * inputs + (0,) * (len(shape) - inputs)] = 0  # an output channel of zeros
    q, scale = quantize.quantize_kernel(jnp.asarray(w), inputs=inputs)
    expected_q, expected_scale = numpy_quantized(w, inputs)
    assert q.dtype == jnp.int8 and q.shape == shape and scale.shape == shape[inputs:]
    np.testing.assert_allclose(scale, expected_scale, rtol=2e-7)  # XLA may divide by 127 as a product
    reference_q = np.clip(np.round(w / np.asarray(scale)), -127, 127).astype(np.int8)  # at the scales used
    np.testing.assert_array_equal(q, reference_q)
    assert np.mean(np.asarray(q) == expected_q) > 0.99
    assert np.abs(np.asarray(q)).max() == 127 and scale.reshape(-1)[0] == 1.0
    error = np.abs(w - np.asarray(q, np.float32) * np.asarray(scale))
    assert (error <= np.asarray(scale) / 2 * (1 + 1e-6)).all()  # rounding: at most half a step


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_int8_model_computes_its_dequantized_float_model(family):
    config = FAMILIES[family]
    model, params = models.init(config, jax.random.key(0))
    int8_model, int8 = quantize.quantize(model, params)
    assert int8_model.config.quantization == "int8"
    # The float model of s * Q, dequantized here in NumPy layer by layer, run by the unrolled
    # layers: (x Q) s must equal x (s Q).
    flat = dict(nnx.to_flat_state(decoder.unstack_layers(int8)))
    unrolled, unrolled_params = models.with_scan_layers(model, params, False)
    plain = {}
    for path, leaf in nnx.to_flat_state(unrolled_params):
        if path[-1] in KERNELS:
            q, scale = np.asarray(flat[path][...], np.float32), np.asarray(flat[(*path[:-1], f"{path[-1]}_scale")][...])
            leaf = leaf.replace(jnp.asarray(q * scale))
        plain[path] = leaf
    ids = tokens(config.vocab_size)
    expected = models.forward(unrolled, nnx.from_flat_state(plain), ids)
    np.testing.assert_allclose(models.forward(int8_model, int8, ids), expected, atol=2e-5, rtol=1e-5)
    # The error against the unquantized model is quantization's, far below the logits' spread.
    full = models.forward(model, params, ids)
    assert 0 < float(jnp.abs(expected - full).max()) < 0.05 * float(jnp.std(full))


def test_int8_params_take_a_byte_per_projection_weight_and_init_quantizes_the_float_init():
    config = FAMILIES["qwen2"]
    model, params = models.init(config, jax.random.key(0))
    _, int8 = quantize.quantize(model, params)
    chex.assert_trees_all_equal(
        models.init(dataclasses.replace(config, quantization="int8"), jax.random.key(0))[1], int8
    )
    flat = dict(nnx.to_flat_state(int8))
    kernels = [leaf[...] for path, leaf in flat.items() if path[-1] in KERNELS]
    assert len(kernels) == 7 * config.num_layers and all(k.dtype == jnp.int8 for k in kernels)
    kernel_bytes = sum(k.size for k in kernels)
    others = sum(leaf[...].nbytes for path, leaf in flat.items() if path[-1] not in KERNELS)
    float_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert sum(x.nbytes for x in jax.tree.leaves(int8)) == kernel_bytes + others
    assert kernel_bytes * 4 == sum(leaf[...].nbytes for path, leaf in nnx.to_flat_state(params) if path[-1] in KERNELS)
    assert sum(x.nbytes for x in jax.tree.leaves(int8)) < float_bytes
    chex.assert_trees_all_equal(quantize.dequantize(model, params)[1], params)  # a float model as it is


def test_loading_quantized_equals_quantizing_the_float_load_and_saving_writes_the_dequantized_weights(tmp_path):
    config = FAMILIES["qwen3"]
    model, params = models.init(config, jax.random.key(0))
    models.save_pretrained(tmp_path / "float", model, params)
    float_model, loaded = models.from_pretrained(tmp_path / "float", jnp.float32)
    int8_model, int8 = models.from_pretrained(tmp_path / "float", jnp.float32, quantization="int8")
    chex.assert_trees_all_equal(int8, quantize.quantize(float_model, loaded)[1])
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    _, placed = models.from_pretrained(tmp_path / "float", jnp.float32, mesh=mesh, quantization="int8")
    chex.assert_trees_all_equal(jax.device_get(placed), jax.device_get(int8))
    for leaf, where in zip(
        jax.tree.leaves(placed), jax.tree.leaves(sharding.param_shardings(placed, mesh, sharding.RULES["fsdp_tensor"]))
    ):
        assert leaf.sharding == where

    # In bfloat16 the kernels are quantized from their bfloat16 values, as quantize() of that load.
    bf16_model, bf16 = models.from_pretrained(tmp_path / "float", jnp.bfloat16)
    _, bf16_int8 = models.from_pretrained(tmp_path / "float", jnp.bfloat16, quantization="int8")
    chex.assert_trees_all_equal(bf16_int8, quantize.quantize(bf16_model, bf16)[1])

    models.save_pretrained(tmp_path / "int8", int8_model, int8)
    _, saved = models.from_pretrained(tmp_path / "int8", jnp.float32)
    chex.assert_trees_all_equal(saved, quantize.dequantize(int8_model, int8)[1])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_quantizing_a_stacked_model_gives_the_stacked_per_layer_quantization(family):
    config = FAMILIES[family]
    model, params = models.init(config, jax.random.key(0))
    int8_model, int8 = quantize.quantize(model, params)
    scanned, stacked = models.with_scan_layers(model, params, True)
    stacked_int8_model, stacked_int8 = quantize.quantize(scanned, stacked)
    assert stacked_int8_model.config == dataclasses.replace(int8_model.config, scan_layers=True)
    expected = decoder.stack_layers(int8)
    assert jax.tree.structure(stacked_int8) == jax.tree.structure(expected)  # scales stacked [L, *out] too
    chex.assert_trees_all_equal(stacked_int8, expected)
    flat = dict(nnx.to_flat_state(stacked_int8))
    kernels = [path for path in flat if path[-1] in KERNELS]
    assert len(kernels) == 7 and all(flat[path][...].dtype == jnp.int8 for path in kernels)
    assert flat[("layers", "mlp", "down_proj_scale")][...].shape == (config.num_layers, config.hidden_size)
    # The stacked init of an int8 config, quantize_kernel(stacked=True) and dequantize agree.
    chex.assert_trees_all_equal(
        models.init(dataclasses.replace(config, quantization="int8", scan_layers=True), jax.random.key(0))[1], expected
    )
    stored = np.asarray(flat[("layers", "self_attn", "o_proj")][...])  # [L, H, D, E]: two input axes
    q, scale = quantize.quantize_kernel(
        jnp.asarray(stacked["layers"]["self_attn"]["o_proj"][...]), inputs=2, stacked=True
    )
    np.testing.assert_array_equal(q, stored)
    for layer in range(config.num_layers):
        layer_q, layer_scale = quantize.quantize_kernel(params["layers"][layer]["self_attn"]["o_proj"][...], inputs=2)
        np.testing.assert_array_equal(q[layer], layer_q)
        np.testing.assert_array_equal(scale[layer], layer_scale)
    plain_model, plain = quantize.dequantize(stacked_int8_model, stacked_int8)
    assert plain_model.config == scanned.config
    chex.assert_trees_all_equal(plain, decoder.stack_layers(quantize.dequantize(int8_model, int8)[1]))
    # And the stacked int8 model computes the unrolled one's logits.
    ids = tokens(config.vocab_size)
    np.testing.assert_allclose(
        models.forward(stacked_int8_model, stacked_int8, ids),
        models.forward(int8_model, int8, ids),
        atol=2e-5,
        rtol=1e-5,
    )


def test_loading_stacked_and_quantized_equals_the_stacked_int8_load_on_one_device_and_a_mesh(tmp_path):
    config = FAMILIES["qwen2"]
    model, params = models.init(config, jax.random.key(0))
    models.save_pretrained(tmp_path, model, params)
    _, int8 = models.from_pretrained(tmp_path, jnp.float32, quantization="int8")
    expected = decoder.stack_layers(int8)
    stacked_model, stacked = models.from_pretrained(tmp_path, jnp.float32, quantization="int8", scan_layers=True)
    assert stacked_model.config.scan_layers and stacked_model.config.quantization == "int8"
    chex.assert_trees_all_equal(stacked, expected)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    _, placed = models.from_pretrained(tmp_path, jnp.float32, mesh=mesh, quantization="int8", scan_layers=True)
    chex.assert_trees_all_equal(jax.device_get(placed), jax.device_get(expected))
    for leaf, where in zip(
        jax.tree.leaves(placed), jax.tree.leaves(sharding.param_shardings(placed, mesh, sharding.RULES["fsdp_tensor"]))
    ):
        assert leaf.sharding == where
    q_proj = placed["layers"]["self_attn"]["q_proj"][...]
    assert q_proj.dtype == jnp.int8 and tuple(q_proj.sharding.spec) == (None, "fsdp", "tensor")
    # Saved, the stacked int8 model writes the unrolled int8 model's (dequantized) tensors.
    int8_model = models.abstract(dataclasses.replace(config, quantization="int8"))[0]
    models.save_pretrained(tmp_path / "unrolled", int8_model, int8)
    models.save_pretrained(tmp_path / "stacked", stacked_model, placed)
    expected_tensors = safetensors.numpy.load_file(tmp_path / "unrolled" / "model.safetensors")
    written = safetensors.numpy.load_file(tmp_path / "stacked" / "model.safetensors")
    assert sorted(written) == sorted(expected_tensors)
    for name, tensor in expected_tensors.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)


def test_an_int8_model_decodes_the_tokens_of_its_dequantized_model():
    config = FAMILIES["llama"]
    int8_model, int8 = quantize.quantize(*models.init(config, jax.random.key(0)))
    plain_model, plain = quantize.dequantize(int8_model, int8)
    settings = dict(num_samples=2, max_new_tokens=8, temperature=0.0, eos_ids=(config.vocab_size - 1,), pad_id=0)
    prompts = jnp.asarray(tokens(config.vocab_size, batch=2, length=5))
    mask = jnp.ones(prompts.shape, bool)
    got = sampling.sample(int8_model, int8, prompts, mask, jax.random.key(0), **settings)
    want = sampling.sample(plain_model, plain, prompts, mask, jax.random.key(0), **settings)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_what_an_int8_model_cannot_do_is_refused():
    model, params = models.init(FAMILIES["llama"], jax.random.key(0))
    int8_model, int8 = quantize.quantize(model, params)
    with pytest.raises(ValueError, match="quantized already"):
        quantize.quantize(int8_model, int8)
    with pytest.raises(ValueError, match=r"`quantization` must be one of 'int8'; got 'int4'"):
        quantize.quantize(model, params, quantization="int4")
    with pytest.raises(ValueError, match=r"ModelConfig: `quantization` must be one of None, 'int8'; got 'int4'"):
        dataclasses.replace(FAMILIES["llama"], quantization="int4")
    with pytest.raises(ValueError, match=r"projections are int8 .* train LoRA adapters over it"):
        training.init_state(int8_model, int8, algorithms.get("grpo"), training.TrainConfig())
