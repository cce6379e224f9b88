"""A user's own data through ``jaxrl-llm train``, as someone coming from TRL writes it: a
JSONL file of GSM8K-style problems, a reward module beside the config, no hidden stage,
and the user's own errors reported in a few lines that point at their code."""

import dataclasses
import json
import sys
import textwrap

import numpy as np
import pytest
import transformers

from jaxrl_llm import cli, runs, tasks
from jaxrl_llm.runs import build, run
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import absolute_paths
from jaxrl_llm.runs.directory import WARM_START_FILE, stored_config

REWARDS = textwrap.dedent("""\
    import re


    def correctness(completions, answer, **kwargs):  # exactly as written for TRL's GRPOTrainer
        expected = [a.split("####")[-1].strip() for a in answer]
        found = [re.findall(r"-?\\d+", c) for c in completions]
        return [float(bool(f) and f[-1] == e) for f, e in zip(found, expected)]


    def too_few(completions, **kwargs):
        return [0.0] * 3


    def crashes(completions, **kwargs):
        return [float(completion.split()[7]) for completion in completions]
    """)

CONFIG = textwrap.dedent("""\
    steps = {steps}
    save_every = 1
    plot_every = 1

    [model]
    hidden_size = 16
    intermediate_size = 32
    num_layers = 1
    num_heads = 2
    num_kv_heads = 1

    [task]
    name = "jsonl"
    path = "{data}"
    prompt = "question"
    test_fraction = 0.1
    rewards = ["{reward}"]

    [train]
    num_prompts = 2
    group_size = 2
    max_new_tokens = 4
    eval_every = 1
    eval_samples = 2
    """)


def _problems(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for a, b in rng.integers(0, 10, size=(count, 2)):
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
            }
        )
    return rows


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's directory: ``data/train.jsonl`` (180 problems), ``configs/my_rewards.py``
    and ``configs/run.toml``, and the user working in it."""
    (tmp_path / "data").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _problems(180)))
    (tmp_path / "configs" / "my_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)

    def write_config(reward="my_rewards:correctness", steps=1, extra=""):
        path = tmp_path / "configs" / "run.toml"
        path.write_text(CONFIG.format(steps=steps, data="data/train.jsonl", reward=reward) + extra)
        return str(path.relative_to(tmp_path))

    return tmp_path, write_config


def test_the_demo_warm_start_stays_with_the_demo():
    demo = runs.RunConfig()
    assert demo.is_demo and demo.warm_start == run_config.DEMO_WARM_START and demo.warm_start.off_by_one_fraction
    jsonl = dataclasses.replace(demo, task=runs.TaskSpec(name="jsonl", path="x.jsonl"))
    assert jsonl.warm_start == runs.WarmStartConfig() and not jsonl.warm_start.enabled
    own_model = dataclasses.replace(demo, model=dataclasses.replace(demo.model, path="models/mine"))
    assert not own_model.warm_start.enabled
    # Labels made wrong on purpose are for the demo's task only, and only when asked for.
    asked = dataclasses.replace(jsonl, warm_start=runs.WarmStartConfig(steps=5, off_by_one_fraction=0.5))
    with pytest.raises(
        ValueError,
        match=r"off_by_one_fraction=0.5 makes .* on task 'jsonl' set "
        r"warm_start.off_by_one_fraction = 0",
    ):
        build.check_demonstrations(asked, None)


def test_a_warm_start_asked_for_on_own_data_trains_on_its_labels_as_they_are(tmp_path):
    toml = {"task": {"name": "jsonl", "path": "x"}, "warm_start": {"steps": 5}}
    assert run_config.from_dict(toml).warm_start == runs.WarmStartConfig(steps=5)
    flags = cli.parse_train(
        ["--run-dir", "unused", "--task.name", "jsonl", "--task.path", "x", "--warm-start.steps", "5"]
    )[1]
    assert flags.warm_start == runs.WarmStartConfig(steps=5)
    assert cli.parse_train(["--run-dir", "unused", "--warm-start.steps", "5"])[1].warm_start == dataclasses.replace(
        run_config.DEMO_WARM_START, steps=5
    )  # flags on the demo change the demo's
    for spelling in ("--warm-start.steps", "--warm_start.steps"):  # tyro takes both
        own_model = cli.parse_train(["--run-dir", "unused", "--model.path", "models/mine", spelling, "5"])[1]
        assert own_model.warm_start == runs.WarmStartConfig(steps=5)

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _problems(30)))
    config = runs.RunConfig(
        task=runs.TaskSpec(name="jsonl", path=str(path), prompt="question", test_fraction=0.1),
        warm_start=runs.WarmStartConfig(steps=5),
        train=dataclasses.replace(
            runs.RunConfig().train, sampling=dataclasses.replace(runs.RunConfig().train.sampling, max_new_tokens=24)
        ),
    )
    task = build.task(config.task, build.tokenizer(config.model))
    tokens, _, completion_mask = build.demonstrations(config, task)
    assert len(tokens) == 27  # every train example by default
    targets = [
        task.tokenizer.decode(row[-mask.size :][mask], skip_special_tokens=True)  # tokens: [D, S + N]
        for row, mask in zip(tokens, completion_mask)
    ]
    assert targets == [str(row["answer"]) for row in task.records["train"]]
    with pytest.raises(ValueError, match=r"warm_start.examples=1024 is more than the task's 27 train examples"):
        build.check_demonstrations(
            dataclasses.replace(config, warm_start=runs.WarmStartConfig(steps=5, examples=1024)), task
        )


def test_own_data_through_the_cli_with_a_reward_module_beside_the_config(project, monkeypatch):
    root, write_config = project
    config = write_config()
    assert cli.main(["train", "--config", config, "--run-dir", "runs/mine", "--progress", "off"]) == 0
    assert json.loads((root / "runs/mine" / WARM_START_FILE).read_text())["steps"] == 0  # no hidden stage
    stored = stored_config(root / "runs/mine")
    assert stored.task.rewards == (f"{root / 'configs' / 'my_rewards.py'}:correctness",)
    assert "reward_correctness" in runs.read_metrics(root / "runs/mine")[0]
    # The stored run continues from anywhere: its paths are absolute.
    (root / "elsewhere").mkdir()
    monkeypatch.chdir(root / "elsewhere")
    assert cli.main(["train", "--run-dir", str(root / "runs/mine"), "--steps", "2", "--progress", "off"]) == 0
    assert [row["step"] for row in runs.read_metrics(root / "runs/mine")] == [0, 1]


def test_a_reward_module_in_the_current_directory_and_one_that_is_nowhere(project, capsys, monkeypatch):
    root, write_config = project
    (root / "configs" / "my_rewards.py").rename(root / "my_rewards.py")
    config = cli.parse_train(["--config", write_config(), "--run-dir", "unused"])[1]
    assert config.task.rewards == (f"{root / 'my_rewards.py'}:correctness",)  # cwd first, as python -m
    assert build.reward_function(config.task.rewards[0]).__name__ == "correctness"
    flags = absolute_paths(
        cli.parse_train(
            [
                "--run-dir",
                "unused",
                "--task.name",
                "jsonl",
                "--task.path",
                "x",
                "--task.rewards",
                "my_rewards:correctness",
            ]
        )[1]
    )
    assert flags.task.rewards == config.task.rewards
    monkeypatch.setattr(run.build, "model", lambda *a, **k: pytest.fail("compute started"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", write_config(reward="their_rewards:correctness"), "--run-dir", "r"])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2
    assert (
        f"cannot import 'their_rewards:correctness': No module named 'their_rewards' (looked for their_rewards.py "
        f"in the current directory {root}, beside the config file, and among the installed modules"
    ) in err
    assert not (root / "r").exists()


@pytest.mark.parametrize(
    "reward, message, user_line",
    [
        (
            "too_few",
            "In the held-out evaluation before training: reward function 'too_few' returned 3 values for 18 "
            "completions",
            "  too_few is defined in {file}, line 10.",
        ),
        (
            "crashes",
            "In the held-out evaluation before training: reward function 'crashes' raised IndexError",
            '  File "{file}", line 15, in crashes',
        ),
    ],
)
def test_a_failing_reward_function_is_reported_in_a_few_lines_and_the_fixed_command_runs(
    project, capsys, reward, message, user_line
):
    root, write_config = project
    argv = ["train", "--config", write_config(reward=f"my_rewards:{reward}"), "--run-dir", "r", "--progress", "off"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().split("\n")
    assert message in lines[0] and user_line.format(file=root / "configs" / "my_rewards.py") in lines
    assert len(lines) <= 12 and "jaxrl_llm" not in err.replace("jaxrl-llm", "")  # the user's frames only
    assert lines[-1] == "No checkpoint was saved; fix the cause and run the same command again."
    # Nothing completed: the directory is not a run yet, and the corrected command runs in it.
    assert cli.main(["train", "--config", write_config(), "--run-dir", "r", "--progress", "off"]) == 0


def test_a_run_failing_at_its_first_step_says_only_that_no_checkpoint_was_saved(project, capsys):
    root, write_config = project
    argv = ["train", "--config", write_config(reward="my_rewards:crashes"), "--run-dir", "r", "--progress", "off"]
    assert cli.main([*argv, "--train.eval-every", "0"]) == 1
    err = capsys.readouterr().err
    assert "train stopped at step 0 (0 of 1 steps done): RewardFunctionError: In the rollout of train step 0" in err
    assert "Saved a checkpoint" not in err and ".." not in err
    assert err.strip().split("\n")[-1] == "No checkpoint was saved; fix the cause and run the same command again."


def test_a_reward_function_failing_mid_run_names_the_step_and_how_to_continue(project, capsys, monkeypatch):
    root, write_config = project
    argv = ["train", "--config", write_config(steps=3), "--run-dir", "r", "--progress", "off"]
    module = build.reward_function(f"{root / 'configs' / 'my_rewards.py'}:correctness").__module__
    original, calls = sys.modules[module].correctness, []

    def breaks_in_the_second_rollout(completions, answer, **kwargs):
        calls.append(len(completions))
        if calls.count(4) == 2:  # a rollout's 2 x 2 completions (an evaluation scores 18)
            raise ValueError("the grader is down")
        return original(completions, answer, **kwargs)

    monkeypatch.setattr(sys.modules[module], "correctness", breaks_in_the_second_rollout)
    assert cli.main(argv) == 1
    lines = capsys.readouterr().err.strip().split("\n")
    assert lines[0].startswith(
        "jaxrl-llm train: error: train stopped at step 1 (1 of 3 steps done): "
        "RewardFunctionError: In the rollout of train step 1: reward function "
        "'breaks_in_the_second_rollout' raised ValueError: the grader is down at row 0"
    )
    assert (
        lines[-1] == "The checkpoint of step 1 in r is intact; fix the cause and continue with: "
        "jaxrl-llm train --run-dir r --resume"
    )
    monkeypatch.undo()
    monkeypatch.chdir(root)
    assert cli.main(["train", "--run-dir", "r", "--resume", "--progress", "off"]) == 0
    assert [row["step"] for row in runs.read_metrics(root / "r")] == [0, 1, 2]


def test_unreadable_text_files_are_named(tmp_path):
    data, toml = tmp_path / "train.jsonl", tmp_path / "run.toml"
    data.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=rf"{data}:2: not UTF-8 text"):
        tasks.from_jsonl(data, tokenizer=build.tokenizer(runs.ModelSpec()), reward_fns=[lambda **k: [0.0]])
    toml.write_bytes(b"steps = 3\n# caf\xe9\n")
    with pytest.raises(ValueError, match=rf"{toml}: not UTF-8 text"):
        run_config.load(toml)


def test_a_column_some_examples_lack_is_named_once(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": "3"}, {"prompt": "d"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.warns(
        UserWarning,
        match=r"column 'answer' is missing from 2 of 4 examples of the train split; "
        r"reward functions receive None there",
    ):
        tasks.from_jsonl(path, tokenizer=build.tokenizer(runs.ModelSpec()), reward_fns=[lambda **k: [0.0]])


@pytest.mark.parametrize(
    "module, message, user_line",
    [
        ("import numpyy\n", "broken.py:fn' failed: ModuleNotFoundError: No module named 'numpyy'", None),
        (
            "SCALE = 1\nOFFSET = SCAEL + 1\n",
            "broken.py:fn' failed: NameError: name 'SCAEL' is not defined",
            "line 2, in <module>",
        ),
        ("def fn(completions:\n", "broken.py:fn' failed: SyntaxError", None),
    ],
)
def test_an_error_importing_the_reward_module_names_it_and_shows_the_users_line(
    project, capsys, module, message, user_line
):
    root, write_config = project
    (root / "configs" / "broken.py").write_text(module)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", write_config(reward="broken:fn"), "--run-dir", "r"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "looked for" not in err
    assert user_line is None or f'File "{root / "configs" / "broken.py"}", {user_line}' in err
    assert not (root / "r").exists()


def test_a_reward_file_named_like_an_installed_module_is_refused_not_swapped_in(tmp_path):
    (tmp_path / "json.py").write_text("def fn(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"a module named 'json' is already imported from .*; rename json.py"):
        build.reward_function(f"{tmp_path / 'json.py'}:fn")
    assert json.dumps([1]) == "[1]" and sys.modules["json"] is json  # left alone


def test_the_same_module_name_in_two_projects_loads_each_projects_file(tmp_path):
    for project, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / project).mkdir()
        (tmp_path / project / "scores.py").write_text(
            f"def fn(completions, **kwargs):\n    return [{value}] * len(completions)\n"
        )
    assert build.reward_function(f"{tmp_path / 'a' / 'scores.py'}:fn")(completions=["x"]) == [1.0]
    assert build.reward_function(f"{tmp_path / 'b' / 'scores.py'}:fn")(completions=["x"]) == [2.0]
    assert sys.path[0] != str(tmp_path / "b")  # searched first only while importing


def test_a_completion_budget_the_models_positions_cannot_hold_is_refused_before_any_compute(tmp_path):
    transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path)
    config = runs.RunConfig(model=runs.ModelSpec(path=str(tmp_path)), warm_start=runs.WarmStartConfig())
    build.check_positions(config)
    too_long = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, sampling=dataclasses.replace(config.train.sampling, max_new_tokens=64)),
    )
    with pytest.raises(
        ValueError,
        match=r"max_new_tokens \(64\) leaves no room for a prompt .* "
        r"\(max_position_embeddings = 64\)",
    ):
        build.check_positions(too_long)
