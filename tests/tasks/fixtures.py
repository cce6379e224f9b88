"""Tokenizers built in-process for the task tests: nothing is downloaded.

* :func:`char_tokenizer` — the built-in character tokenizer (no chat template, BOS/EOS/pad);
* :func:`chat_tokenizer` — a byte-level BPE trained on a few sentences, wrapped like a
  chat model's tokenizer: a ChatML template (Qwen's, with its ``enable_thinking`` switch),
  ``<|im_end|>`` as EOS and ``<|endoftext|>`` as pad; optionally a BOS that encoding
  adds and the template writes too (as Llama 3's tokenizer does).
"""

from __future__ import annotations

import functools
import string

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxrl_llm.tasks.char_tokenizer import build_char_tokenizer

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen's ChatML template, cut to what the tests use (no tools)."""

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bos|>")

_SENTENCES = [
    "Solve 2 + 2. The answer is 4.",
    "What is 12 times 7? It is 84.",
    "You are a helpful assistant. Put the final answer in <answer></answer> tags.",
    "How many legs do 3 ducks and 2 cats have? <answer>14</answer>",
    "system user assistant <think> </think> question prompt answer",
    string.ascii_letters + string.digits + string.punctuation,
]


def char_tokenizer(
    alphabet: str = string.ascii_letters + string.digits + " +-*=().,?:\n{}",
) -> transformers.PreTrainedTokenizerFast:
    """The built-in character tokenizer over ``alphabet``: pad 0, BOS 1, EOS 2, unk 3; no chat template."""
    return build_char_tokenizer(alphabet)


@functools.cache
def _bpe_backend() -> str:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_SENTENCES * 4, trainer=trainer)
    return backend.to_str()


def chat_tokenizer(
    *, chat_template: str | None = CHATML, eos: bool = True, pad: bool = True, bos: bool = False
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a ChatML ``chat_template`` (``None``: none).

    ``eos=False`` leaves it without an EOS token, ``pad=False`` without a pad token.
    ``bos=True`` makes encoding with special tokens prepend ``<|bos|>``, and the template
    start with ``{{ bos_token }}``, so a prompt encoded with special tokens after the
    template would hold two.
    """
    backend = Tokenizer.from_str(_bpe_backend())
    if bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", backend.token_to_id("<|bos|>"))]
        )
        chat_template = None if chat_template is None else "{{- bos_token }}" + chat_template
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>" if bos else None,
        eos_token="<|im_end|>" if eos else None,
        pad_token="<|endoftext|>" if pad else None,
        additional_special_tokens=["<|im_start|>"] + ([] if eos else ["<|im_end|>"]),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
