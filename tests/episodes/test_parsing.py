"""Tool calls out of assistant turns: hermes (Qwen), llama3, and a tokenizer's response template."""

import types

import pytest

from jaxrl_llm.episodes.parsing import (
    MAX_JSON_DEPTH,
    TOOL_CALL_FORMATS,
    MalformedCall,
    ToolCall,
    detect_format,
    parse_turn,
)
from jaxrl_llm.tasks import build_char_tokenizer
from tests.episodes.test_tools import multiply  # TRL's documented tool


def entry(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Qwen2.5-Instruct's tool calls, as its chat template renders them and the model writes them.
QWEN_ONE = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
QWEN_TWO = (
    "I'll compute both.\n"
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "async_add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


class TestHermes:
    def test_one_call(self):
        turn = parse_turn(QWEN_ONE, call_format="hermes")
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)
        assert turn.message == {"role": "assistant", "content": "", "tool_calls": [entry("multiply", {"a": 3, "b": 4})]}

    def test_two_calls_with_content(self):
        turn = parse_turn(QWEN_TWO, call_format="hermes")
        assert [call.name for call in turn.calls] == ["multiply", "async_add"]
        assert turn.message["content"] == "I'll compute both."
        assert turn.message["tool_calls"] == [entry("multiply", {"a": 3, "b": 4}), entry("async_add", {"a": 1, "b": 2})]

    def test_content_on_both_sides(self):
        text = 'First. <tool_call>{"name": "f", "arguments": {}}</tool_call> Then more.'
        turn = parse_turn(text, call_format="hermes")
        assert turn.message["content"] == "First.  Then more."
        assert turn.calls == (ToolCall("f", {}),)

    def test_no_call_is_plain_content(self):
        turn = parse_turn("  The answer is 12.\n", call_format="hermes")
        assert turn == ({"role": "assistant", "content": "The answer is 12."}, ())

    def test_arguments_as_json_string(self):
        text = '<tool_call>\n{"name": "multiply", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>'
        assert parse_turn(text, call_format="hermes").calls == (ToolCall("multiply", {"a": 3, "b": 4}),)

    def test_missing_arguments_is_a_call_without_arguments(self):
        turn = parse_turn('<tool_call>{"name": "now"}</tool_call>', call_format="hermes")
        assert turn.calls == (ToolCall("now", {}),)

    def test_malformed_json(self):
        bad = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,}}\n</tool_call>'
        turn = parse_turn("Let me see. " + bad + "\n" + QWEN_ONE, call_format="hermes")
        malformed, good = turn.calls
        assert isinstance(malformed, MalformedCall) and "not valid JSON" in malformed.reason
        assert malformed.text == bad and malformed.name == "multiply"
        assert good == ToolCall("multiply", {"a": 3, "b": 4})
        # The well-formed call moves to tool_calls; the malformed one stays in the content, as written.
        assert turn.message["content"] == "Let me see. " + bad
        assert turn.message["tool_calls"] == [good.entry()]

    def test_missing_name(self):
        (call,) = parse_turn('<tool_call>{"arguments": {"a": 1}}</tool_call>', call_format="hermes").calls
        assert isinstance(call, MalformedCall) and '"name"' in call.reason and call.name == "unknown"

    def test_arguments_not_an_object(self):
        (call,) = parse_turn('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', call_format="hermes").calls
        assert isinstance(call, MalformedCall) and "must be a JSON object" in call.reason

    def test_arguments_string_not_json(self):
        (call,) = parse_turn('<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', call_format="hermes").calls
        assert isinstance(call, MalformedCall) and "not valid JSON" in call.reason

    def test_unterminated_block(self):
        text = QWEN_ONE + '\n<tool_call>\n{"name": "multiply", "argu'
        turn = parse_turn(text, call_format="hermes")
        good, cut = turn.calls
        assert good == ToolCall("multiply", {"a": 3, "b": 4})
        assert isinstance(cut, MalformedCall) and "not closed" in cut.reason
        assert cut.text == '<tool_call>\n{"name": "multiply", "argu'
        assert turn.message["tool_calls"] == [good.entry()]

    def test_entry_is_a_copy(self):
        call = ToolCall("f", {"a": 1})
        call.entry()["function"]["arguments"]["a"] = 2
        assert call.arguments == {"a": 1}


class TestLlama3:
    def test_json_call(self):
        turn = parse_turn('{"name": "multiply", "parameters": {"a": 3, "b": 4}}', call_format="llama3")
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)
        assert turn.message == {"role": "assistant", "content": "", "tool_calls": [entry("multiply", {"a": 3, "b": 4})]}

    def test_python_tag(self):
        turn = parse_turn('<|python_tag|>{"name": "multiply", "arguments": {"a": 3, "b": 4}}', call_format="llama3")
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)

    def test_plain_content(self):
        assert parse_turn("The product is 12.", call_format="llama3") == (
            {"role": "assistant", "content": "The product is 12."},
            (),
        )

    def test_malformed(self):
        text = '{"name": "multiply", "parameters": {"a": 3'
        turn = parse_turn(text, call_format="llama3")
        (call,) = turn.calls
        assert isinstance(call, MalformedCall) and "not valid JSON" in call.reason and call.name == "multiply"
        assert turn.message == {"role": "assistant", "content": text}

    def test_json_without_name(self):
        (call,) = parse_turn('{"answer": 12}', call_format="llama3").calls
        assert isinstance(call, MalformedCall) and '"name"' in call.reason

    def test_python_tag_with_code(self):
        (call,) = parse_turn('<|python_tag|>brave_search.call(query="x")', call_format="llama3").calls
        assert isinstance(call, MalformedCall) and "<|python_tag|>" in call.reason


# A response template for hermes-style turns (the format of transformers' chat_parsing).
HERMES_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


@pytest.fixture
def template_tokenizer():
    tokenizer = build_char_tokenizer("abc")
    tokenizer.response_template = HERMES_TEMPLATE
    return tokenizer


class TestResponseTemplate:
    def test_calls_and_content(self, template_tokenizer):
        turn = parse_turn(QWEN_TWO, call_format="response_template", tokenizer=template_tokenizer)
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("async_add", {"a": 1, "b": 2}))
        assert turn.message == {
            "role": "assistant",
            "content": "I'll compute both.",
            "tool_calls": [entry("multiply", {"a": 3, "b": 4}), entry("async_add", {"a": 1, "b": 2})],
        }

    def test_tools_cast_arguments(self, template_tokenizer):
        text = '<tool_call>{"name": "multiply", "arguments": {"a": "3", "b": 4}}</tool_call>'
        turn = parse_turn(text, call_format="response_template", tokenizer=template_tokenizer)
        assert turn.calls == (ToolCall("multiply", {"a": "3", "b": 4}),)
        turn = parse_turn(text, call_format="response_template", tokenizer=template_tokenizer, tools=[multiply])
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)
        assert turn.message["content"] == ""  # the parser gives no content; the message always has one

    def test_prefix_opens_reasoning(self, template_tokenizer):
        # The chat template pre-wrote "<think>": only with the prefix does the parser see the reasoning.
        prefix = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        text = "hmm</think>" + QWEN_ONE
        turn = parse_turn(text, call_format="response_template", tokenizer=template_tokenizer, prefix=prefix)
        assert turn.message["reasoning_content"] == "hmm"
        assert turn.calls == (ToolCall("multiply", {"a": 3, "b": 4}),)

    def test_parser_failure_is_one_malformed_call(self, template_tokenizer):
        text = 'Sure. <tool_call>{"name": "multiply", "arguments": {"a": 3,}}</tool_call>'
        turn = parse_turn(text, call_format="response_template", tokenizer=template_tokenizer)
        assert turn.message == {"role": "assistant", "content": text}
        (call,) = turn.calls
        assert isinstance(call, MalformedCall) and call.text == text and "response template" in call.reason

    def test_bad_entries(self):
        parsed = {
            "role": "assistant",
            "tool_calls": [entry("ok", {}), {"type": "code", "function": {"name": "x"}}, entry(None, {})],
        }
        tokenizer = types.SimpleNamespace(response_template={}, parse_response=lambda text, **_: parsed)
        turn = parse_turn("...", call_format="response_template", tokenizer=tokenizer)
        ok, other_type, no_name = turn.calls
        assert ok == ToolCall("ok", {}) and turn.message["tool_calls"] == [entry("ok", {})]
        assert "unsupported tool call type" in other_type.reason and '"name"' in no_name.reason

    def test_needs_a_tokenizer_with_a_template(self):
        with pytest.raises(ValueError, match="response_template"):
            parse_turn("x", call_format="response_template")
        with pytest.raises(ValueError, match="without one"):
            parse_turn("x", call_format="response_template", tokenizer=build_char_tokenizer("abc"))


def nested(levels):
    value = 0
    for _ in range(levels):
        value = {"x": value}
    return value


HOSTILE_BODIES = {
    "a thousand open brackets": '{"name": "f", "arguments": ' + "[" * 1000,
    "brackets nested past the depth limit": '{"name": "f", "arguments": {"x": ' + "[" * 65 + "]" * 65 + "}}",
    "an integer of 5000 digits": '{"name": "f", "arguments": {"x": ' + "7" * 5000 + "}}",
    "arguments as a string of deep JSON": '{"name": "f", "arguments": "' + "[" * 2000 + '"}',
}


class TestHostileText:
    """Model output is untrusted: whatever it writes is a malformed call, never an exception."""

    @pytest.mark.parametrize("body", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
    @pytest.mark.parametrize("call_format", ["hermes", "llama3"])
    def test_is_a_malformed_call(self, body, call_format):
        text = f"<tool_call>{body}</tool_call>" if call_format == "hermes" else body
        (call,) = parse_turn(text, call_format=call_format).calls
        assert isinstance(call, MalformedCall), call

    def test_an_unclosed_block_of_brackets(self):
        (call,) = parse_turn("<tool_call>" + "[" * 1000, call_format="hermes").calls
        assert isinstance(call, MalformedCall)

    def test_nesting_at_the_limit_parses(self):
        def call(lists):  # the call's object, its arguments and ``lists`` lists: lists + 2 levels
            body = '{"name": "f", "arguments": {"x": ' + "[" * lists + "]" * lists + "}}"
            return parse_turn(f"<tool_call>{body}</tool_call>", call_format="hermes").calls[0]

        assert isinstance(call(MAX_JSON_DEPTH - 2), ToolCall)
        assert isinstance(call(MAX_JSON_DEPTH - 1), MalformedCall)

    @pytest.mark.parametrize("arguments", [{"x": 10**5000}, nested(70)], ids=["huge integer", "70 levels"])
    def test_template_entries(self, arguments):
        parsed = {"role": "assistant", "tool_calls": [entry("f", arguments)]}
        tokenizer = types.SimpleNamespace(response_template={}, parse_response=lambda text, **_: parsed)
        (call,) = parse_turn("...", call_format="response_template", tokenizer=tokenizer).calls
        assert isinstance(call, MalformedCall), call


def test_bad_format():
    assert TOOL_CALL_FORMATS == ("hermes", "llama3", "response_template")
    with pytest.raises(ValueError, match="hermes.*llama3.*response_template"):
        parse_turn("x", call_format="qwen")


class TestDetectFormat:
    def test_response_template_first(self, template_tokenizer):
        template_tokenizer.chat_template = "{{ '<tool_call>' }}"
        assert detect_format(template_tokenizer) == "response_template"

    @pytest.mark.parametrize(
        ("chat_template", "expected"),
        [
            ("{%- if tools %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>{% endif %}", "hermes"),
            ("{{- '<|python_tag|>' + tool_call.name }}<|eom_id|>", "llama3"),
            ('{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}<|eot_id|>', "llama3"),
            ({"default": "plain", "tool_use": "<tool_call>"}, "hermes"),
        ],
    )
    def test_from_chat_template(self, chat_template, expected):
        tokenizer = build_char_tokenizer("abc")
        tokenizer.chat_template = chat_template
        assert detect_format(tokenizer) == expected

    def test_unknown(self):
        tokenizer = build_char_tokenizer("abc")
        with pytest.raises(ValueError, match="no chat template.*tool_call_format="):
            detect_format(tokenizer)
        tokenizer.chat_template = "{{ messages[0].content }}<|eot_id|>"
        with pytest.raises(ValueError, match=r"neither.*\('hermes', 'llama3', 'response_template'\)"):
            detect_format(tokenizer)
