"""``models.in_compute_dtype``: float32 weights read in bfloat16 cast once, not per use.

The reference is the model as stored: every use casts those weights to ``config.dtype``
itself, so the cast params must give the same logits to the bit, in both layouts and on
every family. The decode loop is checked on the program JAX hands to XLA: the weights
enter the ``while`` loop in bfloat16 (XLA's CPU backend then upcasts them for its float32
matmuls, so the compiled CPU program cannot show it)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models, sampling
from jaxrl_llm.models import lora, quantize
from tests.models.test_layer_options import CONFIGS, perturbed_init

MIXED = dict(param_dtype=jnp.float32, dtype=jnp.bfloat16)
NORMS = ("input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm")


def mixed(name: str, **overrides) -> models.ModelConfig:
    return dataclasses.replace(CONFIGS[name], **MIXED, **overrides)


def leaves(params) -> dict[tuple, jax.Array]:
    return {path: leaf.get_value() for path, leaf in nnx.to_flat_state(params)}


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cast_params_give_the_stored_params_logits_to_the_bit(name, scan_layers):
    model, params = perturbed_init(mixed(name))
    model, params = models.with_scan_layers(model, params, scan_layers)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 7)), jnp.int32)

    cast = models.in_compute_dtype(model, params)

    np.testing.assert_array_equal(models.forward(model, cast, tokens), models.forward(model, params, tokens))
    before, after = leaves(params), leaves(cast)
    assert before.keys() == after.keys()
    for path, value in after.items():
        if path[-1] in models.COMPUTE_DTYPE_PARAMS:
            assert value.dtype == jnp.bfloat16, path
            np.testing.assert_array_equal(value, before[path].astype(jnp.bfloat16), err_msg=str(path))
        else:
            assert path[-1] in NORMS, path  # nothing else in these families
            assert value is before[path], path  # read in float32: not touched, not copied


def test_params_already_in_the_compute_dtype_come_back_as_they_are():
    model, params = models.init(CONFIGS["llama"], jax.random.key(0))  # float32 both
    assert models.in_compute_dtype(model, params) is params
    bf16_model, bf16_params = models.init(dataclasses.replace(CONFIGS["llama"], param_dtype=jnp.bfloat16,
                                                              dtype=jnp.bfloat16), jax.random.key(0))  # fmt: skip
    assert models.in_compute_dtype(bf16_model, bf16_params) is bf16_params


def test_int8_kernels_their_scales_and_adapters_are_left_as_they_are():
    """An int8 base keeps its kernels and float32 scales; the embedding and output layer are
    cast; LoRA adapters stay in their own dtype. Same logits to the bit."""
    model, params = perturbed_init(mixed("qwen2-biases"))
    model, params = quantize.quantize(model, params)
    model, adapters = lora.add_adapters(model, models.LoraConfig(rank=2, alpha=4.0), jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.1, adapters)  # B is zero at init
    params = lora.combine(params, adapters)
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)

    cast = models.in_compute_dtype(model, params)

    np.testing.assert_array_equal(models.forward(model, cast, tokens), models.forward(model, params, tokens))
    before, after = leaves(params), leaves(cast)
    dtypes = {path: value.dtype for path, value in after.items()}
    assert dtypes[("embed_tokens",)] == dtypes[("lm_head",)] == jnp.bfloat16
    assert dtypes[("layers", 0, "self_attn", "q_bias")] == jnp.bfloat16
    for path, value in after.items():
        if path[-1].endswith(("_proj", "_scale", "_lora_a", "_lora_b")):
            assert value is before[path], path


def test_the_decode_loop_reads_bfloat16_weights():
    """The rollout's ``while`` loop gets the projections in bfloat16: no float32 kernel is
    carried into it (it would be converted again at every decode step)."""
    model, params = models.init(mixed("llama"), jax.random.key(0))
    tokens, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), bool)
    lowered = sampling._generate.lower(
        model, params, tokens, mask, jax.random.key(1), 8, 1.0, 1.0, 0.0, mesh=None, split=None,
        num_samples=2, slots=8, top_k=None, use_top_p=False, use_min_p=False, greedy=False, eos_ids=(60,), pad_id=0,
    )  # fmt: skip
    loop_types = max(re.findall(r"stablehlo\.while\(.*\) : (.*)", lowered.as_text()), key=len)  # not the RNG's
    c = model.config
    kernel_shapes = {
        f"{c.hidden_size}x{c.intermediate_size}",  # gate_proj, up_proj
        f"{c.intermediate_size}x{c.hidden_size}",  # down_proj
        f"{c.hidden_size}x{c.num_heads}x{c.head_dim}",  # q_proj
        f"{c.num_heads}x{c.head_dim}x{c.hidden_size}",  # o_proj
        f"{c.hidden_size}x{c.vocab_size}",  # lm_head
    }
    carried = re.findall(r"tensor<([\dx]+)x(f32|bf16)>", loop_types)
    kernels = [dtype for shape, dtype in carried if shape in kernel_shapes]
    assert len(kernels) == 3 * c.num_layers + 2 * c.num_layers + 1  # gate, up, down, q, o per layer; lm_head
    assert set(kernels) == {"bf16"}
