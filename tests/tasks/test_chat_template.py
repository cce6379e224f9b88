"""Tests of the character tokenizer's tool-calling chat template (build_chat_tokenizer)."""

import jinja2
import pytest
import transformers

from jaxrl_llm.episodes.conversation import render_prompt, tool_suffix_ids
from jaxrl_llm.episodes.parsing import ToolCall, detect_format, parse_turn
from jaxrl_llm.models import load_tokenizer, save_tokenizer
from jaxrl_llm.tasks import build_char_tokenizer
from jaxrl_llm.tasks.calculator import CALCULATOR_ALPHABET
from jaxrl_llm.tasks.char_tokenizer import (
    CHAT_ROLE_TOKENS,
    CHAT_TEMPLATE_CHARACTERS,
    TOOL_CALL_TOKENS,
    build_chat_tokenizer,
)


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def neg(x: int) -> int:
    """Negates.

    Args:
        x: The number.
    """
    return -x


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


EPISODE = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "4821+937"},
    {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 4821, "b": 937})]},
    {"role": "tool", "name": "add", "content": "5758"},
    {"role": "assistant", "content": "5758"},
]
EPISODE_TEXT = (
    "<|tools|>add(a,b),neg(x)<eos>"
    "<|system|>be brief<eos>"
    "<|user|>4821+937<eos>"
    '<|assistant|><tool_call>{"name":"add","arguments":{"a":4821,"b":937}}</tool_call><eos>'
    "<|tool|>5758<eos>"
    "<|assistant|>5758<eos>"
)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(CALCULATOR_ALPHABET)


def render(tok, messages, tools=None, generation=False, tokenize=True):
    return tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, tokenize=tokenize, return_dict=False
    )


def test_ids_extend_the_char_tokenizer(tok):
    chars = build_char_tokenizer(CALCULATOR_ALPHABET)
    assert chars.chat_template is None  # the plain builder is unchanged
    base = len(chars)
    assert {t: i for t, i in tok.get_vocab().items() if i < base} == chars.get_vocab()
    markers = CHAT_ROLE_TOKENS + TOOL_CALL_TOKENS
    assert tok.convert_ids_to_tokens(list(range(base, len(tok)))) == list(markers)
    for i, marker in enumerate(markers):
        assert tok.encode(marker) == [base + i]  # one token each
    assert tok.encode("12+a") == chars.encode("12+a")


def test_markers_and_special_tokens(tok):
    ids = tok.encode('<|user|>1<eos><|assistant|><tool_call>{"name":"f"}</tool_call>')
    # Role markers and EOS are special; a tool call's tokens are ordinary text.
    assert tok.decode(ids, skip_special_tokens=True) == '1<tool_call>{"name":"f"}</tool_call>'
    assert tok.decode(ids) == '<|user|>1<eos><|assistant|><tool_call>{"name":"f"}</tool_call>'


def test_renders_every_role_and_the_tools(tok):
    assert render(tok, EPISODE, tools=[add, neg], tokenize=False) == EPISODE_TEXT
    # One <eos> per turn, the tool listing's included; each turn opens with one role marker.
    ids = render(tok, EPISODE, tools=[add, neg])
    assert ids.count(tok.eos_token_id) == len(EPISODE) + 1
    opens = [tok.convert_ids_to_tokens(i) for i in ids if tok.convert_ids_to_tokens(i) in CHAT_ROLE_TOKENS]
    assert opens == ["<|tools|>"] + [f"<|{m['role']}|>" for m in EPISODE]
    assert tok.unk_token_id not in ids


def test_tools_as_json_schemas_and_no_tools(tok):
    schema = transformers.utils.get_json_schema(add)
    messages = [{"role": "user", "content": "1+2"}]
    assert render(tok, messages, tools=[schema], tokenize=False) == "<|tools|>add(a,b)<eos><|user|>1+2<eos>"
    assert render(tok, messages, tools=[schema["function"]], tokenize=False).startswith("<|tools|>add(a,b)<eos>")
    assert render(tok, messages, tokenize=False) == "<|user|>1+2<eos>"


def test_generation_prompt_opens_an_assistant_turn(tok):
    messages = [{"role": "user", "content": "3+4"}]
    assert render(tok, messages, generation=True, tokenize=False) == "<|user|>3+4<eos><|assistant|>"
    assert render_prompt(tok, messages, [add])[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_call_json_is_compact_and_parses_back(tok):
    text = render(tok, EPISODE[1:3], tokenize=False)
    assert text.endswith('<tool_call>{"name":"add","arguments":{"a":4821,"b":937}}</tool_call><eos>')
    # The model's turn: the ids after the generation prompt, up to its end of turn.
    prompt = render(tok, EPISODE[1:2], generation=True)
    turn = render(tok, EPISODE[1:3])[len(prompt) : -1]
    parsed = parse_turn(tok.decode(turn), call_format="hermes")
    assert parsed.calls == (ToolCall("add", {"a": 4821, "b": 937}),)
    assert parsed.message == {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 4821, "b": 937})]}
    assert render(tok, [EPISODE[1], parsed.message]) == render(tok, EPISODE[1:3])  # the parsed turn renders back
    assert detect_format(tok) == "hermes"


def test_content_with_calls_string_arguments_and_text_parts(tok):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "9+9"}, {"type": "image"}]},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [call("add", '{"a":9,"b":9}'), {"name": "neg", "arguments": {"x": 1}}],
        },
        {"role": "tool", "content": [{"type": "text", "text": "18"}]},
    ]
    assert render(tok, messages, tokenize=False) == (
        "<|user|>9+9<eos><|assistant|>ok"
        '<tool_call>{"name":"add","arguments":{"a":9,"b":9}}</tool_call>'
        '<tool_call>{"name":"neg","arguments":{"x":1}}</tool_call><eos><|tool|>18<eos>'
    )
    parsed = parse_turn('ok<tool_call>{"name":"add","arguments":{"a":9,"b":9}}</tool_call>', call_format="hermes")
    assert parsed.message["content"] == "ok" and parsed.calls == (ToolCall("add", {"a": 9, "b": 9}),)


def test_unknown_role_raises(tok):
    with pytest.raises(jinja2.TemplateError, match=r"Unknown message role robot; allowed: 'system', 'user'"):
        render(tok, [{"role": "robot", "content": "1"}])


@pytest.mark.parametrize("tools", [None, [add, neg]])
def test_prefix_preserving(tok, tools):
    whole = render(tok, EPISODE, tools=tools)
    for k in range(1, len(EPISODE) + 1):  # transformers renders no empty conversation
        head = render(tok, EPISODE[:k], tools=tools)
        assert whole[: len(head)] == head, k
        if k < len(EPISODE) and EPISODE[k]["role"] == "assistant":
            prompt = render(tok, EPISODE[:k], tools=tools, generation=True)
            assert whole[: len(prompt)] == prompt and len(prompt) == len(head) + 1, k


def test_tool_suffix_ids_continue_an_episode(tok):
    eos = tok.eos_token_id
    suffix = tool_suffix_ids(tok, [EPISODE[3]], end_of_turn=eos)
    assert tok.decode(suffix) == "<|tool|>5758<eos><|assistant|>"
    # An episode built from ids, as a rollout builds it, is the whole conversation's rendering.
    prompt = render_prompt(tok, EPISODE[:2], [add, neg])
    whole = render(tok, EPISODE, tools=[add, neg])
    first = tok.encode('<tool_call>{"name":"add","arguments":{"a":4821,"b":937}}</tool_call>') + [eos]
    second = tok.encode("5758") + [eos]
    assert prompt + first + suffix + second == whole
    two = tool_suffix_ids(tok, [EPISODE[3], {"role": "tool", "name": "neg", "content": "-1"}], end_of_turn=eos)
    assert tok.decode(two) == "<|tool|>5758<eos><|tool|>-1<eos><|assistant|>"


def test_assistant_tokens_mask(tok):
    out = tok.apply_chat_template(
        EPISODE, tools=[add], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert learned == '<tool_call>{"name":"add","arguments":{"a":4821,"b":937}}</tool_call><eos>5758<eos>'


def test_save_and_load(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    for loaded in (
        transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True),
        load_tokenizer(tmp_path),
    ):
        assert loaded.chat_template == tok.chat_template
        assert loaded.get_vocab() == tok.get_vocab()
        assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (tok.eos_token_id, 0, "left")
        assert render(loaded, EPISODE, tools=[add, neg]) == render(tok, EPISODE, tools=[add, neg])
        ids = render(loaded, EPISODE)
        assert loaded.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
        assert detect_format(loaded) == "hermes"


def test_alphabet_must_hold_the_template_characters():
    with pytest.raises(ValueError, match=r"lacks '\{\}'.*tool calls need all of"):
        build_chat_tokenizer('0123456789abcdefghijklmnopqrstuvwxyz(),":')
    build_chat_tokenizer(CHAT_TEMPLATE_CHARACTERS)  # the minimum


def test_special_token_clashing_with_a_marker_raises():
    with pytest.raises(ValueError, match=r"\['<\|user\|>'\] are chat tokens"):
        build_chat_tokenizer(CALCULATOR_ALPHABET, eos_token="<|user|>")
