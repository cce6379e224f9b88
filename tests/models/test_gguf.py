"""GGUF in and out: files written here as llama.cpp's converter writes them load with the logits of
the transformers model they came from and of transformers' own GGUF loader, in every GGML type the
gguf package reads; the dequantized weights equal transformers' independent torch dequantization;
what ``save_gguf`` writes reads back exactly (F32) or within its rounding, in the gguf reader, in
transformers and in ours."""

import dataclasses

import chex
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.integrations.gguf import dequant as torch_dequant

from jaxrl_llm import models, sharding, tasks
from jaxrl_llm.models import gguf as gguf_io
from jaxrl_llm.models import layout
from tests.models import gguf_fixtures as fixtures

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def tokenizer():
    return fixtures.bpe_tokenizer()


@pytest.fixture(scope="module")
def hf_models(tokenizer):
    return {family: fixtures.tiny_gguf_hf_model(family, tokenizer) for family in FAMILIES}


def ids_of(tokenizer, text=fixtures.PROBES[0]):
    return np.asarray([tokenizer(text)["input_ids"]])


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def ours(path, ids, **load):
    model, params = models.from_pretrained(path, **load)
    return np.asarray(models.forward(model, params, jnp.asarray(ids)))


def transformers_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_float32_file_gives_the_logits_of_the_model_it_was_converted_from(family, hf_models, tokenizer, tmp_path):
    path = fixtures.write_gguf(tmp_path / "model.gguf", hf_models[family], tokenizer)
    ids = ids_of(tokenizer)
    logits = ours(path, ids)
    np.testing.assert_allclose(logits, torch_logits(hf_models[family], ids), atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits, torch_logits(transformers_gguf(path), ids), atol=2e-5, rtol=0)
    config = models.read_config(path)
    assert config.architecture == family
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (
        tokenizer.bos_token_id,
        (tokenizer.eos_token_id,),
        tokenizer.pad_token_id,
    )
    assert config.tie_word_embeddings is False and config.rms_norm_eps == hf_models[family].config.rms_norm_eps


def test_the_tokenizer_is_transformers_gguf_tokenizer(hf_models, tokenizer, tmp_path):
    path = fixtures.write_gguf(tmp_path / "model.gguf", hf_models["llama"], tokenizer)
    loaded = models.load_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in fixtures.PROBES:
        assert loaded(text)["input_ids"] == reference(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == reference.chat_template == fixtures.CHATML
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(loaded, name) == getattr(reference, name) == getattr(tokenizer, name)
    assert loaded.padding_side == "left"
    assert models.load_tokenizer(tmp_path).get_vocab() == loaded.get_vocab()  # the directory holding the file


def test_a_file_is_parsed_once_until_it_is_written_anew(hf_models, tokenizer, tmp_path, monkeypatch):
    """A run reads its model's config, tokenizer and weights from one file: its metadata is
    parsed once for all three. A file written anew in the same place is parsed again, and each
    dtype gets its own config."""
    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda file: parses.append(file) or reader(file))
    path = fixtures.write_gguf(tmp_path / "model.gguf", hf_models["llama"], tokenizer)
    assert models.read_config(path).architecture == "llama"
    assert models.read_config(path, dtype="bfloat16").param_dtype == jnp.bfloat16
    assert models.read_config(path).param_dtype == jnp.float32
    loaded = models.load_tokenizer(path)
    loaded.add_tokens(["<added>"])  # a tokenizer changed by its user leaves the next one as the file has it
    assert models.load_tokenizer(path).get_vocab() == tokenizer.get_vocab()
    _, params = models.from_pretrained(path)
    assert len(parses) == 1
    fixtures.write_gguf(path, hf_models["qwen2"], tokenizer)
    model, again = models.from_pretrained(path)
    assert model.config.architecture == "qwen2" and len(parses) == 2
    assert jax.tree.structure(again) != jax.tree.structure(params)  # qwen2's biases: read from the new file


@pytest.mark.parametrize("qtype", fixtures.READ_TYPES)
def test_every_type_loads_as_transformers_loads_it(qtype, hf_models, tokenizer, tmp_path):
    path = fixtures.write_gguf(tmp_path / f"model-{qtype}.gguf", hf_models["llama"], tokenizer, qtype=qtype)
    ids = ids_of(tokenizer)
    reference = torch_logits(transformers_gguf(path), ids)
    scale = np.abs(reference).max()
    np.testing.assert_allclose(ours(path, ids), reference, atol=1e-5 * max(scale, 1.0), rtol=0)


@pytest.mark.parametrize("qtype", sorted(torch_dequant.GGML_NAME.values()))
def test_dequantized_weights_equal_transformers_torch_dequantization(qtype, hf_models, tokenizer, tmp_path):
    """transformers' torch dequantization is written apart from the gguf package's NumPy one."""
    path = fixtures.write_gguf(tmp_path / "model.gguf", hf_models["qwen2"], tokenizer, qtype=qtype)
    raw = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    _, params = models.from_pretrained(path)
    for ours_value, name in [
        (params["layers"][1]["mlp"]["down_proj"], "blk.1.ffn_down.weight"),  # ours [in, out], GGUF [out, in]
        (params["embed_tokens"], "token_embd.weight"),
    ]:
        tensor = raw[name]
        values = torch_dequant.dequantize(torch.from_numpy(np.array(tensor.data).reshape(-1)), int(tensor.tensor_type))
        expected = values.numpy().reshape(tuple(reversed(tensor.shape.tolist())))
        got = np.asarray(ours_value.get_value())
        np.testing.assert_allclose(got.T if name.endswith("ffn_down.weight") else got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("qtype", "levels"), [("Q8_0", 127), ("Q5_1", 31), ("Q5_0", 15), ("Q4_1", 15), ("Q4_0", 7)])
def test_a_quantized_file_holds_the_weights_within_a_step(qtype, levels, hf_models, tokenizer, tmp_path):
    """A block of 32 weights is stored as ``levels`` steps of its absolute maximum (``_0``) or of
    its range (``_1``): each weight read back within one step of its value."""
    original = hf_models["llama"]
    path = fixtures.write_gguf(tmp_path / "model.gguf", original, tokenizer, qtype=qtype)
    _, params = models.from_pretrained(path)
    weights = original.model.layers[0].mlp.up_proj.weight.detach().numpy()  # [out, in]
    blocks = weights.reshape(weights.shape[0], -1, 32)
    if qtype.endswith("_1"):
        step = (blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)) / levels
    else:
        step = np.abs(blocks).max(-1, keepdims=True) / levels
    error = np.abs(np.asarray(params["layers"][0]["mlp"]["up_proj"].get_value()).T - weights)
    assert (error.reshape(blocks.shape) <= step * 1.001).all()
    assert error.max() > 0


def test_mesh_int8_and_stacked_loads_equal_the_plain_load(hf_models, tokenizer, tmp_path):
    path = fixtures.write_gguf(tmp_path / "model.gguf", hf_models["qwen2"], tokenizer, qtype="Q8_0")
    model, params = models.from_pretrained(path)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    _, on_mesh = models.from_pretrained(path, mesh=mesh)
    chex.assert_trees_all_equal(jax.device_get(on_mesh), jax.device_get(params))
    _, stacked = models.from_pretrained(path, scan_layers=True)
    _, restacked = models.with_scan_layers(model, params, True)
    chex.assert_trees_all_equal(stacked, restacked)
    int8_model, int8 = models.from_pretrained(path, quantization="int8")
    _, expected = models.quantize.quantize(model, params)
    chex.assert_trees_all_equal(int8, expected)
    assert int8_model.config.quantization == "int8"


def test_files_that_cannot_load_are_refused_by_name(hf_models, tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="No GGUF file"):
        models.from_pretrained(tmp_path / "missing.gguf")
    first = fixtures.write_gguf(tmp_path / "a.gguf", hf_models["llama"], tokenizer)
    (tmp_path / "b.gguf").write_bytes(first.read_bytes())
    with pytest.raises(ValueError, match=r"2 GGUF files \(a.gguf, b.gguf\); name the one"):
        models.from_pretrained(tmp_path)
    truncated = tmp_path / "truncated" / "model.gguf"
    truncated.parent.mkdir()
    truncated.write_bytes(first.read_bytes()[:5000])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        models.from_pretrained(truncated)
    headless = fixtures.write_gguf(
        tmp_path / "headless.gguf", hf_models["llama"], tokenizer, leave_out=("model.embed_tokens.weight",)
    )
    with pytest.raises(ValueError, match="headless.gguf has no token_embd.weight: not a llama model's weights"):
        models.from_pretrained(headless)
    for arch, message in [
        ("gemma2", r"architecture 'gemma2' is not supported; supported: llama"),
        ("llama", r"its metadata has no llama.embedding_length; not a complete llama GGUF file"),
    ]:
        other = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(other, arch)
        writer.add_block_count(1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=message):
            models.from_pretrained(other)


# --- Writing ---------------------------------------------------------------------------------------


def from_transformers(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "hf")
    return models.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize("family", [*FAMILIES, "mistral"])
def test_a_float32_export_reads_back_bit_for_bit_and_in_transformers(family, hf_models, tokenizer, tmp_path):
    source = hf_models["llama" if family == "mistral" else family]
    model, params = from_transformers(source, tmp_path)
    if family == "mistral":
        model, _ = models.abstract(dataclasses.replace(model.config, architecture="mistral"))
    path = models.save_gguf(tmp_path / "out" / "policy", model, params, tokenizer=tokenizer, file_type="f32")
    assert path.name == "policy.gguf" and path.is_file()
    reloaded_model, reloaded = models.from_pretrained(path)
    chex.assert_trees_all_equal(reloaded, params)
    assert reloaded_model.config.architecture == ("llama" if family == "mistral" else family)
    ids = ids_of(tokenizer)
    logits = np.asarray(models.forward(model, params, jnp.asarray(ids)))
    np.testing.assert_allclose(torch_logits(transformers_gguf(path), ids), logits, atol=2e-5, rtol=0)
    again = models.load_tokenizer(path)
    for text in fixtures.PROBES:
        assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.chat_template == tokenizer.chat_template


@pytest.mark.parametrize(
    ("file_type", "kind", "tolerance"),
    [
        ("f16", "F16", 2e-3),
        ("bf16", "BF16", 2e-2),
        ("q8_0", "Q8_0", 4e-2),
        ("q5_1", "Q5_1", 0.15),
        ("q5_0", "Q5_0", 0.15),
        ("q4_1", "Q4_1", 0.3),
        ("q4_0", "Q4_0", 0.3),
    ],
)
def test_a_quantized_export_is_read_alike_by_every_reader(file_type, kind, tolerance, hf_models, tokenizer, tmp_path):
    model, params = from_transformers(hf_models["llama"], tmp_path)
    path = models.save_gguf(tmp_path / "policy.gguf", model, params, tokenizer=tokenizer, file_type=file_type)
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == types["output.weight"] == kind
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    ids = ids_of(tokenizer)
    reloaded = ours(path, ids)
    np.testing.assert_allclose(torch_logits(transformers_gguf(path), ids), reloaded, atol=2e-5, rtol=0)
    original = np.asarray(models.forward(model, params, jnp.asarray(ids)))
    assert 0 < np.abs(reloaded - original).max() <= tolerance * np.abs(original).max()


def test_rows_a_block_cannot_split_are_written_as_f16(tmp_path, tokenizer):
    config = models.ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=24,
    )
    model, params = models.init(config, jax.random.key(0))
    path = models.save_gguf(tmp_path / "p.gguf", model, params, tokenizer=tokenizer, file_type="q8_0")
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up.weight"] == "F16"  # rows of 48 values
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 96


def test_llama3_rotary_scaling_is_written_as_rope_freqs_and_read_back(hf_models, tokenizer, tmp_path):
    llama3 = models.RopeConfig(
        theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0
    )
    model, params = from_transformers(hf_models["llama"], tmp_path)
    model, _ = models.abstract(dataclasses.replace(model.config, rope=llama3))
    path = models.save_gguf(tmp_path / "policy.gguf", model, params, tokenizer=tokenizer, file_type="f32")
    assert "rope_freqs.weight" in {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    reloaded_model, reloaded = models.from_pretrained(path)
    assert reloaded_model.config.rope == llama3
    ids = jnp.asarray(ids_of(tokenizer))
    chex.assert_trees_all_equal(models.forward(reloaded_model, reloaded, ids), models.forward(model, params, ids))


def test_lora_models_are_written_merged_and_int8_bases_dequantized(hf_models, tokenizer, tmp_path):
    model, params = from_transformers(hf_models["qwen2"], tmp_path)
    lora_model, adapters = models.lora.add_adapters(model, models.LoraConfig(rank=4), jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)
    combined = models.lora.combine(params, adapters)
    merged_model, merged = models.lora.merge(lora_model, combined)
    path = models.save_gguf(tmp_path / "lora.gguf", lora_model, combined, tokenizer=tokenizer, file_type="f32")
    chex.assert_trees_all_equal(models.from_pretrained(path)[1], merged)
    int8_model, int8 = models.quantize.quantize(model, params)
    path = models.save_gguf(tmp_path / "int8.gguf", int8_model, int8, tokenizer=tokenizer, file_type="f32")
    chex.assert_trees_all_equal(models.from_pretrained(path)[1], models.quantize.dequantize(int8_model, int8)[1])
    assert merged_model.config.lora is None


def test_bad_exports_are_refused_before_anything_is_written(hf_models, tokenizer, tmp_path):
    model, params = from_transformers(hf_models["llama"], tmp_path)
    with pytest.raises(ValueError, match="file_type must be one of f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0"):
        models.save_gguf(tmp_path / "a.gguf", model, params, tokenizer=tokenizer, file_type="q4_k")
    characters = tasks.build_char_tokenizer("abc")
    with pytest.raises(ValueError, match="byte-level BPE tokenizers .* this one is WordLevel"):
        models.save_gguf(tmp_path / "a.gguf", model, params, tokenizer=characters)
    windowed, _ = models.abstract(
        dataclasses.replace(model.config, architecture="mistral", sliding_windows=(16,) * model.config.num_layers)
    )
    with pytest.raises(ValueError, match="sliding window"):
        models.save_gguf(tmp_path / "a.gguf", windowed, params, tokenizer=tokenizer)
    assert not list(tmp_path.glob("*.gguf"))


def test_an_interrupted_export_leaves_no_file_and_keeps_the_previous_one(hf_models, tokenizer, tmp_path, monkeypatch):
    model, params = from_transformers(hf_models["llama"], tmp_path)
    path = models.save_gguf(tmp_path / "policy.gguf", model, params, tokenizer=tokenizer, file_type="f16")
    before = path.read_bytes()

    def fail(self, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(KeyboardInterrupt):
        models.save_gguf(path, model, params, tokenizer=tokenizer, file_type="q8_0")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "policy.gguf"]


def test_gguf_names_cover_every_parameter_both_ways(hf_models, tokenizer, tmp_path):
    model, params = from_transformers(hf_models["qwen3"], tmp_path)
    for path, _ in nnx.to_flat_state(params):
        name, _ = layout.hf_name(path)
        assert gguf_io.hf_tensor_name(gguf_io.gguf_name(name)) == name
    with pytest.raises(KeyError, match="No GGUF name"):
        gguf_io.gguf_name("model.layers.0.mlp.experts.0.weight")
