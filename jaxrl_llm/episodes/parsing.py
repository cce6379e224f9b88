"""Tool calls out of one assistant turn.

A turn is the text the model wrote before its end-of-turn token, decoded with special
tokens kept. :func:`parse_turn` splits it into TRL's conversational assistant message,

.. code-block:: python

    {"role": "assistant", "content": "...", "tool_calls": [{"type": "function", "function": {...}}]}

and the calls in order of appearance. Model output is data: a call that cannot be parsed
is a :class:`MalformedCall` (answered with an error, as a tool that raises is), never an
exception. Three formats (:data:`TOOL_CALL_FORMATS`):

- ``"hermes"``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
  number of them, anywhere in the turn (Qwen2.5, Qwen3, Hermes).
- ``"llama3"``: the whole turn is one JSON call ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>`` (Llama 3.1, 3.2).
- ``"response_template"``: the tokenizer's own declarative parser
  (``tokenizer.parse_response``, set through ``tokenizer.response_template``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

TOOL_CALL_FORMATS = ("hermes", "llama3", "response_template")
"""How tool calls are written in a turn; see the module docstring."""

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_NAME_IN_TEXT = re.compile(r'"name"\s*:\s*"([^"\\]+)"')


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict

    def __post_init__(self):
        if not isinstance(self.name, str) or not isinstance(self.arguments, dict):
            raise TypeError(
                f"ToolCall needs a str name and a dict of arguments; got {type(self.name).__name__} and "
                f"{type(self.arguments).__name__}."
            )

    def entry(self) -> dict:
        """TRL's ``tool_calls`` entry, ``{"type": "function", "function": {"name", "arguments"}}`` (a copy)."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A call the model tried to write but that does not parse: its ``text`` and why (``reason``)."""

    text: str
    reason: str

    @property
    def name(self) -> str:
        """The tool name the text shows (``"name": "..."``), or ``"unknown"``."""
        match = _NAME_IN_TEXT.search(self.text)
        return match.group(1) if match else "unknown"


class ParsedTurn(NamedTuple):
    """What :func:`parse_turn` returns."""

    message: dict  # {"role": "assistant", "content": str} (+ "tool_calls": [entries] if any call is well-formed)
    calls: tuple[ToolCall | MalformedCall, ...]  # every call, well-formed or not, in order of appearance


def detect_format(tokenizer: Any) -> str:
    """The tool-call format of ``tokenizer``: ``"response_template"`` when it has one,
    else read off its chat template (``<tool_call>``: hermes; ``<|python_tag|>`` or
    Llama 3's JSON calls: llama3).

    Raises:
      ValueError: neither says; ``tool_call_format=`` must name one of :data:`TOOL_CALL_FORMATS`.
    """
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates ({"default": ..., "tool_use": ...})
        template = "\n".join(str(t) for t in template.values())
    if isinstance(template, str):
        if _HERMES_OPEN in template:
            return "hermes"
        if _PYTHON_TAG in template or ("parameters" in template and "<|eot_id|>" in template):
            return "llama3"
        found = "its chat template shows neither <tool_call> blocks (hermes) nor Llama 3's JSON calls (llama3)"
    else:
        found = "it has no chat template"
    raise ValueError(
        f"Cannot tell how the model writes tool calls: the tokenizer has no `response_template` and {found}. "
        f"Set `tool_call_format=` to one of {TOOL_CALL_FORMATS}."
    )


def parse_turn(
    text: str,
    *,
    call_format: str,
    tokenizer: Any = None,
    prefix: str | Sequence[int] | None = None,
    tools: Sequence[Callable | dict] | None = None,
) -> ParsedTurn:
    """Splits one assistant turn into its message and its tool calls.

    Args:
      text: the turn, decoded with special tokens kept, without its end-of-turn token.
      call_format: how the model writes tool calls, one of :data:`TOOL_CALL_FORMATS` (:func:`detect_format` finds it).
      tokenizer: for ``"response_template"``: the tokenizer whose ``parse_response`` parses.
      prefix: for ``"response_template"``: the prompt before the turn (text or ids), which
        the parser needs when the chat template pre-writes part of the turn; ``None`` is "".
      tools: for ``"response_template"``: the tools, whose schemas cast arguments (``"7"``
        becomes ``7`` for an integer parameter).

    The content is the text without its well-formed calls, stripped; a malformed call's
    text stays in the content, so the message shows everything the model wrote. A call's
    ``arguments`` may be a JSON object or a string holding one; missing or null is ``{}``.

    Raises:
      ValueError: ``call_format`` is not one of :data:`TOOL_CALL_FORMATS`, or ``"response_template"``
        without a tokenizer that has one. Never on the model's text.
    """
    if call_format not in TOOL_CALL_FORMATS:
        raise ValueError(f"parse_turn: `call_format` must be one of {TOOL_CALL_FORMATS}; got {call_format!r}.")
    if call_format == "hermes":
        return _parse_hermes(text)
    if call_format == "llama3":
        return _parse_llama3(text)
    if getattr(tokenizer, "response_template", None) is None:
        raise ValueError(
            'parse_turn: call_format="response_template" needs `tokenizer=` with a `response_template` set; '
            f"got {type(tokenizer).__name__}{'' if tokenizer is None else ' without one'}."
        )
    return _parse_with_template(text, tokenizer, "" if prefix is None else prefix, tools)


def _message(content: str, calls: Sequence[ToolCall | MalformedCall], **extra: Any) -> ParsedTurn:
    message = {"role": "assistant", **extra, "content": content}
    if entries := [call.entry() for call in calls if isinstance(call, ToolCall)]:
        message["tool_calls"] = entries
    return ParsedTurn(message, tuple(calls))


def _call(value: Any, text: str, argument_keys: Sequence[str]) -> ToolCall | MalformedCall:
    """A call from a decoded JSON object ``{"name": str, <argument key>: dict | JSON str | null}``."""
    if not isinstance(value, dict):
        return MalformedCall(text, f"a tool call must be a JSON object; got a JSON {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(text, f'the call has no "name" (a non-empty string); got {name!r}')
    key = next((k for k in argument_keys if k in value), argument_keys[0])
    arguments = value.get(key)
    if arguments is None:
        return ToolCall(name, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _loads(arguments)
        except ValueError as error:
            return MalformedCall(text, f'"{key}" is a string that is not valid JSON ({error})')
    if not isinstance(arguments, dict):
        return MalformedCall(text, f'"{key}" must be a JSON object; got a JSON {type(arguments).__name__}')
    return ToolCall(name, arguments)


MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects in a call, its own object counted: deeper is malformed
(rendering it again, with the chat template or ``copy.deepcopy``, would recurse as deep)."""


def _loads(body: str) -> Any:
    """``json.loads(body)``, with every way model text can make it fail a ValueError: bad
    JSON, an integer of more digits than Python converts, nesting past the recursion limit
    or :data:`MAX_JSON_DEPTH`."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """How deeply ``value``'s lists and dicts nest (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:
            stack.extend((child, level + 1) for child in children)
    return deepest


def _decode(body: str, text: str, argument_keys: Sequence[str]) -> ToolCall | MalformedCall:
    try:
        value = _loads(body)
    except ValueError as error:  # json.JSONDecodeError among them
        return MalformedCall(text, f"the call is not valid JSON ({error})")
    return _call(value, text, argument_keys)


def _parse_hermes(text: str) -> ParsedTurn:
    calls, kept, end = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _decode(match.group(1).strip(), match.group(0), ("arguments", "parameters"))
        calls.append(call)
        kept.append(text[end : match.start()] if isinstance(call, ToolCall) else text[end : match.end()])
        end = match.end()
    rest = text[end:]
    if (start := rest.find(_HERMES_OPEN)) >= 0:
        calls.append(
            MalformedCall(
                rest[start:],
                f"{_HERMES_OPEN} is not closed by {_HERMES_CLOSE} (was the turn cut off at the length limit?)",
            )
        )
    kept.append(rest)
    return _message("".join(kept).strip(), calls)


def _parse_llama3(text: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].strip()
    if not tagged and not body.startswith("{"):
        return _message(body, [])
    call = _decode(body, text.strip(), ("parameters", "arguments"))
    if isinstance(call, MalformedCall) and tagged and not body.startswith("{"):
        call = MalformedCall(call.text, f"the text after {_PYTHON_TAG} is not a JSON call ({call.reason})")
    return _message("" if isinstance(call, ToolCall) else text.strip(), [call])


def _parse_with_template(text: str, tokenizer: Any, prefix: Any, tools: Any) -> ParsedTurn:
    try:
        parsed = tokenizer.parse_response(text, prefix=prefix, tools=list(tools) if tools else None)
        if not isinstance(parsed, dict):
            raise TypeError(f"parse_response returned {type(parsed).__name__}, not a message dict")
    except Exception as error:  # the template's parser rejects the turn: a bad call is data
        return _message(text, [MalformedCall(text, f"the response template cannot parse the turn: {error}")])
    entries = parsed.get("tool_calls") or []
    calls = [_template_call(entry) for entry in (entries if isinstance(entries, list) else [entries])]
    extra = {key: value for key, value in parsed.items() if key not in ("role", "content", "tool_calls")}
    content = parsed.get("content")
    return _message(content if isinstance(content, str) else "", calls, **extra)


def _template_call(entry: Any) -> ToolCall | MalformedCall:
    """A call from a parsed ``tool_calls`` entry (nested ``{"type", "function"}`` or flat)."""
    try:
        text = json.dumps(entry, default=repr)
    except (ValueError, RecursionError) as error:  # a huge integer, a nesting too deep
        return MalformedCall("<a tool call>", f"the call cannot be written as JSON ({type(error).__name__}: {error})")
    if _depth(entry) > MAX_JSON_DEPTH:
        return MalformedCall(text, f"the call is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(entry, dict) and "function" in entry:
        if entry.get("type", "function") != "function":
            return MalformedCall(text, f"unsupported tool call type {entry.get('type')!r} (only 'function')")
        entry = entry["function"]
    return _call(entry, text, ("arguments", "parameters"))
