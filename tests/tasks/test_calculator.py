"""Tests of the calculator task: conversational prompts with a tool, rewards on episodes, demonstrations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrl_llm import models, training
from jaxrl_llm.episodes.conversation import render_prompt, tool_suffix_ids
from jaxrl_llm.episodes.parsing import ToolCall, detect_format, parse_turn
from jaxrl_llm.episodes.tools import call_tools, check_tools
from jaxrl_llm.tasks import CalculatorTask, Task, check_task
from jaxrl_llm.tasks.base import draw
from jaxrl_llm.tasks.calculator import CALCULATOR_ALPHABET, add, sft_arrays
from jaxrl_llm.tasks.char_tokenizer import build_char_tokenizer, build_chat_tokenizer


@pytest.fixture(scope="module")
def task():
    return CalculatorTask()


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def call_text(a, b):
    """A call of ``add`` as the template writes it."""
    return f'<tool_call>{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'


def tool_episode(a, b, answer):
    """The completion messages of an episode that calls ``add`` and then answers ``answer``."""
    return [
        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": a, "b": b})]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": answer},
    ]


def test_is_a_task(task):
    check_task(task)
    assert isinstance(task, Task)
    assert task.eos_ids == (task.tokenizer.eos_token_id,) and task.pad_id == task.tokenizer.pad_token_id
    assert task.reward_weights == (1.0, 0.1) and len(task.reward_fns) == 2
    assert detect_format(task.tokenizer) == "hermes"
    assert set(CALCULATOR_ALPHABET) >= set('{}":,_') | set("abcdefghijklmnopqrstuvwxyz") | set("0123456789+")


def test_examples_are_conversations_rendered_with_the_tools(task):
    batch = task.examples("train", np.arange(8), seed=3)
    assert batch.tokens.shape == batch.mask.shape and batch.tokens.dtype == np.int32
    for row, prompt in enumerate(batch.prompts):
        (message,) = prompt
        a, b = (int(x) for x in message["content"].split("+"))
        assert message["role"] == "user" and batch.columns["answer"][row] == a + b
        assert batch.columns["hard"][row] == (max(a, b) >= 10)
        ids = render_prompt(task.tokenizer, prompt, task.tools)
        assert batch.tokens[row][batch.mask[row]].tolist() == ids
        assert not batch.mask[row, : batch.tokens.shape[1] - len(ids)].any()  # left-padded
        assert (batch.tokens[row][~batch.mask[row]] == task.pad_id).all()
        assert task.tokenizer.decode(ids) == f"<|tools|>add(a,b)<eos><|user|>{a}+{b}<eos><|assistant|>"
    np.testing.assert_array_equal(batch.indices, np.arange(8))


def test_splits_are_deterministic_by_seed(task):
    indices = np.arange(40)
    first, again = (task.examples("train", indices, seed=1) for _ in range(2))
    assert first.prompts == again.prompts
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert task.examples("train", indices, seed=2).prompts != first.prompts
    test = task.examples("test", indices, seed=1)
    assert test.prompts == task.examples("test", indices, seed=99).prompts  # the test split ignores the seed
    assert test.prompts != first.prompts
    assert task.examples("train", indices[5:9], seed=1).prompts == first.prompts[5:9]  # example i from (seed, i)
    assert task.split_size("train") is None and task.split_size("test") == 200
    assert len(draw(task, "test", seed=0, start=0, count=200)) == 200
    with pytest.raises(ValueError, match="Unknown split 'dev'"):
        task.examples("dev", indices, seed=0)
    with pytest.raises(IndexError, match=r"indices must be in \[0, 200\)"):
        task.examples("test", np.array([200]), seed=0)


def test_easy_and_hard_operands():
    columns = CalculatorTask(hard_digits=(3, 5)).examples("train", np.arange(2000), seed=0)
    sums = [tuple(int(x) for x in p[0]["content"].split("+")) for p in columns.prompts]
    hard = np.array(columns.columns["hard"])
    assert 0.45 < hard.mean() < 0.55
    easy_operands = {x for (a, b), h in zip(sums, hard, strict=True) if not h for x in (a, b)}
    assert easy_operands == set(range(10))
    hard_lengths = {len(str(x)) for (a, b), h in zip(sums, hard, strict=True) if h for x in (a, b)}
    assert hard_lengths == {3, 4, 5}
    assert not any(CalculatorTask(hard_fraction=0.0).examples("train", np.arange(50), seed=0).columns["hard"])
    assert all(CalculatorTask(hard_fraction=1.0).examples("train", np.arange(50), seed=0).columns["hard"])


def test_tool_schema_and_calls(task):
    assert check_tools(task.tools, where="tools") == (add,)
    schema = transformers.utils.get_json_schema(add)["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in schema["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}
    toolbox = {tool.__name__: tool for tool in task.tools}
    good, strings, boolean = call_tools(
        [
            (toolbox, ToolCall("add", {"a": 4821, "b": 937})),
            (toolbox, ToolCall("add", {"a": "12", "b": "34"})),  # would concatenate to "1234"
            (toolbox, ToolCall("add", {"a": True, "b": 1})),
        ],
        timeout=10,
    )
    assert (good.content, good.failed) == ("5758", False)
    assert strings.failed and "add takes two integers" in strings.content
    assert boolean.failed


def test_correct_reward(task):
    completions = [
        [{"role": "assistant", "content": "7"}],  # right, directly
        tool_episode(4821, 937, "5758"),  # right, through the tool
        tool_episode(4821, 937, "5759"),  # wrong
        tool_episode(4821, 937, " 5758 "),  # whitespace aside
        tool_episode(4821, 937, "05758"),  # not exactly the digits
        tool_episode(4821, 937, "")[:2],  # no answer after the tool result
        [{"role": "assistant", "content": "5758", "tool_calls": [call("add", {"a": 1, "b": 2})]}],  # still calling
        [],  # nothing
        [{"role": "assistant", "content": [{"type": "text", "text": "5758"}]}],  # text parts
        "5758",  # a single-turn completion
    ]
    answers = [7] + [5758] * 9
    assert task.correct(completions=completions, answer=answers, hard=[False] * 10) == [
        1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0,
    ]  # fmt: skip


def test_calls_reward(task):
    twice = tool_episode(1, 2, "")[:2] + tool_episode(1, 2, "3")
    completions = [[{"role": "assistant", "content": "3"}], tool_episode(1, 2, "3"), twice, "3"]
    assert task.calls(completions=completions, answer=[3] * 4) == [0.0, -1.0, -2.0, 0.0]
    weights = CalculatorTask(call_cost=0.25).reward_weights
    assert weights == (1.0, 0.25)


def test_demonstrations(task):
    demos = task.demonstrations(400, seed=0)
    assert demos == task.demonstrations(400, seed=0) and demos != task.demonstrations(400, seed=1)
    assert task.demonstrations(10, seed=0) == demos[:10]
    kinds = {len(d) for d in demos}
    assert kinds == {2, 4}
    lengths = {2: [], 4: []}
    for conversation in demos:
        a, b = (int(x) for x in conversation[0]["content"].split("+"))
        assert conversation[-1] == {"role": "assistant", "content": str(a + b)}
        if len(conversation) == 2:
            assert max(a, b) < 10  # easy sums are answered directly
        else:
            assert min(a, b) >= 100
            assert conversation[1]["tool_calls"] == [call("add", {"a": a, "b": b})]
            assert conversation[2] == {"role": "tool", "name": "add", "content": str(a + b)}
            completion = conversation[1:]
            assert task.correct(completions=[completion], answer=[a + b]) == [1.0]
        ids = task.tokenizer.apply_chat_template(conversation, tools=task.tools, return_dict=False)
        assert task.tokenizer.unk_token_id not in ids
        lengths[len(conversation)].append(len(ids))
    assert max(lengths[2]) <= 19 and max(lengths[4]) <= 68  # every character a token; well under 80
    with pytest.raises(ValueError, match="`count` must be an int >= 0"):
        task.demonstrations(-1, seed=0)


def test_sft_arrays_learn_the_assistant_tokens(task):
    demos = task.demonstrations(16, seed=0)
    tokens, attention_mask, completion_mask = sft_arrays(task.tokenizer, demos, tools=task.tools)
    count, width = tokens.shape
    n = completion_mask.shape[1]
    s = width - n
    assert tokens.dtype == np.int32 and attention_mask.shape == tokens.shape and completion_mask.shape == (count, n)
    tok = task.tokenizer
    for row, conversation in enumerate(demos):
        prompt = render_prompt(tok, conversation[:1], task.tools)
        assert tokens[row, s - len(prompt) : s].tolist() == prompt and not attention_mask[row, : s - len(prompt)].any()
        whole = tok.apply_chat_template(
            conversation, tools=task.tools, return_dict=True, return_assistant_tokens_mask=True
        )
        length = len(whole["input_ids"]) - len(prompt)
        assert tokens[row, s : s + length].tolist() == whole["input_ids"][len(prompt) :]
        assert attention_mask[row, s : s + length].all() and not attention_mask[row, s + length :].any()
        assert not completion_mask[row, length:].any()
        # The assistant's tokens: what transformers marks by the template's generation blocks.
        assert completion_mask[row, :length].tolist() == [bool(m) for m in whole["assistant_masks"][len(prompt) :]]
        learned = tok.decode(tokens[row, s:][completion_mask[row]])
        if len(conversation) == 4:
            arguments = conversation[1]["tool_calls"][0]["function"]["arguments"]
            assert (
                learned == call_text(arguments["a"], arguments["b"]) + "<eos>" + conversation[-1]["content"] + "<eos>"
            )
            unlearned = tokens[row, s : s + length][~completion_mask[row, :length]].tolist()
            assert unlearned == tool_suffix_ids(tok, [conversation[2]], end_of_turn=tok.eos_token_id)
        else:
            assert learned == conversation[-1]["content"] + "<eos>"


def test_sft_arrays_cut_after_the_end_of_turn():
    tok = build_chat_tokenizer(CALCULATOR_ALPHABET)
    tok.chat_template = tok.chat_template.replace(
        "{{- eos_token -}}\n    {%- endgeneration", "{{- eos_token + ' ' -}}\n    {%- endgeneration"
    )
    conversation = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    tokens, _, completion_mask = sft_arrays(tok, [conversation])
    n = completion_mask.shape[1]
    assert tok.decode(tokens[0, -n:]) == "3<eos> "  # the template writes a space after the end of turn
    assert completion_mask[0].tolist() == [True, True, False]  # which the model never writes


def test_sft_arrays_errors(task):
    tok = task.tokenizer
    with pytest.raises(ValueError, match="conversation 1 has no assistant message"):
        sft_arrays(tok, [task.demonstrations(1, seed=0)[0], [{"role": "user", "content": "1+2"}]])
    with pytest.raises(ValueError, match="conversation 0 opens with an assistant message"):
        sft_arrays(tok, [[{"role": "assistant", "content": "3"}]])
    with pytest.raises(ValueError, match="no conversations"):
        sft_arrays(tok, [])
    counting = build_chat_tokenizer(CALCULATOR_ALPHABET)
    counting.chat_template = "{{ messages | length }}" + counting.chat_template  # depends on the later messages
    with pytest.raises(ValueError, match="conversation 0: the chat template is not prefix-preserving"):
        sft_arrays(counting, task.demonstrations(1, seed=0))
    with pytest.raises(ValueError, match="no pad token"):
        sft_arrays(_without_pad(), task.demonstrations(1, seed=0))


def _without_pad():
    tok = build_chat_tokenizer(CALCULATOR_ALPHABET)
    tok.pad_token = None
    return tok


def test_an_episode_built_from_ids(task):
    """A rollout's steps, with the model's turns written out: ids, parsing, the tool, the suffix, rewards."""
    tok, eos = task.tokenizer, task.eos_ids[0]
    batch = task.examples("test", np.arange(50), seed=0)
    row = batch.columns["hard"].index(True)
    prompt, answer = batch.prompts[row], batch.columns["answer"][row]
    a, b = (int(x) for x in prompt[0]["content"].split("+"))
    ids = batch.tokens[row][batch.mask[row]].tolist()
    turn = tok.encode(call_text(a, b)) + [eos]
    parsed = parse_turn(tok.decode(turn[:-1]), call_format="hermes")
    (result,) = call_tools([({t.__name__: t for t in task.tools}, parsed.calls[0])], timeout=10)
    tool_message = {"role": "tool", "name": result.name, "content": result.content}
    ids += turn + tool_suffix_ids(tok, [tool_message], end_of_turn=eos)
    final = tok.encode(str(answer)) + [eos]
    ids += final
    completion = [parsed.message, tool_message, {"role": "assistant", "content": tok.decode(final[:-1])}]
    assert ids == tok.apply_chat_template(prompt + completion, tools=task.tools, return_dict=False)
    assert task.correct(completions=[completion], answer=[answer]) == [1.0]
    total = sum(
        w * fn(completions=[completion], answer=[answer])[0]
        for fn, w in zip(task.reward_fns, task.reward_weights, strict=True)
    )
    assert total == pytest.approx(0.9)


def test_sft_arrays_fit_supervised_finetune(task):
    tokens, attention_mask, completion_mask = sft_arrays(
        task.tokenizer, task.demonstrations(8, seed=0), tools=task.tools
    )
    config = models.ModelConfig(
        vocab_size=len(task.tokenizer), max_position_embeddings=tokens.shape[1], hidden_size=32,
        intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
    )  # fmt: skip
    model, shapes = models.abstract(config)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype), shapes)
    _, losses = training.supervised_finetune(
        model, params, tokens, attention_mask, completion_mask, steps=3, batch_size=8, learning_rate=1e-2
    )
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tokenizer": build_char_tokenizer(CALCULATOR_ALPHABET)}, "the tokenizer has no chat template"),
        ({"hard_fraction": 1.5}, r"`hard_fraction` must be a number in \[0, 1\]; got 1.5"),
        ({"hard_digits": (0, 3)}, r"`hard_digits` must be a pair \(fewest, most\)"),
        ({"hard_digits": (4, 3)}, r"`hard_digits` must be a pair"),
        ({"hard_digits": [3, 4]}, r"`hard_digits` must be a pair"),
        ({"hard_digits": (3, 19)}, r"1 <= fewest <= most <= 18"),
        ({"call_cost": 1.0}, r"`call_cost` must be a number in \[0, 1\)"),
        ({"call_cost": -0.1}, r"`call_cost` must be a number in \[0, 1\)"),
        ({"test_size": 0}, "`test_size` must be a positive int; got 0"),
        ({"stop_strings": "x"}, "`stop_strings` must be a tuple of strings"),
    ],
)
def test_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        CalculatorTask(**settings)


def test_demonstrations_can_call_the_tool_whatever_the_sum():
    task = CalculatorTask()

    def calls(conversations, hard):
        return [len(c) == 4 for c, h in zip(conversations, hard) if h]

    for fraction in (0.0, 1.0):
        conversations = task.demonstrations(64, seed=0, tool_fraction=fraction)
        assert all((len(c) == 4) == bool(fraction) for c in conversations)
    mixed = task.demonstrations(400, seed=0, tool_fraction=0.5)
    hard = [len(c[0]["content"]) > 4 for c in mixed]  # 3- and 4-digit operands
    assert 0.35 < np.mean(calls(mixed, hard)) < 0.65
    assert 0.35 < np.mean(calls(mixed, [not h for h in hard])) < 0.65  # easy sums too
    with pytest.raises(ValueError, match="tool_fraction"):
        task.demonstrations(4, seed=0, tool_fraction=1.5)
