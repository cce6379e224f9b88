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


CHAT_ROLE_TOKENS = ("<|tools|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
"""The special tokens that open a turn of :data:`CHAT_TEMPLATE`: the tool listing, then one per message role."""

TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>", '"name":', '"arguments":')
"""Single (not special) tokens for a Hermes tool call's delimiters and its two JSON keys: decoding with
``skip_special_tokens`` keeps them, and a call costs about 17 tokens less than spelled out."""

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
  {{- '<|tools|>' -}}
  {%- for tool in tools -%}
    {%- set f = tool.function if tool.function is defined else tool -%}
    {{- (',' if not loop.first else '') + f.name + '(' -}}
    {%- if f.parameters is defined and f.parameters.properties is defined -%}
      {{- f.parameters.properties | list | join(',') -}}
    {%- endif -%}
    {{- ')' -}}
  {%- endfor -%}
  {{- eos_token -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'assistant' -%}
    {{- '<|assistant|>' -}}
    {%- generation -%}
      {{- text(message.content) -}}
      {%- for call in message.tool_calls or [] -%}
        {%- set f = call.function if call.function is defined else call -%}
        {{- '<tool_call>{"name":' + f.name | tojson + ',"arguments":' -}}
        {%- if f.arguments is string -%}{{- f.arguments -}}
        {%- else -%}{{- (f.arguments or {}) | tojson(separators=(',', ':')) -}}
        {%- endif -%}
        {{- '}</tool_call>' -}}
      {%- endfor -%}
      {{- eos_token -}}
    {%- endgeneration -%}
  {%- elif message.role == 'user' -%}{{- '<|user|>' + text(message.content) + eos_token -}}
  {%- elif message.role == 'tool' -%}{{- '<|tool|>' + text(message.content) + eos_token -}}
  {%- elif message.role == 'system' -%}{{- '<|system|>' + text(message.content) + eos_token -}}
  {%- else -%}
    {{- raise_exception('Unknown message role ' + message.role | string + "; allowed: 'system', 'user', "
                        + "'assistant', 'tool'.") -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
"""
r"""The chat template of :func:`build_chat_tokenizer`: Hermes-style tool calls, every character a token, so
nothing that is not needed. A conversation with tools renders as (``<eos>`` the tokenizer's EOS)

.. code-block:: text

    <|tools|>add(a,b)<eos><|user|>1234+5678<eos>
    <|assistant|><tool_call>{"name":"add","arguments":{"a":1234,"b":5678}}</tool_call><eos>
    <|tool|>6912<eos><|assistant|>6912<eos>

(one line; broken here to be read). Each message is ``<|role|>`` + its content + ``<eos>``, whatever comes
after it, so the template is prefix-preserving; the assistant's ``<eos>`` is the end-of-turn token a
rollout stops at. ``tools`` (JSON schemas, or functions, which transformers turns into schemas) render
first, as one turn listing each tool's name and argument names, ``name(arg,arg),...``: the types and
descriptions would cost a token per character and a small model learns a tool's use from
demonstrations, not from its docstring. A tool call is compact JSON (no spaces), as
:func:`jaxrl_llm.episodes.parsing.parse_turn` (``call_format="hermes"``) reads it back; ``arguments`` given as
a JSON string are written as they are. Content may be a string or a list of ``{"type": "text", "text":
...}`` parts (other parts are dropped). The assistant's content, calls and ``<eos>`` are in a
``{% generation %}`` block, so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks them."""

CHAT_TEMPLATE_CHARACTERS = '(),{}":'
"""The characters :data:`CHAT_TEMPLATE` writes itself (the tool listing and a call's JSON): the alphabet of
:func:`build_chat_tokenizer` must hold them. The names and values in a conversation need their own."""


def build_chat_tokenizer(
    alphabet: str | Sequence[str],
    *,
    pad_token: str = "<pad>",
    bos_token: str = "<bos>",
    eos_token: str = "<eos>",
    unk_token: str = "<unk>",
) -> transformers.PreTrainedTokenizerFast:
    """:func:`build_char_tokenizer` with a tool-calling chat template (:data:`CHAT_TEMPLATE`).

    The ids of :func:`build_char_tokenizer` with the same arguments come first, unchanged; then
    :data:`CHAT_ROLE_TOKENS` (special tokens: ``decode(..., skip_special_tokens=True)`` drops them) and
    :data:`TOOL_CALL_TOKENS` (ordinary added tokens), in that order. Each turn ends with ``eos_token``.
    The template writes ``<tool_call>``, so :func:`jaxrl_llm.episodes.parsing.detect_format` reads the
    tokenizer as ``"hermes"``. Saved with ``save_pretrained``, it loads back (template included) with
    ``transformers.AutoTokenizer.from_pretrained``.

    Args:
        alphabet: The characters, as for :func:`build_char_tokenizer`; it must hold
            :data:`CHAT_TEMPLATE_CHARACTERS`.
        pad_token, bos_token, eos_token, unk_token: As for :func:`build_char_tokenizer`; none may be one
            of the chat tokens.

    Raises:
        ValueError: As :func:`build_char_tokenizer`; or if the alphabet lacks a character the template
            writes, or a special token is one of the chat tokens.
    """
    chars = set(alphabet)
    if missing := [c for c in CHAT_TEMPLATE_CHARACTERS if c not in chars]:
        raise ValueError(
            f"The alphabet lacks {''.join(missing)!r}, which the chat template writes (tool listings and the "
            f"JSON of tool calls need all of {CHAT_TEMPLATE_CHARACTERS!r})."
        )
    if clash := [t for t in (pad_token, bos_token, eos_token, unk_token) if t in CHAT_ROLE_TOKENS + TOOL_CALL_TOKENS]:
        raise ValueError(f"The special tokens {clash!r} are chat tokens the template needs; choose other strings.")
    tokenizer = build_char_tokenizer(
        alphabet, pad_token=pad_token, bos_token=bos_token, eos_token=eos_token, unk_token=unk_token
    )
    tokenizer.add_special_tokens({"extra_special_tokens": list(CHAT_ROLE_TOKENS)})
    tokenizer.add_tokens(list(TOOL_CALL_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
