"""The reward model against transformers' PyTorch *ForSequenceClassification models.

Tiny random Llama / Mistral / Qwen2 / Qwen3 sequence classifiers (num_labels = 1) are
saved in the Hugging Face format with a small character tokenizer, loaded with
:meth:`RewardModel.from_pretrained`, and scored against ``model(...).logits[:, 0]``.
torch is imported unconditionally: a missing torch fails these tests, it never skips them.
"""

import dataclasses
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tokenizer_models

from jaxrl_llm.rewards.reward_model import RewardModel, pooling_index, score_tokens
from tests.models.hf_fixtures import TINY

PAD, BOS, EOS = 0, 1, 2
ALPHABET = string.ascii_letters + string.digits + " .,!?:;'<>|/-_=+()\n"
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification"),
    "mistral": ("MistralConfig", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification"),
}
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-window-3": ("mistral", {"sliding_window": 3}),
}


def tiny_tokenizer(chat_template: str | None = None) -> transformers.PreTrainedTokenizerFast:
    """One token per character; ids 0-3 are <pad> <bos> <eos> <unk>; BOS is added as a special token."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    backend = Tokenizer(
        tokenizer_models.WordLevel({t: i for i, t in enumerate(specials + list(ALPHABET))}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_classifier(family: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random float32 sequence classifier with one label, GQA and every parameter perturbed."""
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    config = config_class(**{**TINY, "num_labels": 1, "pad_token_id": PAD, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.score.weight.mul_(20.0)  # scores of order one
    return model


def save(directory, model, tokenizer=None):
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def hf_scores(model, rows) -> np.ndarray:
    """Each row scored alone, unpadded: the score of that text."""
    with torch.no_grad():
        return np.array([model(input_ids=torch.tensor([list(row)])).logits[0, 0].item() for row in rows])


def padded(rows, *, side: str):
    width = max(map(len, rows))
    tokens, mask = np.full((len(rows), width), PAD, np.int64), np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        tokens[i, where], mask[i, where] = row, 1
    return tokens, mask


def parity_rows(vocab: int):
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(3, vocab, size=n)) for n in (9, 4, 7, 1, 6)]
    rows[2][3] = PAD  # a real pad id inside a row: attended to, not pooled at
    rows[4][-1] = PAD  # a real pad id at the end: transformers pools at the token before it
    rows.append([PAD, PAD])  # only pad ids: transformers pools at the first token
    return rows


@pytest.mark.parametrize("case", list(CASES))
def test_scores_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf_model = tiny_classifier(family, **overrides)
    rm = RewardModel.from_pretrained(save(tmp_path, hf_model, tiny_tokenizer()), batch_size=2, length_bucket=16)
    assert rm.model.config.architecture == family and "lm_head" not in rm.params
    rows = parity_rows(TINY["vocab_size"])
    alone = hf_scores(hf_model, rows)
    tokens, mask = padded(rows, side="right")
    with torch.no_grad():  # TRL's call: right-padded batch, default positions
        batch = hf_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits[:, 0].numpy()
    np.testing.assert_allclose(batch, alone, atol=1e-5)

    scored = jax.jit(score_tokens)
    for side in ("left", "right"):
        tokens, mask = padded(rows, side=side)
        ours = np.asarray(scored(rm.model, rm.params, rm.head, jnp.asarray(tokens), jnp.asarray(mask)))
        assert ours.dtype == np.float32
        assert np.abs(ours - alone).max() <= 1e-4, (side, np.abs(ours - alone).max())
    # Sorted into chunks of 2 rows, bucketed, left-padded, then put back in order.
    assert np.abs(rm.score_ids(rows) - alone).max() <= 1e-4


def test_pooling_index_follows_transformers_rule():
    tokens = jnp.array([[0, 5, 6, 0], [0, 0, 7, 8], [0, 0, 0, 0], [9, 9, 0, 0]])
    mask = jnp.array([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(pooling_index(tokens, mask, pad_token_id=0), [2, 3, 2, 1])
    np.testing.assert_array_equal(pooling_index(tokens, mask, pad_token_id=None), [3, 3, 3, 1])


def test_without_pad_token_id_scores_each_row_as_transformers_scores_it_alone(tmp_path):
    hf_model = tiny_classifier("llama", pad_token_id=None)
    rm = RewardModel.from_pretrained(save(tmp_path, hf_model, tiny_tokenizer()))
    assert rm.model.config.pad_token_id is None
    rows = parity_rows(TINY["vocab_size"])  # pad ids are ordinary tokens here
    assert np.abs(rm.score_ids(rows) - hf_scores(hf_model, rows)).max() <= 1e-4


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    hf_model = tiny_classifier("qwen2", seed=3)
    return hf_model, save(tmp_path_factory.mktemp("chat"), hf_model, tiny_tokenizer(TEMPLATE))


PROMPTS = ["What is 2+2?", "Name a colour.", "Say hi"]
COMPLETIONS = ["4", "Blue, I think.", "hi!"]


def test_reward_function_convention_on_plain_text(chat_checkpoint, tmp_path):
    hf_model, _ = chat_checkpoint
    tokenizer = tiny_tokenizer()  # no chat template: prompt + completion, with the BOS
    rm = RewardModel.from_pretrained(save(tmp_path, hf_model), tokenizer=tokenizer)
    assert rm.__name__ == "reward_model" and rm.chat_template is None
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 3, answer=["4", "", ""])
    assert isinstance(scores, list) and len(scores) == 3 and all(type(s) is float for s in scores)
    rows = [tokenizer(p + c)["input_ids"] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert all(row[0] == BOS for row in rows) and rm.encode(prompts=PROMPTS, completions=COMPLETIONS) == rows
    assert np.abs(np.array(scores) - hf_scores(hf_model, rows)).max() <= 1e-4
    # TRL's plain-text call exactly: no special tokens.
    trl = dataclasses.replace(rm, add_special_tokens=False)
    assert trl.encode(prompts=PROMPTS, completions=COMPLETIONS) == [row[1:] for row in rows]
    assert rm(prompts=[], completions=[]) == []

    with pytest.raises(TypeError):
        rm(PROMPTS, COMPLETIONS)  # keyword-only, as TRL calls it
    with pytest.raises(ValueError, match="3 prompts and 2 completions"):
        rm(prompts=PROMPTS, completions=COMPLETIONS[:2])
    with pytest.raises(ValueError, match="need a chat template"):
        rm(prompts=[[{"role": "user", "content": "x"}]], completions=[[{"role": "assistant", "content": "y"}]])
    with pytest.raises(ValueError, match="no chat template"):
        dataclasses.replace(rm, chat_template=True)


def test_chat_template_is_applied_and_tokenized_without_special_tokens(chat_checkpoint):
    hf_model, directory = chat_checkpoint
    rm = RewardModel.from_pretrained(directory, name="rm_qwen2")
    assert rm.__name__ == "rm_qwen2"
    texts = rm.texts(prompts=PROMPTS, completions=COMPLETIONS)
    assert texts[0] == "<|user|>What is 2+2?<eos><|assistant|>4<eos>"
    rows = [rm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert rows[0][0] != BOS and rows[0][-1] == EOS  # the template's tokens only, "<eos>" as one token
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS)
    assert np.abs(np.array(scores) - hf_scores(hf_model, rows)).max() <= 1e-4
    # TRL's conversational format gives the same text and scores.
    conversational = rm(
        prompts=[[{"role": "user", "content": p}] for p in PROMPTS],
        completions=[[{"role": "assistant", "content": c}] for c in COMPLETIONS],
    )
    assert conversational == scores
    # chat_template=False: the plain concatenation, a different text and score.
    plain = dataclasses.replace(rm, chat_template=False)
    assert plain.texts(prompts=PROMPTS, completions=COMPLETIONS) == [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert np.abs(np.array(plain(prompts=PROMPTS, completions=COMPLETIONS)) - scores).max() > 1e-3


def test_long_rows_keep_their_last_max_length_tokens(chat_checkpoint):
    hf_model, directory = chat_checkpoint
    rm = RewardModel.from_pretrained(directory, max_length=8, length_bucket=16)
    row = list(np.random.default_rng(2).integers(3, TINY["vocab_size"], size=20))
    assert np.abs(rm.score_ids([row, row[:5]]) - hf_scores(hf_model, [row[-8:], row[:5]])).max() <= 1e-4
    plain = dataclasses.replace(rm, chat_template=False)
    ids = plain.encode(prompts=["x" * 30], completions=["yz"])  # "<bos>xxx...xyz": the BOS is cut off
    assert plain.tokenizer.decode(ids[0]) == "xxxxxxyz"


def test_batches_within_a_bucket_share_one_trace(chat_checkpoint):
    _, directory = chat_checkpoint
    rm = RewardModel.from_pretrained(directory, batch_size=4, length_bucket=32)
    assert rm.traces == 0
    first = rm(prompts=["a", "bb", "ccc"], completions=["x", "y", "z"])  # 3 rows -> 4, ~13 tokens -> 32
    rm(prompts=["a long", "b", "c", "d"], completions=["xyz", "y", "z", "w"])  # 4 rows, up to 32 tokens
    assert rm.traces == 1
    again = rm(prompts=["a", "bb", "ccc"], completions=["x", "y", "z"])
    assert again == first and rm.traces == 1
    rm(prompts=["p" * 40], completions=["q"])  # the next length bucket
    assert rm.traces == 2


def test_bad_checkpoints_are_refused_with_what_was_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardModel.from_pretrained(tmp_path / "missing")

    config = transformers.LlamaConfig(**TINY, pad_token_id=PAD)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM'.*LlamaForSequenceClassification.*models.from_pretrained"):
        RewardModel.from_pretrained(tmp_path / "causal")

    two = transformers.LlamaConfig(**TINY, pad_token_id=PAD, num_labels=2)
    transformers.LlamaForSequenceClassification(two).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match=r"num_labels=1.*num_labels=2"):
        RewardModel.from_pretrained(tmp_path / "two", tokenizer=tiny_tokenizer())

    save(tmp_path / "no-tokenizer", tiny_classifier("llama"))
    with pytest.raises(FileNotFoundError, match="No tokenizer files.*tokenizer="):
        RewardModel.from_pretrained(tmp_path / "no-tokenizer")

    weights = tmp_path / "no-tokenizer" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["score.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor.*score.weight"):
        RewardModel.from_pretrained(tmp_path / "no-tokenizer", tokenizer=tiny_tokenizer())


def test_options_are_validated(chat_checkpoint):
    _, directory = chat_checkpoint
    with pytest.raises(ValueError, match="max_length.*exceeds.*max_position_embeddings"):
        RewardModel.from_pretrained(directory, max_length=1000)
    with pytest.raises(ValueError, match="batch_size"):
        RewardModel.from_pretrained(directory, batch_size=0)
    rm = RewardModel.from_pretrained(directory)
    with pytest.raises(ValueError, match="outside"):
        rm.score_ids([[5, TINY["vocab_size"]]])
    with pytest.raises(ValueError, match="no tokens"):
        rm.score_ids([[5], []])
