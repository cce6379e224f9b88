"""Hugging Face tokenizers saved and loaded from disk, never downloaded."""

from __future__ import annotations

import os

import transformers

from jaxrl_llm.models import gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Files of which a Hugging Face tokenizer directory holds at least one."""


def save_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, directory: str | os.PathLike) -> None:
    """Writes ``tokenizer``'s Hugging Face files (``tokenizer.json`` and its config) to ``directory``.

    Args:
        tokenizer: Any ``transformers`` tokenizer, e.g. one from :func:`jaxrl_llm.tasks.build_char_tokenizer`.
        directory: Where to write; created if missing.
    """
    tokenizer.save_pretrained(directory)


def load_tokenizer(directory: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """Loads a tokenizer saved in the Hugging Face format, ours or a real model's, or the one
    a GGUF file describes (:func:`jaxrl_llm.models.gguf.load_tokenizer`), from disk only.

    Args:
        directory: A local directory holding the tokenizer files; or a ``.gguf`` file, or a
            directory holding one and no ``config.json``.

    Raises:
        FileNotFoundError: If ``directory`` does not exist or holds neither ``tokenizer.json``
            nor ``tokenizer_config.json`` nor a GGUF file.
        ValueError: A GGUF file without a tokenizer, or several GGUF files in ``directory``.
    """
    if (file := gguf.find_file(directory)) is not None:
        return gguf.load_tokenizer(file)
    path = os.fspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No tokenizer directory at {path!r}.")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"No tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path!r}.")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
