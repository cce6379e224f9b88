"""Multi-turn rollouts against a scripted policy: the real decoder with weights that make it
a bigram model over a few whole-call tokens, so its episodes are known; plus small random
weights everywhere, so every logit depends on the whole context and the sampler's
log-probs can be checked against a teacher-forced pass over the finished episodes."""

import functools
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.episodes import rollout
from jaxrl_llm.episodes.environments import Environments
from jaxrl_llm.tasks import build_char_tokenizer

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


def scripted_model(transitions: dict[str, dict[str, float]], *, noise: float = 0.01, seed: int = 0):
    """A decoder whose next-token logits are ``transitions[current][next]`` (0 for others;
    the end-of-turn ``<eos>`` after any token not listed), plus small random weights:
    ``benchmarks/episodes.py``'s scripted policy with every token of the vocabulary in its script."""
    tok = tokenizer()
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
    )
    ids = tok.convert_tokens_to_ids
    return episodes_bench.scripted_policy(
        config,
        {ids(token): {ids(n): logit for n, logit in row.items()} for token, row in transitions.items()},
        tokens=range(vocab),
        default={tok.eos_token_id: 20.0},
        noise=noise,
        seed=seed,
    )


def chain(first: str, branch: dict[str, float]) -> dict[str, dict[str, float]]:
    """``<|assistant|>`` -> ``branch`` (logits); ``<tool_call>`` -> ``first`` -> ``</tool_call>`` -> ``<eos>``;
    a digit answer -> ``<eos>``."""
    return {"<|assistant|>": branch, "<tool_call>": {first: 20.0}, first: {"</tool_call>": 20.0}}


PROMPTS = [[{"role": "user", "content": "2+3="}], [{"role": "user", "content": "1+1="}]]


def run(model, params, *, group=3, budget=48, temperature=1.0, tools=(add,), seed=0, **options):
    config = rollout.EpisodeConfig(**{k: options.pop(k) for k in ("max_turns", "tool_timeout") if k in options})
    return rollout.sample_episodes(
        model,
        params,
        tokenizer(),
        options.pop("prompts", PROMPTS),
        jax.random.key(seed),
        num_samples=group,
        eos_ids=(tokenizer().eos_token_id,),
        pad_id=tokenizer().pad_token_id,
        sampling_config=rollout.sampling.SamplingConfig(max_new_tokens=budget, temperature=temperature),
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

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        return f" {np.random.default_rng().integers(0, 99)}"  # differs between the group's rows

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


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tool_call_format"):
        rollout.EpisodeConfig(tool_call_format="json")
    with pytest.raises(ValueError, match="max_turns"):
        rollout.EpisodeConfig(max_turns=-1)
    model, params = scripted_model({})
    with pytest.raises(ValueError, match="max_prompt_length"):
        rollout.sample_episodes(
            model,
            params,
            tokenizer(),
            [[{"role": "user", "content": "1" * 40}]],
            jax.random.key(0),
            num_samples=1,
            eos_ids=(2,),
            pad_id=0,
            sampling_config=rollout.sampling.SamplingConfig(max_prompt_length=16),
            tools=(add,),
        )
