"""Character-level tokenizers for the built-in tasks, in the Hugging Face format.

The built-in tasks (e.g. the digit sums: ``"3+4="`` -> ``"7"``) need only a tiny vocabulary.
:func:`build_char_tokenizer` builds one with the ``tokenizers`` library and wraps it in a
``transformers`` fast tokenizer, so it saves and loads like a real model's
(:func:`jaxrl_llm.models.save_tokenizer`). Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DIGITS_AND_OPERATORS = "0123456789+-*=() "
"""The alphabet of the arithmetic tasks: digits, ``+ - * =``, parentheses and the space."""


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
