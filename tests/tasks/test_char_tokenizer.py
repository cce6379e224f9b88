"""Tests of the character-level tokenizer and its round trip through the Hugging Face format."""

import re

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.models import load_tokenizer, save_tokenizer
from jaxrl_llm.tasks import DIGITS_AND_OPERATORS, build_char_tokenizer

# Includes the characters around which ``clean_up_tokenization_spaces`` would drop spaces.
ALPHABET = DIGITS_AND_OPERATORS + "abc.,!?'\n"
STRINGS = ["12+7=", "19", "(3 - 4) * 5 = -5", " ", "", "a , b . c ! ?\n'"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def test_ids_are_specials_then_alphabet_in_order():
    tok = build_char_tokenizer("ba+a b")  # the repeated "a" keeps its first id
    expected = ["<pad>", "<bos>", "<eos>", "<unk>", "b", "a", "+", " "]
    assert tok.convert_ids_to_tokens(list(range(len(expected)))) == expected
    assert len(tok) == len(expected)
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert tok.encode("ab a+") == [5, 4, 7, 5, 6]  # no BOS or EOS added


def test_sequence_alphabet_and_custom_specials():
    tok = build_char_tokenizer(["x", "y"], pad_token="P", bos_token="B", eos_token="E", unk_token="U")
    assert tok.convert_ids_to_tokens(list(range(6))) == ["P", "B", "E", "U", "x", "y"]
    assert tok.encode("yxz") == [5, 4, 3]


@given(text=st.text(alphabet=ALPHABET))
def test_decode_inverts_encode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_unknown_characters_map_to_unk(tokenizer):
    unk, one = tokenizer.unk_token_id, tokenizer.convert_tokens_to_ids("1")
    assert tokenizer.encode("1x\t\t1é") == [one, unk, unk, unk, one, unk]


def test_save_and_load_through_auto_tokenizer(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for reloaded in (loaded, load_tokenizer(tmp_path)):
        for text in STRINGS:
            assert reloaded.encode(text) == tokenizer.encode(text)
            assert reloaded.decode(reloaded.encode(text)) == text
        assert len(reloaded) == len(tokenizer)
        assert reloaded.get_vocab() == tokenizer.get_vocab()
        assert (reloaded.pad_token_id, reloaded.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
        assert reloaded.padding_side == "left"


def test_batches_are_padded_on_the_left(tokenizer):
    prompts = ["1+1=", "12+7=", "3="]
    batch = tokenizer(prompts, padding=True)
    for ids, mask, prompt in zip(batch["input_ids"], batch["attention_mask"], prompts, strict=True):
        pads = 5 - len(prompt)
        assert ids == [tokenizer.pad_token_id] * pads + tokenizer.encode(prompt)
        assert mask == [0] * pads + [1] * len(prompt)


def test_load_missing_or_empty_directory_raises(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_tokenizer(tmp_path)


def test_empty_alphabet_raises():
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer([])


@pytest.mark.parametrize(
    ("alphabet", "options", "message"),
    [
        (["1", "23"], {}, "one character"),
        ("ab", {"unk_token": "a"}, "special token"),
        ("ab", {"eos_token": "<pad>"}, "distinct"),
    ],
)
def test_invalid_alphabet_or_specials_raise(alphabet, options, message):
    with pytest.raises(ValueError, match=message):
        build_char_tokenizer(alphabet, **options)
