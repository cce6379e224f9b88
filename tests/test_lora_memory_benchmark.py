"""``benchmarks/lora_memory.py``'s state part at a toy Qwen2 shape, against a count by hand:
LoRA's adapters are ``r (in + out)`` float32 numbers per targeted projection, their AdamW
moments twice that, the reference adapters of zeros (no copy of the base), the base its
parameters in bfloat16; full training keeps the bfloat16 params, a float32 master copy and
two float32 moments, and a bfloat16 reference."""

import dataclasses
import pathlib
import sys

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import lora_memory as bench  # noqa: E402

from jaxrl_llm import models  # noqa: E402

TOY = models.ModelConfig(
    architecture="qwen2",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
    attention_bias=True,
    param_dtype=jnp.bfloat16,
    dtype=jnp.bfloat16,
)


def hand_count(config: models.ModelConfig, rank: int) -> tuple[int, int]:
    """``(base parameters, adapter parameters)`` of ``config`` with rank-``rank`` adapters on all
    seven projections."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.num_heads * 8, config.num_kv_heads * 8
    projections = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    layer = sum(a * b for a, b in projections) + (q + 2 * kv) + 2 * h  # kernels, q/k/v biases, two norms
    base = config.vocab_size * h + config.num_layers * layer + h  # tied embedding, layers, final norm
    adapters = config.num_layers * sum(rank * (a + b) for a, b in projections)
    return base, adapters


def test_state_bytes_match_a_count_by_hand():
    full, lora, int8 = bench.state_rows({"toy": TOY})
    base, adapters = hand_count(TOY, bench.LORA.rank)
    assert lora["params"] == full["params"] == full["trained"] == base and lora["trained"] == adapters

    assert lora["base"] == 2 * base  # bfloat16, the caller's arrays
    assert lora["adapters"] == 4 * adapters  # float32
    assert 0 <= lora["optimizer"] - 2 * 4 * adapters <= 64  # two moments (no master copy: float32), and step counters
    assert lora["reference"] == 4 * adapters  # adapters of zeros: no second copy of the base

    assert full["base"] == 2 * base and full["adapters"] == 0
    assert 0 <= full["optimizer"] - 3 * 4 * base <= 64  # float32 master copy and two moments, and step counters
    assert full["reference"] == 2 * base
    # An int8 base: the seven kernels a byte a weight and a float32 scale per output channel;
    # embeddings, norms and biases in bfloat16. The adapters and their state as over bfloat16.
    h, i, q, kv = TOY.hidden_size, TOY.intermediate_size, TOY.num_heads * 8, TOY.num_kv_heads * 8
    projections = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    kernels = TOY.num_layers * sum(a * b for a, b in projections)
    scales = TOY.num_layers * sum(b for _, b in projections)
    assert int8["base"] == kernels + 4 * scales + 2 * (base - kernels)
    assert (int8["adapters"], int8["optimizer"], int8["reference"]) == (
        lora["adapters"],
        lora["optimizer"],
        lora["reference"],
    )
    assert int8["params"] == base + scales and int8["trained"] == adapters
    for row in (full, lora, int8):
        total = sum(row[c] for c in bench.COLUMNS)
        assert row["total"] == total and 0 <= row["other"] < 64  # counters, PRNG key, running baseline


def test_float32_adapters_are_counted_as_configured():
    # The adapters' storage dtype moves their bytes and their moments', not the base's.
    half = dataclasses.replace(bench.LORA, dtype=jnp.bfloat16)
    _, state, fixed = bench.abstract_state(TOY, half, bench.train_config(**bench.RUN_BATCH))
    parts = bench.state_breakdown(state, fixed)
    _, adapters = hand_count(TOY, half.rank)
    assert parts["adapters"] == 2 * adapters and parts["base"] == 2 * hand_count(TOY, half.rank)[0]
