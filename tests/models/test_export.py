"""Exporting a policy as a complete Hugging Face directory (model, tokenizer, generation config),
checked against transformers: it loads both, generates greedily what our sampler generates,
stops at the exported EOS ids unasked, and renders the chat template as before."""

import dataclasses
import json
import string

import chex
import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from jaxrl_llm import models, sampling, tasks
from tests.tasks.fixtures import chat_tokenizer

CHAR_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [
    [{"role": "user", "content": "what is 2 + 2?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12 + 7 = ?"}],
]
NEW_TOKENS = 12


def char_tokenizer() -> transformers.PreTrainedTokenizerBase:
    tokenizer = tasks.build_char_tokenizer(string.ascii_lowercase + string.digits + " +=?<>")
    tokenizer.chat_template = CHAR_TEMPLATE
    return tokenizer


TOKENIZERS = {"char": char_tokenizer, "chatml": chat_tokenizer}
ARCHITECTURES = {
    "char": dict(architecture="llama"),
    "chatml": dict(architecture="qwen3", qk_norm=True, tie_word_embeddings=True),
}


def tiny_config(vocab_size: int, **overrides) -> models.ModelConfig:
    return models.ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        **overrides,
    )


def random_policy(config: models.ModelConfig, *, seed: int = 0):
    """``(model, params)`` with normal(0.3) NumPy parameters, norm scales around 1: logits far
    from ties (``models.init``'s normal(0.02) and zero biases give nearly flat ones), and no
    JAX computation to build them."""
    model, shapes = models.abstract(config)
    rng = np.random.default_rng(seed)
    params = jax.tree.map_with_path(
        lambda path, s: rng.normal(float("norm" in jax.tree_util.keystr(path)), 0.3, s.shape).astype(s.dtype), shapes
    )
    return model, params


def prompts(tokenizer):
    texts = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="np")
    return texts, batch["input_ids"], batch["attention_mask"]


def greedy(model, params, tokens, mask, *, pad_id) -> np.ndarray:
    """Our greedy completions ``[P, NEW_TOKENS]``, stopped at the model config's EOS ids."""
    rollout = sampling.sample(
        model,
        params,
        tokens,
        mask,
        jax.random.key(0),
        num_samples=1,
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        eos_ids=model.config.eos_token_ids,
        pad_id=pad_id,
    )
    return np.asarray(rollout.completion_tokens)


def hf_generate(directory, tokens, mask, *, pad_id) -> np.ndarray:
    """transformers' completions ``[P, NEW_TOKENS]`` of the checkpoint at ``directory``, in
    float32, told nothing but the budget: the decoding mode (greedy), stop ids and pad id all
    come from its ``generation_config.json``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        out = model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask), max_new_tokens=NEW_TOKENS)
    out = out.numpy()[:, tokens.shape[1] :]
    return np.pad(out, ((0, 0), (0, NEW_TOKENS - out.shape[1])), constant_values=pad_id)  # all rows ended early


def test_transformers_generates_what_we_generate_and_stops_at_the_exported_eos_ids(tmp_path):
    tokenizer = chat_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = tiny_config(len(tokenizer) + 3, eos_token_ids=(eos,), pad_token_id=pad, **ARCHITECTURES["chatml"])
    model, params = random_policy(config)
    _, tokens, mask = prompts(tokenizer)
    # A second EOS id, as chat models stop on an end-of-turn token too: the 4th token of the
    # first prompt's greedy completion.
    models.save_pretrained(tmp_path, model, params, tokenizer=tokenizer)
    first_row = hf_generate(tmp_path, tokens, mask, pad_id=pad)[0]
    stop = int(first_row[3])
    assert stop not in (eos, *first_row[:3]), "pick another step: this one ends no earlier"
    model, _ = models.abstract(dataclasses.replace(config, eos_token_ids=(eos, stop)))
    models.save_pretrained(tmp_path, model, params, tokenizer=tokenizer)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [eos, stop]

    theirs = hf_generate(tmp_path, tokens, mask, pad_id=pad)
    np.testing.assert_array_equal(theirs, greedy(model, params, tokens, mask, pad_id=pad))
    assert theirs[0, 3] == stop and (theirs[0, 4:] == pad).all()  # stopped at the id only the file names


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_tokenizer_and_its_chat_template_load_back(name, tmp_path):
    tokenizer = TOKENIZERS[name]()
    config = tiny_config(len(tokenizer) + 3, eos_token_ids=(tokenizer.eos_token_id,), **ARCHITECTURES[name])
    model, params = random_policy(config)
    models.save_pretrained(tmp_path, model, params, tokenizer=tokenizer)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {  # one EOS: an int
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }

    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.special_tokens_map == tokenizer.special_tokens_map
    assert loaded.padding_side == "left" and loaded.chat_template == tokenizer.chat_template
    texts, tokens, mask = prompts(tokenizer)
    loaded_texts, loaded_tokens, loaded_mask = prompts(loaded)
    assert loaded_texts == texts
    np.testing.assert_array_equal(loaded_tokens, tokens)
    np.testing.assert_array_equal(loaded_mask, mask)

    # Our loader still reads the directory: the same parameters and token ids.
    reloaded, reloaded_params = models.from_pretrained(tmp_path)
    assert reloaded.config == model.config
    chex.assert_trees_all_equal(reloaded_params, params)


def test_generation_config_takes_sampling_defaults_and_keeps_given_ids(tmp_path):
    model, params = random_policy(tiny_config(64, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0))
    sampling_defaults = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    models.save_pretrained(tmp_path, model, params, generation_config=sampling_defaults)
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert {k: getattr(loaded, k) for k in sampling_defaults} == sampling_defaults
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)  # one id: an int

    given = transformers.GenerationConfig(eos_token_id=[5, 6], max_new_tokens=9)
    models.save_pretrained(tmp_path, model, params, generation_config=given)
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.max_new_tokens, loaded.temperature) == ([5, 6], 0, 9, None)
    assert given.pad_token_id is None  # the caller's object is not modified

    # With no ids in the model config, the tokenizer's fill in.
    model, params = random_policy(tiny_config(64))
    tokenizer = char_tokenizer()
    models.save_pretrained(tmp_path, model, params, tokenizer=tokenizer)
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


def test_exporting_over_an_export_replaces_the_whole_tokenizer(tmp_path):
    target = tmp_path / "ckpt"
    model, params = random_policy(tiny_config(len(chat_tokenizer()), eos_token_ids=(2,)))
    models.save_pretrained(
        target, model, params, tokenizer=chat_tokenizer(), generation_config={"do_sample": True, "temperature": 0.5}
    )
    assert (target / "chat_template.jinja").is_file()
    for stale in ("vocab.json", "merges.txt", "special_tokens_map.json"):  # a transformers-4 tokenizer's files
        (target / stale).write_text("{}")
    safetensors.numpy.save_file({"value_head": np.ones((2, 3), np.float32)}, target / "critic.safetensors")

    char = tasks.build_char_tokenizer("abc")  # no chat template
    models.save_pretrained(target, model, params, tokenizer=char)
    loaded = transformers.AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert loaded.get_vocab() == char.get_vocab() and loaded.chat_template is None
    assert {p.name for p in target.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "critic.safetensors",
    }

    # A save of weights alone keeps the tokenizer and the generation config; one with a
    # generation config replaces that alone.
    models.save_pretrained(target, model, params, generation_config={"do_sample": True, "temperature": 0.5})
    kept = {name: (target / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    models.save_pretrained(target, model, jax.tree.map(lambda x: x + 1, params))
    assert {name: (target / name).read_bytes() for name in kept} == kept
    assert transformers.GenerationConfig.from_pretrained(target).temperature == 0.5
    models.save_pretrained(target, model, params, generation_config={})
    assert {name: (target / name).read_bytes() for name in kept} == kept
    assert transformers.GenerationConfig.from_pretrained(target).temperature is None
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging or retired directory left


def test_bad_input_raises_before_anything_is_written(tmp_path):
    tokenizer = chat_tokenizer()
    model, params = random_policy(tiny_config(len(tokenizer) - 1, eos_token_ids=(2,)))
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=rf"ids up to {len(tokenizer) - 1} .*vocab_size is {len(tokenizer) - 1}"):
        models.save_pretrained(fresh, model, params, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="do_sample"):  # transformers would refuse to save it
        models.save_pretrained(fresh, model, params, generation_config={"temperature": 0.7})
    with pytest.raises(ValueError, match=rf"eos_token_id \[2, 9999\] must be token ids in \[0, {len(tokenizer) - 1}\)"):
        models.save_pretrained(fresh, model, params, generation_config={"eos_token_id": [2, 9999]})
    with pytest.raises(TypeError, match="GenerationConfig"):
        models.save_pretrained(fresh, model, params, generation_config=[("temperature", 0.7)])
    with pytest.raises(TypeError, match="must be a transformers tokenizer"):
        models.save_pretrained(fresh, model, params, tokenizer="path/to/tokenizer")
    assert list(tmp_path.iterdir()) == []

    existing = tmp_path / "existing"
    models.save_pretrained(existing, model, params, tokenizer=tasks.build_char_tokenizer("abc"))
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    with pytest.raises(ValueError, match="vocab_size"):
        models.save_pretrained(existing, model, jax.tree.map(lambda x: x + 1, params), tokenizer=tokenizer)
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["existing"]


def test_a_tokenizer_that_transformers_would_load_differently_is_refused(tmp_path):
    """transformers 5 builds every qwen2 checkpoint's tokenizer as a Qwen2Tokenizer (Qwen's
    pre-tokenizer, whatever tokenizer.json says): right for Qwen's own, wrong for others."""
    tokenizer = chat_tokenizer()
    model, params = random_policy(tiny_config(len(tokenizer), architecture="qwen2", attention_bias=True))
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, params)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ValueError, match=r"'qwen2' model, AutoTokenizer builds a Qwen2Tokenizer.*the ids of"):
        models.save_pretrained(target, model, params, tokenizer=tokenizer)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]

    # The same vocabulary as a Qwen2Tokenizer loads back as itself.
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    qwen = transformers.Qwen2Tokenizer(
        vocab=backend["vocab"],
        merges=[tuple(m) for m in backend["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    models.save_pretrained(target, model, params, tokenizer=qwen)
    loaded = transformers.AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert type(loaded) is transformers.Qwen2Tokenizer
    assert loaded("12 + 345")["input_ids"] == qwen("12 + 345")["input_ids"]
