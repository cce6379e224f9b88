"""The layer scan over a LoRA model's frozen base holds one layer of it at a time.

XLA's CPU backend computes a bfloat16 matmul through a float32 copy of its weight; left to
itself it converts the whole stacked base before the scan's loop, a float32 copy twice the
base's size. The scan reads the frozen base one layer at a time inside the rematerialised
body instead (``decoder._frozen_layer``). Measured with XLA's compiled memory analysis of
the adapters' gradient, against the size of that copy.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import decoder, lora

CONFIG = models.ModelConfig(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=64,
    param_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
    scan_layers=True,
)


def objective(logits: jax.Array) -> jax.Array:
    """``sum(w * log_softmax(logits))`` with fixed random weights ``w`` ``[B, S, V]``: every logit counts."""
    weights = jax.random.normal(jax.random.key(2), logits.shape, jnp.float32)
    return jnp.sum(weights * jax.nn.log_softmax(logits.astype(jnp.float32)))


def adapter_gradient(remat: str, config: models.ModelConfig = CONFIG):
    """The adapters' gradient program of a stacked LoRA model (``remat``), its base and adapters."""
    model, base = models.init(config, jax.random.key(0))
    lora_model, adapters = lora.add_adapters(model, models.LoraConfig(rank=4), jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B off zero, so every adapter has a gradient
    lora_model = models.with_options(lora_model, remat=remat)
    tokens = jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32) % config.vocab_size

    @jax.jit
    def gradient(adapters, base):
        def loss(adapters):
            return objective(models.forward(lora_model, lora.combine(base, adapters), tokens))

        return jax.grad(loss)(adapters)

    return gradient, adapters, base


def layer_bytes(params) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params["layers"]))


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_the_rematerialised_scan_converts_one_layer_of_the_base_not_the_stack(remat):
    gradient, adapters, base = adapter_gradient(remat)
    temporaries = gradient.lower(adapters, base).compile().memory_analysis().temp_size_in_bytes
    float32_base = 2 * layer_bytes(base)  # the copy XLA would make of the bfloat16 stack
    assert temporaries < float32_base, (temporaries, float32_base)


def test_reading_the_base_by_layer_gives_the_gradients_of_the_scan_and_of_the_unrolled_layers():
    """Against the scan without remat (which reads the base as the scan's input) and the
    unrolled layers, each entry to 2e-5 of the gradient's largest entry: float32 programs
    that round in different orders over 8 layers of width 256."""
    config = dataclasses.replace(CONFIG, param_dtype=jnp.float32, dtype=jnp.float32)
    gradient, adapters, base = adapter_gradient("full", config)
    actual = decoder.unstack_layers(gradient(adapters, base))
    without_remat, _, _ = adapter_gradient("none", config)
    unrolled_model, unrolled_base = models.with_scan_layers(models.abstract(config)[0], base, False)
    lora_model = lora.adapted(unrolled_model, models.LoraConfig(rank=4))
    tokens = jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32) % config.vocab_size

    @jax.jit
    def reference(adapters):
        return objective(models.forward(lora_model, lora.combine(unrolled_base, adapters), tokens))

    references = (
        decoder.unstack_layers(without_remat(adapters, base)),
        jax.grad(reference)(decoder.unstack_layers(adapters)),
    )
    for expected in references:
        scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected))
        for got, wanted in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            assert float(jnp.max(jnp.abs(wanted))) > 0  # every adapter takes part
            np.testing.assert_allclose(got, wanted, rtol=0, atol=2e-5 * scale)
