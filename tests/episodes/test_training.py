"""Training on episodes through training.train: tools and environments as TRL takes them,
every preset, the loss over the model's tokens only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, objectives, rollouts, sharding, tasks, training
from jaxrl_llm.episodes import sampling as episode_sampling
from jaxrl_llm.episodes import scoring
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks.base import PromptBatch, check_split
from tests.episodes.test_sampling import CALL, AdderEnv, add, chain, run, scripted_model, tokenizer


def answered(completions, **kwargs) -> list[float]:
    """1 when the episode's last message answers 5 (TRL's conversational completions)."""
    return [float(c[-1]["role"] == "assistant" and c[-1]["content"] == "5") for c in completions]


@dataclasses.dataclass(frozen=True)
class AddTask:
    """Conversational prompts over the scripted tokenizer; rewarded for answering 5."""

    stop_strings: tuple = ()
    reward_weights: tuple = (1.0,)

    @property
    def tokenizer(self):
        return tokenizer()

    @property
    def eos_ids(self):
        return (tokenizer().eos_token_id,)

    @property
    def pad_id(self):
        return tokenizer().pad_token_id

    @property
    def reward_fns(self):
        return (answered,)

    def split_size(self, split):
        check_split(split)
        return None if split == "train" else 4

    def examples(self, split, indices, *, seed):
        prompts = [[{"role": "user", "content": f"{i % 5}+{5 - i % 5}="}] for i in indices]
        tokens = np.ones((len(indices), 1), np.int32)  # unused: episodes render the prompts themselves
        return PromptBatch(
            tokens=tokens,
            mask=np.ones_like(tokens, bool),
            prompts=prompts,
            columns={"answer": [5] * len(indices)},
            indices=np.asarray(indices),
        )


CONFIG = training.TrainConfig(
    num_prompts=2,
    group_size=4,
    sampling=SamplingConfig(max_new_tokens=32),
    optimizer=training.OptimizerConfig(learning_rate=1e-3, warmup_steps=1),
)


def test_every_preset_trains_on_episodes():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    for name in algorithms.PRESETS:
        algorithm = algorithms.get(name)
        _, history = training.train(model, params, algorithm, CONFIG, steps=1, task=AddTask(), tools=[add])
        (metrics,) = history
        assert np.isfinite(metrics["loss"]), name
        assert metrics["skipped_updates"] == 0, name
        assert 1 < metrics["episodes/turns"] and metrics["tools/call_frequency"] > 0, (name, metrics)
        assert metrics["tools/failure_frequency"] == 0 and metrics["episodes/tool_tokens"] > 0, name


def test_episodes_on_a_rollout_mesh_are_the_single_devices(monkeypatch):
    """Eight prompts over the 8-device ``data`` mesh, two episodes each: the rows are split
    over the devices for every turn, finished rows dropped as on one device (the batch padded
    to the devices), and the run collects the episodes and rewards one device does. A held-out
    batch that does not split over the devices is evaluated on one."""
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    config = dataclasses.replace(
        CONFIG, num_prompts=8, group_size=2, eval_every=2, sampling=SamplingConfig(max_new_tokens=64)
    )  # evaluated on the 4 held-out prompts, which do not split over the 8 devices: on one
    mesh = sharding.make_mesh(8)

    def run_on(rollout_mesh):
        ends = []
        state, history = training.train(model, params, algorithms.get("grpo"), config, steps=2, task=AddTask(),
                                        tools=[add], rollout_mesh=rollout_mesh, callback=ends.append)  # fmt: skip
        return state, history, [end.collected.first_round for end in ends]

    one_state, one_history, one_rounds = run_on(None)
    batches, decode_segment = [], episode_sampling._decode_segment

    def spy(model, params, logits, *args, **kwargs):
        devices = len(logits.sharding.device_set)
        split = logits.sharding.is_equivalent_to(sharding.rows(mesh), 2)
        batches.append((logits.shape[0], kwargs["draw_rows"], devices, split))
        return decode_segment(model, params, logits, *args, **kwargs)

    monkeypatch.setattr(episode_sampling, "_decode_segment", spy)
    state, history, rounds = run_on(mesh)
    assert all(split if devices == 8 else devices == 1 for *_, devices, split in batches), batches
    assert any(devices == 1 for *_, devices, _ in batches)  # the evaluations
    split_batches = [(rows, draw_rows) for rows, draw_rows, devices, _ in batches if devices == 8]
    # Finished rows dropped: to 8 rows (one a device) at least, drawing for fewer as one device does.
    assert {rows for rows, _ in split_batches} == {16, 8} and min(draw_rows for _, draw_rows in split_batches) < 4
    for got, expected in zip(rounds, one_rounds, strict=True):
        assert got.messages == expected.messages and got.completions == expected.completions
        np.testing.assert_array_equal(got.rollouts.completion_tokens, expected.rollouts.completion_tokens)
        np.testing.assert_array_equal(got.rollouts.rewards, expected.rollouts.rewards)
        np.testing.assert_allclose(got.rollouts.logprobs, expected.rollouts.logprobs, atol=1e-5)
    for got, expected in zip(history, one_history, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        for name in ("reward", "episodes/turns", "tools/call_frequency", "eval_greedy_accuracy", "eval_greedy_turns"):
            assert got.get(name) == expected.get(name), name
    assert 1 < history[-1]["episodes/turns"] < 3  # some episodes called the tool, some did not
    assert "eval_greedy_accuracy" in history[1] and "eval_greedy_turns" in history[1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), state.params, one_state.params)


def test_environments_rewards_and_metrics():
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    _, history = training.train(
        model, params, algorithms.get("grpo"), CONFIG, steps=2, task=AddTask(), environment_factory=AdderEnv
    )
    for metrics in history:
        # get_reward (calls made) is a reward function logged under the class name, weight 1.
        assert metrics["reward_AdderEnv"] == pytest.approx(metrics["tools/call_frequency"])
        assert metrics["reward"] == pytest.approx(metrics["reward_answered"] + metrics["reward_AdderEnv"], abs=1e-5)


def test_an_environment_that_owns_the_data_needs_no_task_and_scores_alone(monkeypatch):
    # TRL: GRPOTrainer(model, environment_factory=Env, processing_class=tokenizer) without a
    # train_dataset or reward_funcs: reset() gives each episode's prompt, get_reward its reward.
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    config = dataclasses.replace(CONFIG, eval_every=0)
    ends = []
    _, history = training.train(
        model, params, algorithms.get("grpo"), config, steps=1, environment_factory=AdderEnv, tokenizer=tokenizer(),
        callback=ends.append,
    )  # fmt: skip
    (metrics,) = history
    assert metrics["reward"] == pytest.approx(metrics["reward_AdderEnv"]) and metrics["tools/call_frequency"] > 0
    first = ends[0].collected.first_round
    assert all(p == [{"role": "user", "content": ""}] for p in first.prompts)  # TRL's placeholder...
    assert all(p[-1]["content"].strip().isdigit() for p in first.row_prompts)  # ...that reset() fills
    with pytest.raises(ValueError, match="without a `task`, the environment gives the prompts, and `tokenizer=`"):
        training.train(model, params, algorithms.get("grpo"), config, steps=1, environment_factory=AdderEnv)

    # A dataset of only an `environment` column routes examples to a dict of environments;
    # without environments the same dataset is refused (no prompt column), before any compute.
    routes = tasks.from_records([{"environment": "adder"}] * 4, tokenizer=tokenizer(), reward_fns=())
    _, history = training.train(
        model, params, algorithms.get("grpo"), config, steps=1, task=routes, environment_factory={"adder": AdderEnv}
    )
    assert history[0]["reward"] == pytest.approx(history[0]["reward_AdderEnv"])
    monkeypatch.setattr(training.loop, "_compile", lambda *a, **k: pytest.fail("compiled before the checks"))
    with_answers = tasks.from_records([{"environment": "adder"}] * 4, tokenizer=tokenizer(), reward_fns=[answered])
    with pytest.raises(ValueError, match="no prompt column 'prompt'.*only an environment_factory gives prompts"):
        training.train(model, params, algorithms.get("grpo"), config, steps=1, task=with_answers, tools=[add])

    with pytest.raises(ValueError, match="at least one reward function"):
        training.train(
            model,
            params,
            algorithms.get("grpo"),
            config,
            steps=1,
            task=routes,
            environment_factory={"adder": _NoReward},
        )


class _NoReward:
    """An environment without get_reward: a run needs a reward function then."""

    def reset(self, **kwargs) -> str | None:
        return " 1"

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


def test_text_prompts_are_refused_with_tools():
    model, params = scripted_model({})

    class TextTask(AddTask):
        def examples(self, split, indices, *, seed):
            batch = super().examples(split, indices, seed=seed)
            return dataclasses.replace(batch, prompts=["2+3="] * len(indices))

    with pytest.raises(training.RunStopped) as caught:
        training.train(model, params, algorithms.get("grpo"), CONFIG, steps=1, task=TextTask(), tools=[add])
    assert "conversational prompts" in str(caught.value.__cause__)


def test_bad_tools_are_refused_before_any_compute(monkeypatch):
    model, params = scripted_model({})

    def compile_nothing(*args, **kwargs):
        raise AssertionError("the train step was compiled before the tools were checked")

    monkeypatch.setattr(training.loop, "_compile", compile_nothing)

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="tools: tool 'undocumented' has no JSON schema"):
        training.train(model, params, algorithms.get("grpo"), CONFIG, steps=1, task=AddTask(), tools=[undocumented])
    with pytest.raises(ValueError, match="built-in sampler"):
        training.train(
            model, params, algorithms.get("grpo"), CONFIG, steps=1, task=AddTask(), tools=[add], rollout=lambda: None
        )


def test_tool_tokens_get_no_gradient_and_the_loss_is_the_model_tokens():
    """The clipped surrogate over an episode batch against a loop over each row's model tokens."""
    model, params = scripted_model(chain(CALL, {"<tool_call>": 20.0, "5": 20.0}))
    episodes = run(model, params, group=4, budget=48)
    mask = episodes.completion_mask
    assert (~mask & (np.arange(mask.shape[1]) < episodes.lengths[:, None])).any()  # tool tokens in the batch
    rng = np.random.default_rng(0)
    old = jnp.asarray(episodes.logprobs)
    logp = old + 0.3 * jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=mask.shape[0]), jnp.float32)

    def loss(logp):
        value, _ = objectives.ppo_clip(logp, old, advantages, jnp.asarray(mask), eps_low=0.2, agg="token-mean")
        return value

    gradient = np.asarray(jax.grad(loss)(logp))
    assert (gradient[~mask] == 0).all()  # tool results and template ids: exactly zero
    assert (gradient[mask] != 0).any()
    terms = []
    for b in range(mask.shape[0]):
        for t in np.flatnonzero(mask[b]):  # the model's tokens only
            ratio = float(np.exp(logp[b, t] - old[b, t]))
            a = float(advantages[b])
            terms.append(-min(ratio * a, float(np.clip(ratio, 0.8, 1.2)) * a))
    np.testing.assert_allclose(float(loss(logp)), np.mean(terms), rtol=1e-5)


def test_evaluation_runs_episodes_greedy_and_sampled():
    from jaxrl_llm import evaluation

    model, params = scripted_model(chain(CALL, {"5": 20.0, "<tool_call>": 19.0}))  # greedy answers at once
    results = evaluation.evaluate(
        model,
        params,
        AddTask(),
        max_new_tokens=32,
        num_samples=4,
        tools=[add],
        progress=False,
        episodes=EpisodeConfig(max_turns=3),
    )
    assert results["greedy_accuracy"] == 1.0 and results["greedy_turns"] == 1.0 and results["greedy_tool_calls"] == 0
    assert 0 < results["pass@1"] <= results["pass@4"] == 1.0  # samples call the tool, then answer (or run out)
    # The rollouts are chosen once: episodes with tools, single-turn completions without; a
    # strategy chosen before (a run's) evaluates as the arguments that make it.
    strategy = scoring.rollout_strategy(AddTask(), tools=[add], episodes=EpisodeConfig(max_turns=3))
    assert isinstance(strategy, scoring.Episodic) and strategy.toolset.tools == (add,)
    assert isinstance(scoring.rollout_strategy(AddTask()), rollouts.Completions)
    again = evaluation.evaluate(
        model, params, AddTask(), max_new_tokens=32, num_samples=4, progress=False, strategy=strategy
    )
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in results.items() if k != "seconds"}
    config = dataclasses.replace(CONFIG, eval_every=1)
    _, history = training.train(model, params, algorithms.get("grpo"), config, steps=1, task=AddTask(), tools=[add])
    assert history[0]["eval_greedy_accuracy"] == 1.0 and history[0]["eval_greedy_tool_calls"] == 0
