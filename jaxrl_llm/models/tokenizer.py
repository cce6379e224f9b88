"""Character-level tokenizers for the built-in tasks, in the Hugging Face format.

The built-in tasks (e.g. arithmetic: ``"12+7="`` -> ``"19"``) need only a tiny vocabulary.
:func:`build_char_tokenizer` builds one with the ``tokenizers`` library and wraps it in a
``transformers`` fast tokenizer; :func:`save_tokenizer` writes it in the Hugging Face layout, so
:func:`load_tokenizer` (``transformers.AutoTokenizer``) reads ours and real models' tokenizers
through the same code path. Nothing is ever downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DIGITS_AND_OPERATORS = "0123456789+-*=() "
"""The alphabet of the arithmetic tasks: digits, ``+ - * =``, parentheses and the space."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Files of which a Hugging Face tokenizer directory holds at least one."""


def build_char_tokenizer(
    alphabet: str | Sequence[str],
    *,
    pad_token: str = "<pad>",
    bos_token: str = "<bos>",
    eos_token: str = "<eos>",
    unk_token: str = "<unk>",
) -> transformers.PreTrainedTokenizerFast:
    """Builds a tokenizer with one token per character of ``alphabet``.

    The ids are ``0..3`` for ``pad_token, bos_token, eos_token, unk_token``, then the alphabet in
    the given order (repeated characters keep their first id). A character outside the alphabet
    encodes to ``unk_token``; a special token's string in the text encodes to that token. For
    text over the alphabet, ``decode(encode(text)) == text``.

    Encoding never adds BOS or EOS: the caller decides where they go. Batches are padded on the
    left, as RL prompts are.

    Args:
        alphabet: The characters, as a string or a sequence of one-character strings.
        pad_token: The padding token (id 0).
        bos_token: The beginning-of-sequence token (id 1).
        eos_token: The end-of-sequence token (id 2).
        unk_token: The token of characters outside the alphabet (id 3).

    Raises:
        ValueError: If the alphabet is empty, holds an item that is not one character, or holds
            a special token; or if the special tokens are not distinct.
    """
    chars = list(dict.fromkeys(alphabet))
    specials = [pad_token, bos_token, eos_token, unk_token]
    if not chars:
        raise ValueError("The alphabet is empty: a tokenizer needs at least one character.")
    if bad := [c for c in chars if not isinstance(c, str) or len(c) != 1]:
        raise ValueError(f"Each item of the alphabet must be one character; got {bad!r}.")
    if len(set(specials)) != len(specials):
        raise ValueError(f"The special tokens must be distinct; got {specials!r}.")
    if clash := [c for c in chars if c in specials]:
        raise ValueError(f"The alphabet holds special token(s) {clash!r}.")

    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one piece per character
    backend.decoder = decoders.Fuse()  # join the characters without separators
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad_token,
        bos_token=bos_token,
        eos_token=eos_token,
        unk_token=unk_token,
        padding_side="left",
        clean_up_tokenization_spaces=False,  # would drop the space before "," "." "!" "?" ...
    )


def save_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, directory: str | os.PathLike) -> None:
    """Writes ``tokenizer``'s Hugging Face files (``tokenizer.json`` and its config) to ``directory``.

    Args:
        tokenizer: Any ``transformers`` tokenizer, e.g. one from :func:`build_char_tokenizer`.
        directory: Where to write; created if missing.
    """
    tokenizer.save_pretrained(directory)


def load_tokenizer(directory: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """Loads a tokenizer saved in the Hugging Face format, ours or a real model's, from disk only.

    Args:
        directory: A local directory holding the tokenizer files.

    Raises:
        FileNotFoundError: If ``directory`` does not exist or holds neither ``tokenizer.json``
            nor ``tokenizer_config.json``.
    """
    path = os.fspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No tokenizer directory at {path!r}.")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"No tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path!r}.")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
