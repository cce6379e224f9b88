"""Hugging Face interop: round trips, sharded checkpoints, atomic saves, bfloat16, errors."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from jaxrl_llm import models, tasks
from jaxrl_llm.models import hf as hf_io
from tests.models.hf_fixtures import hf_logits, left_padded_batch, tiny_hf_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_round_trip_through_transformers_gives_identical_logits(family, tmp_path):
    original = tiny_hf_model(family, tie_word_embeddings=family == "qwen3")
    original.save_pretrained(tmp_path / "hf")
    model, params = models.from_pretrained(tmp_path / "hf")
    models.save_pretrained(tmp_path / "ours", model, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", local_files_only=True).eval()
    assert type(reloaded) is type(original)
    tokens, mask, positions = left_padded_batch(model.config.vocab_size)
    np.testing.assert_array_equal(
        hf_logits(reloaded, tokens, mask, positions), hf_logits(original, tokens, mask, positions)
    )
    # And back into ours: the same parameters, bit for bit.
    _, params_again = models.from_pretrained(tmp_path / "ours")
    chex.assert_trees_all_equal(params_again, params)


def test_sharded_checkpoints_save_and_load_with_an_index(tmp_path):
    model, params = models.init(
        models.ModelConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8
        ),
        jax.random.key(1),
    )
    models.save_pretrained(tmp_path, model, params, max_shard_bytes=4096)
    index = json.loads((tmp_path / hf_io.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, loaded = models.from_pretrained(tmp_path)
    chex.assert_trees_all_equal(loaded, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tokens, mask, positions = left_padded_batch(50)
    ours = models.forward(model, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    valid = mask.astype(bool)
    assert np.abs(np.asarray(ours)[valid] - hf_logits(hf_model, tokens, mask, positions)[valid]).max() <= 1e-4


def test_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, params = models.init(
        models.ModelConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8
        ),
        jax.random.key(2),
    )
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, params)
    before = sorted(p.name for p in target.iterdir())

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_file", fail)
    changed = jax.tree.map(lambda x: x + 1, params)
    with pytest.raises(OSError, match="disk full"):
        models.save_pretrained(target, model, changed)
    assert sorted(p.name for p in target.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left behind
    _, loaded = models.from_pretrained(target)
    chex.assert_trees_all_equal(loaded, params)


def test_bfloat16_stays_within_tolerance_of_float32(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    model32, params32 = models.from_pretrained(tmp_path)
    model16, params16 = models.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    mixed, params_mixed = models.from_pretrained(tmp_path, dtype="bfloat16", compute_dtype="float32")
    assert jax.tree.leaves(params16)[0].dtype == jnp.bfloat16 and mixed.config.dtype == jnp.float32
    tokens, mask, _ = left_padded_batch(model32.config.vocab_size)
    args = dict(attention_mask=jnp.asarray(mask))
    valid = mask.astype(bool)
    reference = np.asarray(models.forward(model32, params32, jnp.asarray(tokens), **args))[valid]
    scale = np.abs(reference).max()
    for model, params in ((model16, params16), (mixed, params_mixed)):
        logits = np.asarray(models.forward(model, params, jnp.asarray(tokens), **args).astype(jnp.float32))[valid]
        # Stated tolerance: bfloat16 has an 8-bit mantissa; 3% of the logits' scale.
        assert np.abs(logits - reference).max() <= 0.03 * scale


# --- Bad input ---------------------------------------------------------------------------------


def test_missing_directory_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="No config.json"):
        models.from_pretrained(tmp_path)
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No weights in .*\*\.safetensors"):
        models.from_pretrained(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"Unsupported architecture 'gpt2'; supported: llama \(LlamaForCausalLM\), "
        r"mistral .*qwen2 .*qwen3 \(Qwen3ForCausalLM\)",
    ):
        models.from_pretrained(tmp_path)


def test_missing_tensor_and_shape_mismatch_name_the_tensor(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    weights = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    good = dict(weights)
    del weights[name]
    safetensors.numpy.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing tensor '{name}' \(shape \[48, 32\]\)"):
        models.from_pretrained(tmp_path)
    good[name] = np.zeros((40, 32), np.float32)
    safetensors.numpy.save_file(good, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=rf"Tensor '{name}' has shape \[40, 32\] in the checkpoint, but the config "
        r"implies \[48, 32\]",
    ):
        models.from_pretrained(tmp_path)


def test_too_long_sequences_are_refused():
    model, params = models.init(
        models.ModelConfig(
            vocab_size=10,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
            max_position_embeddings=4,
        ),
        jax.random.key(0),
    )
    with pytest.raises(ValueError, match=r"sequence length 5 exceeds the model's max_position_embeddings \(4\)"):
        models.forward(model, params, jnp.zeros((1, 5), jnp.int32))


def test_torch_is_the_cpu_build():
    assert not torch.cuda.is_available() or torch.version.cuda is None


def test_params_edited_by_item_assignment_still_save(tmp_path):
    model, params = models.init(
        models.ModelConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8
        ),
        jax.random.key(3),
    )
    params["lm_head"] = params["lm_head"] * 2.0  # a bare array now sits where a Param was
    models.save_pretrained(tmp_path, model, params)
    _, loaded = models.from_pretrained(tmp_path)
    np.testing.assert_array_equal(loaded["lm_head"], params["lm_head"])


def test_saving_over_a_checkpoint_keeps_tokenizer_and_other_files_and_token_ids(tmp_path):
    hf_model = tiny_hf_model("llama", eos_token_id=[91, 92], bos_token_id=90, pad_token_id=0)
    hf_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path)
    assert (model.config.bos_token_id, model.config.eos_token_ids, model.config.pad_token_id) == (90, (91, 92), 0)
    models.save_pretrained(tmp_path, model, params, max_shard_bytes=20_000)  # sharded, with an index
    assert (tmp_path / hf_io.INDEX_FILE).exists()
    tokenizer = tasks.build_char_tokenizer("abc")
    models.save_tokenizer(tokenizer, tmp_path)
    (tmp_path / "training_state.json").write_text("{}")

    models.save_pretrained(tmp_path, model, params)  # one file now: old shards and index go
    names = {p.name for p in tmp_path.iterdir()}
    assert {"tokenizer.json", "training_state.json", "generation_config.json", "model.safetensors"} <= names
    assert hf_io.INDEX_FILE not in names and not any(n.startswith("model-0") for n in names)
    assert models.load_tokenizer(tmp_path)("abc")["input_ids"] == tokenizer("abc")["input_ids"]
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert (reloaded.bos_token_id, list(reloaded.eos_token_id), reloaded.pad_token_id) == (90, [91, 92], 0)
    _, loaded = models.from_pretrained(tmp_path)
    chex.assert_trees_all_equal(loaded, params)
