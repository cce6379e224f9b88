"""Token ids of a conversation's pieces, by the tokenizer's chat template: the prompt with
its tools' schemas, and the template tokens around tool results between two turns.

An episode is built by concatenating ids, never by re-tokenizing text: the model's turns
are the ids it sampled, and between two of them come :func:`tool_suffix_ids`, the ids a
from-scratch rendering of the whole conversation puts there. This needs a template that
renders a conversation's prefix as the prefix of its rendering ("prefix-preserving", as
TRL calls it); :func:`tool_suffix_ids` checks it on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_llm.tasks.base import render_chat


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Callable] = ()) -> list[int]:
    """The ids of ``messages`` with ``tools``' schemas, ending with the template's start of
    an assistant turn (``add_generation_prompt=True``), as TRL renders a prompt."""
    return render_chat(tokenizer, messages, tools, generation_prompt=True)


def tool_suffix_ids(tokenizer: Any, tool_messages: Sequence[Mapping[str, Any]], *, end_of_turn: int) -> list[int]:
    """The ids that follow an assistant turn's ``end_of_turn`` id when ``tool_messages``
    answer its calls, up to the start of the next assistant turn: the tool messages in the
    template's format and its generation prompt.

    TRL's rule (``GRPOTrainer._get_tool_suffix_ids``): render a short conversation ending
    in an assistant tool call, with and without the tool messages (the latter with the
    generation prompt), cut the first after its last ``end_of_turn`` (templates that write
    a newline after it) and take what the second adds.

    Raises:
      ValueError: the template is not prefix-preserving (the shorter rendering is not a
        prefix of the longer): an episode could not continue its own ids.
    """
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = render_chat(tokenizer, head, generation_prompt=False)
    full = render_chat(tokenizer, head + [dict(m) for m in tool_messages], generation_prompt=True)
    ends = [i for i, token in enumerate(prefix) if token == end_of_turn]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError(
            "The chat template is not prefix-preserving: rendering a conversation with tool results does not begin "
            "with the rendering of the conversation before them (cut after its last end-of-turn token), so an "
            "episode cannot append tool results to its own ids. Use a template that renders each message "
            "independently of the later ones."
        )
    return full[len(prefix) :]
