"""Evaluation: the unbiased pass@k estimator, and greedy accuracy / pass@k over a split."""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest

from jaxrl_llm import evaluation, models, rollouts, sampling, sharding
from jaxrl_llm.episodes import EpisodeConfig
from jaxrl_llm.evaluation import evaluate, pass_at_k
from jaxrl_llm.tasks import DigitSumTask

MAX_NEW_TOKENS = 4


# --- pass@k -----------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of the k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_equals_enumerating_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = brute_force_pass_at_k(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
            assert math.isclose(expected, 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


def test_pass_at_k_edge_cases_are_exact():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # everything correct
    assert pass_at_k(5, 1, 5) == 1.0  # k = n: the draw is every sample
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw holds a correct one
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is c / n
    # Large n: the binomials overflow floats, the product form does not.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert pass_at_k(2000, 0, 1000) == 0.0
    assert isinstance(pass_at_k(4, 2, 2), float)


def test_pass_at_k_is_vectorized_over_problems():
    n = np.array([1, 3, 4, 6, 6])
    c = np.array([1, 0, 2, 6, 1])
    got = pass_at_k(n, c, 1)
    assert got.shape == (5,)
    np.testing.assert_allclose(got, c / n, atol=1e-12)
    # A scalar n broadcasts against per-problem counts; several shapes at once.
    counts = np.arange(7).reshape(7, 1) * np.ones((1, 2), np.int64)  # [7, 2]
    got = pass_at_k(6, counts, 3)
    assert got.shape == (7, 2)
    np.testing.assert_allclose(got[:, 0], [brute_force_pass_at_k(6, c, 3) for c in range(7)], atol=1e-12)
    assert pass_at_k(np.zeros(0, np.int64), np.zeros(0, np.int64), 1).shape == (0,)
    # Many problems, few distinct (n, c): each problem gets its pair's estimate.
    rng = np.random.default_rng(0)
    n = rng.integers(1, 7, size=(50, 3))
    c = rng.integers(0, n + 1)
    expected = np.vectorize(brute_force_pass_at_k)(n, c, 1 + 0 * n)
    np.testing.assert_allclose(pass_at_k(n, c, 1), expected, atol=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [
        (3, 1, 4, r"`k` must be <= num_samples.*k = 4 with n = 3"),
        (np.array([4, 2]), np.array([1, 1]), 3, r"k = 3 with n = 2, c = 1 at problem 1\.$"),
        (3, 0, 0, r"`k` must be an integer >= 1"),
        (3, 4, 1, r"`num_correct` must be in \[0, num_samples\]"),
        (3, -1, 1, r"`num_correct` must be in \[0, num_samples\]"),
        (np.ones((2, 2), np.int64), np.array([[0, 1], [2, 1]]), 1, r"n = 1, c = 2 at problem \(1, 0\)"),
        (0, 0, 1, r"`num_samples` must be >= 1"),
        (3.0, 1, 1, r"`num_samples` must be an integer"),
        (np.array([3, 3]), np.array([1, 1, 1]), 1, r"broadcastable"),
    ],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_pass_at_k_values_are_powers_of_two_and_n():
    assert evaluation.pass_at_k_values(1) == (1,)
    assert evaluation.pass_at_k_values(8) == (1, 2, 4, 8)
    assert evaluation.pass_at_k_values(12) == (1, 2, 4, 8, 12)
    assert evaluation.pass_at_k_values(np.int64(3)) == (1, 2, 3)


# --- evaluate -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordingDigits(DigitSumTask):
    """The digit task, recording what its ``correct`` reward function sees and returns."""

    calls: list = dataclasses.field(default_factory=list)

    def correct(self, *, completion_ids, answer, **kwargs):
        values = super().correct(completion_ids=completion_ids, answer=answer, **kwargs)
        self.calls.append(([list(ids) for ids in completion_ids], list(answer), values))
        return values


@dataclasses.dataclass(frozen=True)
class AlwaysRight(DigitSumTask):
    """Every completion is correct: a model that always answers right, as far as rewards tell."""

    @property
    def reward_fns(self):
        def always(*, completions, **kwargs):
            return [1.0] * len(completions)

        return (always,)

    @property
    def reward_weights(self):
        return (1.0,)


@dataclasses.dataclass(frozen=True)
class OnePrompt(RecordingDigits):
    """Every test example is "3+4=": only the keys tell the batches' samples apart."""

    def examples(self, split, indices, *, seed):
        return super().examples(split, np.full_like(indices, 34), seed=seed)


@dataclasses.dataclass(frozen=True)
class NoTestSplit(DigitSumTask):
    def split_size(self, split):
        return None if split == "train" else 0


@pytest.fixture(scope="module")
def policy():
    """A tiny random decoder; its weights scaled up so that its greedy answers vary with the prompt."""
    task = DigitSumTask()
    config = models.ModelConfig(
        vocab_size=len(task.tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    model, params = models.init(config, jax.random.key(0))
    return model, jax.tree.map(lambda x: 4 * x, params)


@pytest.fixture(scope="module")
def independent_greedy(policy):
    """Greedy completions of the 100 test prompts by `sampling.sample` alone: tokens ``[100, N]``, lengths, answers."""
    model, params = policy
    task = DigitSumTask()
    texts = [f"{a}+{b}=" for a in range(10) for b in range(10)]  # example i = 10 a + b
    ids = np.array([task.tokenizer.convert_tokens_to_ids(list(text)) for text in texts], np.int32)  # [100, 4]
    rollout = sampling.sample(
        model,
        params,
        ids,
        np.ones_like(ids, bool),
        jax.random.key(1),
        num_samples=1,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0.0,
        eos_ids=task.eos_ids,
        pad_id=task.pad_id,
    )
    answers = np.array([(a + b) % 10 for a in range(10) for b in range(10)])
    return np.asarray(rollout.completion_tokens), np.asarray(rollout.lengths), answers


def test_greedy_accuracy_and_pass_at_k_match_independent_computations(policy, independent_greedy):
    model, params = policy
    task = RecordingDigits()
    n = 4
    metrics = evaluate(
        model, params, task, num_samples=n, max_new_tokens=MAX_NEW_TOKENS, batch_size=32, progress=False
    )  # 32 does not divide 100: batches of 32, 32, 32, 4
    assert set(metrics) == {"examples", "greedy_accuracy", "greedy_reward", "reward", "pass@1", "pass@2", "pass@4"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["examples"] == 100

    # Greedy: the first completion token against the answer digit, from sample() alone.
    tokens, lengths, answers = independent_greedy
    digit_ids = np.array(task.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    solved = tokens[:, 0] == digit_ids[answers]  # [100]
    assert metrics["greedy_accuracy"] == pytest.approx(solved.mean(), abs=1e-12)
    stops = (lengths == 2) & (tokens[:, 1] == task.eos_id)
    assert metrics["greedy_reward"] == pytest.approx((solved + 0.5 * (solved & stops)).mean(), abs=1e-6)

    # The calls alternate greedy (P rows) and sampled (P n rows), batch after batch, in index order.
    assert [len(call[1]) for call in task.calls] == [32, 128, 32, 128, 32, 128, 4, 16]
    greedy_ids = [ids for call in task.calls[0::2] for ids in call[0]]
    assert [ids[:length] for ids, length in zip(tokens.tolist(), lengths.tolist())] == greedy_ids
    assert [a for call in task.calls[0::2] for a in call[1]] == answers.tolist()

    # Sampled: per-example solved flags [100, n] from what the reward function returned.
    flags = np.concatenate([np.asarray(call[2]) for call in task.calls[1::2]]).reshape(100, n) >= 1.0
    assert [a for call in task.calls[1::2] for a in call[1]] == np.repeat(answers, n).tolist()
    assert metrics["pass@1"] == pytest.approx(flags.mean(), abs=1e-12)
    for k in (2, 4):
        brute = np.mean([brute_force_pass_at_k(n, int(c), k) for c in flags.sum(1)])
        assert metrics[f"pass@{k}"] == pytest.approx(brute, abs=1e-12)
    assert 0 < metrics["pass@1"] < metrics["pass@2"] < metrics["pass@4"] < 1  # a test with signal

    # The same seed, the same numbers; the sampled ones depend on it.
    again = evaluate(model, params, DigitSumTask(), num_samples=n, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    assert again == metrics
    other = evaluate(
        model, params, DigitSumTask(), num_samples=n, max_new_tokens=MAX_NEW_TOKENS, progress=False, seed=1
    )
    assert other["greedy_accuracy"] == metrics["greedy_accuracy"] and other["pass@1"] != metrics["pass@1"]


def test_each_batch_samples_with_its_own_key(policy):
    model, params = policy
    task = OnePrompt()
    evaluate(model, params, task, num_samples=4, max_new_tokens=MAX_NEW_TOKENS, batch_size=4, progress=False)
    sampled = [call[0] for call in task.calls[1::2]]  # 25 batches of the same 4 prompts, 16 completions each
    assert len(sampled) == 25
    assert len({str(ids) for ids in sampled}) > 1


def test_evaluating_over_a_mesh_gives_the_single_device_metrics(policy):
    """Batches of 32 prompts split over a 2 x 4 (data x fsdp) mesh; the last, of 4, over
    data alone (its 4 greedy rows decoded on every fsdp device, its 8 sampled rows in
    blocks over fsdp): the metrics of one device."""
    model, params = policy
    settings = dict(num_samples=2, max_new_tokens=MAX_NEW_TOKENS, progress=False, seed=3)
    expected = evaluate(model, params, DigitSumTask(), **settings)
    got = evaluate(model, params, DigitSumTask(), mesh=sharding.make_mesh(data=2, fsdp=4), **settings)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


def test_correct_reward_and_threshold_define_solved(policy, independent_greedy):
    model, params = policy
    task = DigitSumTask()
    tokens, lengths, answers = independent_greedy
    digit_ids = np.array(task.tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    stopped = (tokens[:, 0] == digit_ids[answers]) & (lengths == 2) & (tokens[:, 1] == task.eos_id)
    by_name = evaluate(
        model, params, task, max_new_tokens=MAX_NEW_TOKENS, correct_reward="stops", threshold=0.5, progress=False
    )
    by_index = evaluate(
        model, params, task, max_new_tokens=MAX_NEW_TOKENS, correct_reward=1, threshold=0.5, progress=False
    )
    assert by_name == by_index
    assert by_name["greedy_accuracy"] == pytest.approx(stopped.mean(), abs=1e-12)
    assert set(by_name) == {"examples", "greedy_accuracy", "greedy_reward"}  # no sampling: greedy only
    # "stops" gives at most 0.5: never solved at threshold 1.
    assert (
        evaluate(model, params, task, max_new_tokens=MAX_NEW_TOKENS, correct_reward="stops", progress=False)[
            "greedy_accuracy"
        ]
        == 0.0
    )


def test_an_always_correct_model_scores_one(policy):
    model, params = policy
    metrics = evaluate(model, params, AlwaysRight(), num_samples=4, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    assert metrics == {
        "examples": 100.0,
        "greedy_accuracy": 1.0,
        "greedy_reward": 1.0,
        "reward": 1.0,
        "pass@1": 1.0,
        "pass@2": 1.0,
        "pass@4": 1.0,
    }


def test_truncation_settings_reach_the_sampler(policy):
    """min_p = 1 keeps only the most likely token: the samples are the greedy completion."""
    model, params = policy
    metrics = evaluate(
        model,
        params,
        DigitSumTask(),
        sampling=sampling.SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, min_p=1.0),
        num_samples=2,
        batch_size=100,
        progress=False,
    )
    greedy = evaluate(model, params, DigitSumTask(), max_new_tokens=MAX_NEW_TOKENS, progress=False)
    assert metrics["greedy_accuracy"] == greedy["greedy_accuracy"]  # batch size changes nothing greedy
    assert metrics["pass@1"] == metrics["pass@2"] == pytest.approx(greedy["greedy_accuracy"], abs=1e-12)
    assert metrics["reward"] == pytest.approx(greedy["greedy_reward"], abs=1e-6)


def test_the_sampling_settings_come_whole_or_as_fields_that_replace_its_own(policy):
    model, params = policy
    settings = dict(num_samples=2, batch_size=50, progress=False)
    whole = evaluate(
        model,
        params,
        DigitSumTask(),
        sampling=sampling.SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.7, top_k=3),
        **settings,
    )
    fields = evaluate(
        model, params, DigitSumTask(), max_new_tokens=MAX_NEW_TOKENS, temperature=0.7, top_k=3, **settings
    )
    replaced = evaluate(
        model,
        params,
        DigitSumTask(),
        sampling=sampling.SamplingConfig(max_new_tokens=1, top_k=3),
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0.7,
        **settings,
    )
    assert whole == fields == replaced
    with pytest.raises(TypeError, match=r"evaluate: give the completion budget, `max_new_tokens=`"):
        evaluate(model, params, DigitSumTask(), temperature=0.7, progress=False)
    with pytest.raises(
        TypeError,
        match=r"evaluate: unexpected keyword 'temprature'; .* SamplingConfig's fields "
        r"\(max_new_tokens, .*temperature",
    ):
        evaluate(model, params, DigitSumTask(), max_new_tokens=MAX_NEW_TOKENS, temprature=0.7, progress=False)
    with pytest.raises(TypeError, match="evaluate: `sampling` must be a SamplingConfig"):
        evaluate(model, params, DigitSumTask(), sampling=dict(max_new_tokens=MAX_NEW_TOKENS), progress=False)


def test_progress_bar_counts_examples(policy, capsys):
    model, params = policy
    evaluate(model, params, DigitSumTask(), max_new_tokens=MAX_NEW_TOKENS, progress=True)
    assert "100/100" in capsys.readouterr().err
    evaluate(model, params, DigitSumTask(), max_new_tokens=MAX_NEW_TOKENS, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("task", "settings", "match"),
    [
        (DigitSumTask(), dict(split="train"), r"'train' split of DigitSumTask is unbounded"),
        (NoTestSplit(), dict(), r"'test' split of NoTestSplit has no examples.*test_records=.*test_fraction="),
        (DigitSumTask(), dict(split="valid"), r"`split` must be one of 'train', 'test'"),
        (DigitSumTask(), dict(correct_reward="accuracy"), r"one of their names \['correct', 'stops'\]; got 'accuracy'"),
        (DigitSumTask(), dict(correct_reward=2), r"an index in \[0, 2\).*got 2"),
        (DigitSumTask(), dict(correct_reward=True), r"`correct_reward` must be"),
        (DigitSumTask(), dict(num_samples=-1), r"`num_samples` must be an integer >= 0"),
        (DigitSumTask(), dict(batch_size=0), r"`batch_size` must be an integer >= 1"),
        (DigitSumTask(), dict(temperature=-1.0), r"`temperature` must be a finite number >= 0"),
        (DigitSumTask(), dict(prompt_truncation="right"), r"`prompt_truncation` must be one of 'error', 'left'"),
        (DigitSumTask(), dict(on_reward_error="skip"), r"`on_reward_error` must be one of 'raise', 'zero'"),
        (DigitSumTask(), dict(threshold=float("nan")), r"`threshold` must be a finite number"),
        (DigitSumTask(), dict(num_samples=2, top_p=0.0), r"`top_p` must be in \(0.0, 1.0\]"),
        (DigitSumTask(), dict(max_prompt_length=2), r"more than max_prompt_length=2"),
        (
            DigitSumTask(),
            dict(strategy=rollouts.Completions(), episodes=EpisodeConfig()),
            r"pass `strategy` or `tools`, `environment_factory` and `episodes` \(which make one\), not both",
        ),
    ],
)
def test_evaluate_rejects_bad_arguments(policy, task, settings, match):
    model, params = policy
    with pytest.raises(ValueError, match=match):
        evaluate(model, params, task, max_new_tokens=MAX_NEW_TOKENS, progress=False, **settings)
