"""Multi-turn rollouts against a scripted policy: the real decoder with weights that make it
a bigram model over a few whole-call tokens, so its episodes are known; plus small random
weights everywhere, so every logit depends on the whole context and the sampler's
log-probs can be checked against a teacher-forced pass over the finished episodes."""

import functools
import itertools
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models, sharding
from jaxrl_llm.episodes import conversation, parsing
from jaxrl_llm.episodes import sampling as episode_sampling
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.episodes.environments import Environments
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import build_char_tokenizer
from tests.episodes.test_parsing import HERMES_TEMPLATE

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import episodes as episodes_bench  # noqa: E402

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
BAD_CALL = '{"name": "add", "arguments": '  # unterminated JSON
TEMPLATE = episodes_bench.TEMPLATE  # a hermes-style template, one end-of-turn <eos> per message


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@functools.cache
def tokenizer():
    tok = build_char_tokenizer("0123456789+= ")
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>", CALL, BAD_CALL])
    tok.chat_template = TEMPLATE
    return tok


def scripted_model(
    transitions: dict[str, dict[str, float]],
    *,
    noise: float = 0.01,
    seed: int = 0,
    tok=None,
    end_of_turn="<eos>",
    **config_fields,
):
    """A decoder whose next-token logits are ``transitions[current][next]`` (0 for others;
    ``end_of_turn`` after any token not listed), plus small random weights:
    ``benchmarks/episodes.py``'s scripted policy with every token of the vocabulary in its script.
    ``config_fields``: other :class:`~jaxrl_llm.models.ModelConfig` fields (dtypes)."""
    tok = tok or tokenizer()
    vocab = len(tok)
    config = models.ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        **config_fields,
    )
    ids = tok.convert_tokens_to_ids
    return episodes_bench.scripted_policy(
        config,
        {ids(token): {ids(n): logit for n, logit in row.items()} for token, row in transitions.items()},
        tokens=range(vocab),
        default={ids(end_of_turn): 20.0},
        noise=noise,
        seed=seed,
    )


def chain(first: str, branch: dict[str, float]) -> dict[str, dict[str, float]]:
    """``<|assistant|>`` -> ``branch`` (logits); ``<tool_call>`` -> ``first`` -> ``</tool_call>`` -> ``<eos>``;
    a digit answer -> ``<eos>``."""
    return {"<|assistant|>": branch, "<tool_call>": {first: 20.0}, first: {"</tool_call>": 20.0}}


PROMPTS = [[{"role": "user", "content": "2+3="}], [{"role": "user", "content": "1+1="}]]


def run(model, params, *, group=3, budget=48, temperature=1.0, tools=(add,), seed=0, tok=None, **options):
    tok = tok or tokenizer()
    config = EpisodeConfig(
        **{k: options.pop(k) for k in ("max_turns", "tool_timeout", "tool_call_format") if k in options}
    )
    return episode_sampling.sample_episodes(
        model,
        params,
        tok,
        options.pop("prompts", PROMPTS),
        jax.random.key(seed),
        num_samples=group,
        eos_ids=(tok.convert_tokens_to_ids(options.pop("end_of_turn", tok.eos_token)),),
        pad_id=tok.pad_token_id,
        sampling_config=SamplingConfig(max_new_tokens=budget, temperature=temperature),
        tools=tools,
        config=config,
        **options,
    )


def teacher_forced_logprobs(model, params, episodes, group):
    """log pi of every completion token by one pass over prompt + completion."""
    prompts = np.repeat(episodes.prompt_tokens, group, axis=0)
    prompt_mask = np.repeat(episodes.prompt_mask, group, axis=0)
    width = episodes.completion_tokens.shape[1]
    tokens = np.concatenate([prompts, episodes.completion_tokens], axis=1)
    mask = np.concatenate([prompt_mask, np.arange(width)[None] < episodes.lengths[:, None]], axis=1)
    return np.asarray(models.completion_logprobs(model, params, jnp.asarray(tokens), jnp.asarray(mask), width))


def test_episodes_continue_the_cache_and_record_the_policy_log_probs():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    episodes = run(model, params, group=4, budget=64)
    turns = episodes.turns
    assert len(set(turns.tolist())) > 2, turns  # rows finish on different turns
    assert (episodes.tool_calls == turns - 1 - episodes.truncated).all()
    expected = teacher_forced_logprobs(model, params, episodes, 4)
    model_tokens = episodes.completion_mask
    np.testing.assert_allclose(episodes.logprobs[model_tokens], expected[model_tokens], atol=2e-4)
    assert (episodes.logprobs[~model_tokens] == 0).all()
    tok = tokenizer()
    for b in range(8):
        ids = episodes.completion_ids[b]
        assert len(ids) == episodes.lengths[b] <= 64
        text = tok.decode(ids, skip_special_tokens=False)
        messages = episodes.completions[b]
        roles = [m["role"] for m in messages]
        assert roles == ["assistant", "tool"] * episodes.tool_calls[b] + ["assistant"] * (len(roles) % 2), roles
        for message in messages:
            if message["role"] == "tool":
                assert message == {"role": "tool", "name": "add", "content": "5"}
                assert "<|tool|>5<eos><|assistant|>" in text
            else:
                assert message["tool_calls"] if message["content"] != "5" else "tool_calls" not in message
        # The loss mask is 1 on the model's turns only: the tool results and template ids are 0.
        model_text = tok.decode([i for i, m in zip(ids, model_tokens[b]) if m], skip_special_tokens=False)
        assert "<|tool|>" not in model_text and "<|assistant|>" not in model_text
    assert episodes.prompts[0] == PROMPTS[0] and episodes.prompts[4] == PROMPTS[1]


def counting(monkeypatch, name: str) -> list:
    """Replaces ``episode_sampling.<name>`` by a wrapper recording its calls; returns the record."""
    calls, fn = [], getattr(episode_sampling, name)
    monkeypatch.setattr(episode_sampling, name, lambda *args, **kwargs: calls.append(kwargs) or fn(*args, **kwargs))
    return calls


def test_long_turns_grow_and_compact_the_cache_without_changing_the_episodes(monkeypatch):
    # Turns of 10, 20, 30, ... digits, then a call or the end (a coin flip after every 0):
    # turns cross the 32-step decode segments, rows end turns and episodes at different
    # times, so the cache grows, leaves gaps and is compacted.
    digits = "1234567890"
    script = {a: {b: 20.0} for a, b in zip(digits[:-1], digits[1:])}
    script["0"] = {"1": 20.0, "<tool_call>": 19.5, "<eos>": 19.0}
    model, params = scripted_model({**chain(CALL, {"1": 20.0}), **script})
    grown, compacted = counting(monkeypatch, "_grow"), counting(monkeypatch, "_regather")
    segments = counting(monkeypatch, "_decode_segment")
    episodes = run(model, params, group=4, budget=160, max_turns=3, seed=3)
    assert episode_sampling._segment(160) == 32
    assert max(map(len, (m["content"] for c in episodes.completions for m in c))) > 32
    assert grown and compacted and len(segments) > max(episodes.turns)
    assert len(set(episodes.turns.tolist())) > 1 and len(set(episodes.lengths.tolist())) > 4
    expected = teacher_forced_logprobs(model, params, episodes, 4)
    mask = episodes.completion_mask
    np.testing.assert_allclose(episodes.logprobs[mask], expected[mask], atol=2e-4)

    # One decode call per turn, in a cache that never grows: the same episodes.
    monkeypatch.setattr(episode_sampling, "_segment", lambda completion_width: completion_width)
    whole = run(model, params, group=4, budget=160, max_turns=3, seed=3)
    assert whole.completion_ids == episodes.completion_ids
    np.testing.assert_array_equal(whole.completion_mask, episodes.completion_mask)
    np.testing.assert_allclose(whole.logprobs, episodes.logprobs, atol=1e-5)


def test_float32_weights_are_cast_once_for_a_bfloat16_model_and_the_episodes_do_not_change(monkeypatch):
    """Every jitted step of the rollout gets the projections in bfloat16, cast once for the
    rollout; the episodes are those of the stored float32 weights, which each step cast itself."""
    model, params = scripted_model(
        chain(CALL, {"<tool_call>": 20.0, "5": 20.0}), noise=0.1, param_dtype=jnp.float32, dtype=jnp.bfloat16
    )
    kernel_dtypes, decode_segment = set(), episode_sampling._decode_segment

    def spy(model, params, *args, **kwargs):
        kernel_dtypes.update(
            leaf.get_value().dtype for path, leaf in nnx.to_flat_state(params) if path[-1] == "up_proj"
        )
        return decode_segment(model, params, *args, **kwargs)

    monkeypatch.setattr(episode_sampling, "_decode_segment", spy)
    cast_once = run(model, params, group=4, budget=64)
    assert kernel_dtypes == {jnp.dtype(jnp.bfloat16)}

    monkeypatch.setattr(models, "in_compute_dtype", lambda model, params: params)  # each step casts
    kernel_dtypes.clear()
    cast_per_step = run(model, params, group=4, budget=64)
    assert kernel_dtypes == {jnp.dtype(jnp.float32)}
    assert len(set(cast_once.turns.tolist())) > 1  # rows finish on different turns
    assert cast_once.completion_ids == cast_per_step.completion_ids
    np.testing.assert_array_equal(cast_once.logprobs, cast_per_step.logprobs)  # to the bit


def test_a_rollout_mesh_splits_the_rows_and_gives_the_single_devices_episodes():
    """Eight prompts, two episodes each, over the 8-device ``data`` mesh: episodes end on
    different turns, so the batch shrinks below a row per device on one device; on the mesh it
    stays padded to the devices, its rows drawing what the single device's draw. The turns are
    runs of digits with a coin flip after every 0, so rows draw deep into their turns."""
    digits = "1234567890"
    script = {a: {b: 20.0} for a, b in zip(digits[:-1], digits[1:])}
    script["0"] = {"1": 20.0, "<tool_call>": 19.5, "<eos>": 19.0}
    model, params = scripted_model({**chain(CALL, {"1": 20.0}), **script})
    mesh = sharding.make_mesh(8)
    one = run(model, params, group=2, budget=160, max_turns=6, prompts=PROMPTS * 4, seed=2)
    split = run(model, params, group=2, budget=160, max_turns=6, prompts=PROMPTS * 4, seed=2, mesh=mesh)
    assert len(set(one.turns.tolist())) > 1 and len(set(one.lengths.tolist())) > 4
    assert split.completion_ids == one.completion_ids and split.completions == one.completions
    np.testing.assert_array_equal(split.completion_mask, one.completion_mask)
    np.testing.assert_allclose(split.logprobs, one.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="the 6 prompts must split evenly over the mesh's 8 'data' devices"):
        run(model, params, prompts=PROMPTS * 3, mesh=mesh)


LLAMA3_CALL = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
LLAMA3_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>"
    "{%- for c in m.tool_calls or [] -%}<|python_tag|>{{ {'name': c.function.name, 'parameters': c.function.arguments}"
    " | tojson }}{%- else -%}{{ m.content }}{%- endfor -%}<|eot_id|>"
    "{%- elif m.role == 'tool' -%}<|ipython|>{{ m.content }}<|eot_id|>"
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}<|eot_id|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""Llama 3.1's way with custom tools, shortened: a call is ``<|python_tag|>`` and one JSON
object with ``parameters``, a result an ``ipython`` message, every message ends ``<|eot_id|>``."""


def test_llama3_calls_through_a_rollout():
    tok = build_char_tokenizer("0123456789+= ")
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|ipython|>", "<|eot_id|>", "<|python_tag|>", LLAMA3_CALL])
    tok.chat_template = LLAMA3_TEMPLATE
    script = {"<|assistant|>": {"<|python_tag|>": 20.0, "5": 20.0}, "<|python_tag|>": {LLAMA3_CALL: 20.0}}
    model, params = scripted_model(script, tok=tok, end_of_turn="<|eot_id|>")
    episodes = run(model, params, group=4, budget=48, tok=tok, end_of_turn="<|eot_id|>")
    assert len(set(episodes.turns.tolist())) > 1 and episodes.tool_calls.sum() > 0
    assert not episodes.tool_failures.any()
    for b, messages in enumerate(episodes.completions):
        calls = [m for m in messages if m.get("tool_calls")]
        assert all(m["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
                   and m["content"] == "" for m in calls)  # fmt: skip
        assert [m for m in messages if m["role"] == "tool"] == [{"role": "tool", "name": "add", "content": "5"}] * len(
            calls
        ) or episodes.truncated[b]
        # Each result's ids are the template's: what a from-scratch rendering of the episode puts there.
        rendered = tok.apply_chat_template(episodes.prompts[b] + messages, tokenize=True, return_dict=False)
        prompt = tok.apply_chat_template(
            episodes.prompts[b], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        if not episodes.truncated[b]:
            assert prompt + episodes.completion_ids[b] == rendered
    expected = teacher_forced_logprobs(model, params, episodes, 4)
    mask = episodes.completion_mask
    np.testing.assert_allclose(episodes.logprobs[mask], expected[mask], atol=2e-4)


def response_template_tokenizer(*, thinking: bool):
    """The test tokenizer with a response template for its hermes-style turns; with
    ``thinking``, the generation prompt pre-writes ``<think>`` (as Qwen3's may), which the
    model closes with ``</think>`` before its answer or call."""
    tok = build_char_tokenizer("0123456789+= ")
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>", CALL, BAD_CALL])
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = (
        TEMPLATE.replace("<|assistant|>{%- endif -%}", "<|assistant|><think>{%- endif -%}") if thinking else TEMPLATE
    )
    # Qwen's parser, anchored at this template's turns, which end with <eos>.
    fields = {**HERMES_TEMPLATE["fields"], "content": {"close_pattern": r"\s*<eos>", "content": "text"}}
    tok.response_template = {**HERMES_TEMPLATE, "start_anchor": "<|assistant|>", "fields": fields}
    return tok


def test_a_response_template_parses_a_rollout_as_the_hermes_format_does():
    tok = response_template_tokenizer(thinking=False)
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}), tok=tok)
    parsed = run(model, params, group=4, budget=64, tok=tok)
    assert parsing.detect_format(tok) == "response_template"
    assert len(set(parsed.turns.tolist())) > 2 and parsed.tool_calls.sum() > 0
    hermes = run(model, params, group=4, budget=64, tok=tok, tool_call_format="hermes")
    assert parsed.completions == hermes.completions and parsed.completion_ids == hermes.completion_ids


def test_a_response_template_reads_what_the_generation_prompt_pre_writes():
    # Every turn begins inside a <think> the template wrote: the parser must see it (the
    # conversation before the turn is its prefix) to read "</think>5" as empty reasoning
    # and the answer 5.
    tok = response_template_tokenizer(thinking=True)
    script = {"<think>": {"</think>": 20.0}, **chain(CALL, {}), "</think>": {"<tool_call>": 20.0, "5": 20.0}}
    model, params = scripted_model(script, tok=tok)
    episodes = run(model, params, group=4, budget=64, tok=tok)
    assert episodes.tool_calls.sum() > 0 and not episodes.tool_failures.any()
    for messages in episodes.completions:
        for message in (m for m in messages if m["role"] == "assistant"):
            assert message.get("reasoning_content", "") == ""  # an empty region is left out
            assert message["content"] == ("" if message.get("tool_calls") else "5"), message


def test_max_turns_ends_episodes_with_calls_unanswered():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0}))
    episodes = run(model, params, group=2, temperature=0.0, max_turns=2, budget=100)
    assert episodes.turn_limited.all() and not episodes.truncated.any()
    np.testing.assert_array_equal(episodes.turns, 3)
    np.testing.assert_array_equal(episodes.tool_calls, 2)
    assert all(m["role"] == "assistant" and m["tool_calls"] for m in (c[-1] for c in episodes.completions))


def test_the_budget_ends_episodes_and_drops_results_that_do_not_fit():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0}))
    episodes = run(model, params, group=2, temperature=0.0, budget=20)
    assert episodes.truncated.all() and not episodes.turn_limited.any()
    assert (episodes.lengths <= 20).all()
    # Each round is 4 model tokens and 4 of tool result and template: the 3rd result does not fit.
    np.testing.assert_array_equal(episodes.tool_calls, 3)
    np.testing.assert_array_equal([len(c) for c in episodes.completions], 5)  # the dropped result's message too


def test_a_result_of_megabytes_is_dropped_untokenized(monkeypatch):
    def add(a: int, b: int) -> str:  # noqa: F811 (the tool's name is what the model calls)
        """Answers with ten megabytes.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return "5" * 10_000_000

    rendered = []
    suffix_ids = conversation.tool_suffix_ids
    monkeypatch.setattr(
        conversation,
        "tool_suffix_ids",
        lambda tok, messages, **kw: (
            rendered.append(sum(len(m["content"]) for m in messages)) or suffix_ids(tok, messages, **kw)
        ),
    )
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0}))
    episodes = run(model, params, group=2, temperature=0.0, tools=(add,), budget=40)
    assert rendered == [] and episodes.truncated.all()
    np.testing.assert_array_equal(episodes.tool_calls, 1)
    assert [[m["role"] for m in c] for c in episodes.completions] == [["assistant"]] * 4  # 2 prompts x 2


def test_tool_errors_malformed_calls_and_timeouts_are_results():
    release = threading.Event()

    def add(a: int, b: int) -> int:  # noqa: F811 (the tool's name is what the model calls)
        """Adds two integers, or hangs on 2 + 3.

        Args:
            a: The first integer.
            b: The second integer.
        """
        if (a, b) == (2, 3):
            release.wait(10)
        return a + b

    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0}))
    try:
        episodes = run(model, params, group=1, temperature=0.0, max_turns=1, tools=(add,), tool_timeout=0.3, budget=120)
    finally:
        release.set()
    np.testing.assert_array_equal(episodes.tool_timeouts, 1)
    np.testing.assert_array_equal(episodes.tool_failures, 1)
    assert "timed out" in episodes.completions[0][1]["content"]

    def raising(a: int, b: int) -> int:
        """Always fails.

        Args:
            a: The first integer.
            b: The second integer.
        """
        raise RuntimeError("no adding today")

    raising.__name__ = "add"
    episodes = run(model, params, group=1, temperature=0.0, max_turns=1, tools=(raising,), budget=120)
    assert episodes.completions[0][1]["content"] == str({"error": "no adding today"})
    np.testing.assert_array_equal(episodes.tool_failures, 1)

    model, params = scripted_model(chain(BAD_CALL, {"<tool_call>": 20.0}))
    episodes = run(model, params, group=1, temperature=0.0, max_turns=1, budget=200)
    np.testing.assert_array_equal(episodes.tool_failures, 1)
    np.testing.assert_array_equal(episodes.turns, 2)
    assert "could not be parsed" in episodes.completions[0][1]["content"]
    assert "tool_calls" not in episodes.completions[0][0]  # a malformed call is no call, but gets an error result


class AdderEnv:
    """A TRL-style environment: its ``add`` method is the tool, its state the reward."""

    def __init__(self):
        self.calls = 0

    resets = itertools.count()

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        # Differs between the group's rows, none a prefix of another: each row has an opening.
        return f" {next(AdderEnv.resets) % 100:02d}"

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def test_environments_with_their_own_openings():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    environments = Environments(AdderEnv)
    episodes = run(model, params, group=3, tools=(), environments=environments, columns={"answer": [5, 2]})
    assert len({tuple(p[-1]["content"]) for p in episodes.prompts}) > 2  # observations appended per row
    assert episodes.completion_mask[:, 0].sum() == 0  # each row's opening (its observation) starts its completion
    expected = teacher_forced_logprobs(model, params, episodes, 3)
    mask = episodes.completion_mask
    np.testing.assert_allclose(episodes.logprobs[mask], expected[mask], atol=2e-4)
    np.testing.assert_array_equal([e.calls for e in episodes.environments], episodes.tool_calls)
    (reward,) = environments.reward_functions()
    assert reward(prompts=None, completions=None, environments=episodes.environments) == list(
        map(float, episodes.tool_calls)
    )
    # The tokens that are not the model's: the opening, then each round's results with their template ids.
    tok = tokenizer()
    for b in range(len(episodes.lengths)):
        ids = episodes.completion_ids[b]
        opening = tok.decode(ids[: episodes.openings[b]])  # the end of the row's prompt, after the group's
        assert opening and (episodes.prompts[b][-1]["content"] + "<eos><|assistant|>").endswith(opening)
        results = sum(len(conversation.tool_suffix_ids(tok, [m], end_of_turn=tok.eos_token_id)) for m in
                      episodes.completions[b] if m["role"] == "tool")  # fmt: skip
        assert episodes.tool_tokens[b] == results, b


def test_an_episode_without_tool_calls_has_no_tool_tokens():
    model, params = scripted_model({"<|assistant|>": {"5": 20.0}})
    episodes = run(model, params, group=2, tools=(), environments=Environments(AdderEnv), columns={"answer": [5, 2]})
    np.testing.assert_array_equal(episodes.tool_calls, 0)
    np.testing.assert_array_equal(episodes.tool_tokens, 0)
    assert (episodes.openings > 0).all()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tool_call_format"):
        EpisodeConfig(tool_call_format="json")
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeConfig(max_turns=-1)
    model, params = scripted_model({})
    with pytest.raises(ValueError, match="max_prompt_length"):
        episode_sampling.sample_episodes(
            model,
            params,
            tokenizer(),
            [[{"role": "user", "content": "1" * 40}]],
            jax.random.key(0),
            num_samples=1,
            eos_ids=(2,),
            pad_id=0,
            sampling_config=SamplingConfig(max_prompt_length=16),
            tools=(add,),
        )
