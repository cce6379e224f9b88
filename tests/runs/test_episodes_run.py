"""A multi-turn run through ``jaxrl-llm train`` as someone coming from TRL writes it: TRL's
tools and environment in a module beside the config, named in ``[task]``; it records its
episodes, evaluates them, and a run stopped and continued ends where the straight one does."""

import dataclasses
import inspect
import json
import re
import signal
import subprocess
import sys
import textwrap

import chex
import pytest

from jaxrl_llm import cli, runs
from jaxrl_llm.episodes import conversation
from jaxrl_llm.runs import build
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import absolute_paths
from jaxrl_llm.runs.directory import stored_config
from jaxrl_llm.runs.records import is_timing
from tests.episodes.test_environments import IncrementEnv
from tests.runs.test_resume import complete_checkpoints, environment, stop_after_a_checkpoint, without_timings

MODULE = textwrap.dedent('''\
    def add(a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


    class CounterEnv:
        def reset(self, **kwargs) -> str | None:
            self.count = 0
            return None

        def increment(self, step: int) -> int:
            """Adds to the counter.

            Args:
                step: How much to add.
            """
            self.count += step
            return self.count

        def get_reward(self) -> float:
            return float(self.count == 3)


    def answered(completions, answer, **kwargs):
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]
    ''')

CONFIG = textwrap.dedent("""\
    steps = {steps}
    save_every = 1
    samples_every = 1
    samples_prompts = 1

    [model]
    hidden_size = 16
    intermediate_size = 32
    num_layers = 1
    num_heads = 2
    num_kv_heads = 1

    [task]
    name = "jsonl"
    path = "data.jsonl"
    test_fraction = 0.25
    rewards = ["agent:answered"]
    tools = ["agent:add"]
    environment = "agent:CounterEnv"

    [train]
    num_prompts = 2
    group_size = 2
    max_new_tokens = 24
    max_prompt_length = 128
    max_turns = 2
    eval_every = 2
    """)


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.py").write_text(MODULE)
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)} for a in range(4) for b in range(2)
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(steps):
        path = tmp_path / f"run{steps}.toml"
        path.write_text(CONFIG.format(steps=steps))
        return str(path)

    return config


def test_tools_and_an_environment_from_a_module_beside_the_config(project, tmp_path):
    argv = ["train", "--config", project(4), "--run-dir", "straight", "--progress", "off"]
    assert cli.main(argv) == 0
    metrics = runs.read_metrics(tmp_path / "straight")
    assert len(metrics) == 4
    assert {"episodes/turns", "tools/call_frequency", "reward_CounterEnv", "reward_answered"} <= metrics[0].keys()
    assert "eval_greedy_turns" in metrics[1] and "eval_greedy_tool_calls" in metrics[1]
    stored = stored_config(tmp_path / "straight")
    assert stored.task.tools == (f"{tmp_path / 'agent.py'}:add",)  # found beside the config: stored by path
    assert stored.task.environment == f"{tmp_path / 'agent.py'}:CounterEnv"
    samples = [json.loads(line) for line in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 and all("<|assistant|>" in s["completion"] or s["length"] for s in samples)

    # Stopped after 2 steps and continued to 4: the environments are built anew, and the run
    # ends where the straight one does (an episode's state lives in the episode).
    assert cli.main(["train", "--config", project(2), "--run-dir", "stopped", "--progress", "off"]) == 0
    assert cli.main(["train", "--run-dir", "stopped", "--steps", "4", "--resume", "--progress", "off"]) == 0
    without = [{k: v for k, v in row.items() if not is_timing(k)} for row in metrics]
    continued = [{k: v for k, v in row.items() if not is_timing(k)} for row in runs.read_metrics(tmp_path / "stopped")]
    assert continued == without
    *_, straight_params, _ = runs.restore_policy(tmp_path / "straight")
    *_, continued_params, step = runs.restore_policy(tmp_path / "stopped")
    assert step == 4
    chex.assert_trees_all_equal(continued_params, straight_params)  # bitwise


def test_the_warm_start_of_a_tool_task_renders_its_prompts_as_the_rollouts_do(project, tmp_path):
    # The completion column: a final answer, or a demonstration episode (a call, its result, the answer).
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    rows = [{"prompt": [{"role": "user", "content": "2+3"}], "completion": episode}] * 3
    rows += [{"prompt": [{"role": "user", "content": "1+1"}], "completion": "2"}] * 3
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = run_config.load(project(1))
    config = dataclasses.replace(
        config,
        task=dataclasses.replace(config.task, environment=None, test_fraction=0.0),
        warm_start=run_config.WarmStartConfig(steps=1, completion="completion"),
        train=dataclasses.replace(config.train, eval_every=0),
    )
    config = absolute_paths(config)
    task = build.run_task(config)
    tokens, attention, learned = build.demonstrations(config, task)
    tools = build.tools(config.task)
    by_prompt = {}
    for row in range(len(tokens)):
        ids = tokens[row][attention[row]].tolist()
        prompt_width = tokens.shape[1] - learned.shape[1]
        prompt_ids = tokens[row, :prompt_width][attention[row, :prompt_width]].tolist()
        text = task.tokenizer.decode(tokens[row, prompt_width:][learned[row]].tolist(), skip_special_tokens=False)
        by_prompt[task.tokenizer.decode(prompt_ids)] = (prompt_ids, text, ids)
    for prompt, expected_text in (("2+3", ("<tool_call>", "5")), ("1+1", ("2",))):
        rendered = conversation.render_prompt(task.tokenizer, [{"role": "user", "content": prompt}], tools)
        (match,) = [v for v in by_prompt.values() if v[0] == rendered]  # the prompt the rollouts see, schemas included
        assert all(part in match[1] for part in expected_text), match[1]
    assert "<|tools|>add(a,b)" in task.tokenizer.decode(rendered)  # the schema, as the built-in template writes it


# TRL's documented IncrementEnv (owns the data, scores itself), from the test of environments, and a
# second one beside it: a module a user would write for the command line.
OWNED = (
    "import random\n\n\n"
    + inspect.getsource(IncrementEnv)
    + textwrap.dedent('''\


    class DecrementEnv(IncrementEnv):
        def reset(self, **kwargs) -> str | None:
            self.counter = 9
            self.target = 9 - random.randint(1, 6)
            return f"Decrement the counter to {self.target}."

        def increment(self, step: int) -> int:
            """
            Add to the counter (negative steps decrement).

            Args:
                step: Value to add to the counter.
            """
            self.counter += step
            return self.counter
    ''')
)


def test_an_environment_that_owns_the_data_and_a_table_of_environments_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owned.py").write_text(OWNED)
    head = CONFIG.split("[task]")[0].format(steps=1)
    train = "[train]" + CONFIG.split("[train]")[1].replace("eval_every = 2", "eval_every = 0")
    (tmp_path / "owned.toml").write_text(
        head + '[task]\nname = "environment"\nenvironment = "owned:IncrementEnv"\n\n' + train
    )
    assert cli.main(["train", "--config", "owned.toml", "--run-dir", "owned", "--progress", "off"]) == 0
    (metrics,) = runs.read_metrics(tmp_path / "owned")
    assert "reward_IncrementEnv" in metrics and "reward_exact_match" not in metrics  # get_reward alone
    sample = json.loads((tmp_path / "owned" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][-1]["content"].startswith("Increment the counter by")  # what reset() returned

    # A dataset of only an `environment` column routes each example to one of a table of environments.
    (tmp_path / "routes.jsonl").write_text("".join(json.dumps({"environment": n}) + "\n" for n in ["up", "down"] * 4))
    table = '[task]\nname = "jsonl"\npath = "routes.jsonl"\n\n[task.environment]\nup = "owned:IncrementEnv"\n'
    table += 'down = "owned:DecrementEnv"\n\n'
    (tmp_path / "table.toml").write_text(head + table + train)
    assert cli.main(["train", "--config", "table.toml", "--run-dir", "table", "--progress", "off"]) == 0
    (metrics,) = runs.read_metrics(tmp_path / "table")
    assert {"reward_IncrementEnv", "reward_DecrementEnv"} <= metrics.keys()
    assert stored_config(tmp_path / "table").task.environment == {
        "up": f"{tmp_path / 'owned.py'}:IncrementEnv",
        "down": f"{tmp_path / 'owned.py'}:DecrementEnv",
    }


@pytest.mark.slow
def test_a_run_with_environments_killed_mid_run_resumes_exactly(project, tmp_path):
    # Real processes: one runs straight through, the other is killed with SIGKILL after a
    # checkpoint and resumed. The environments are built anew and every episode's state
    # stays in its episode, so the resumed run ends where the straight one does.
    steps, env = 8, environment()
    config = project(steps)

    def command(run_dir, *flags):
        return [sys.executable, "-m", "jaxrl_llm", "train", "--config", config, "--run-dir", str(run_dir),
                "--progress", "off", *flags]  # fmt: skip

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(command(reference), env=env, check=True, capture_output=True, timeout=600)
    process = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert stop_after_a_checkpoint(process, killed, signal.SIGKILL) == -signal.SIGKILL
    saved = complete_checkpoints(killed)
    assert saved and saved[-1] < len(runs.read_metrics(killed)) < steps, process.stderr.read().decode()[-2000:]
    resumed = subprocess.run(command(killed, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from its checkpoint of step {saved[-1]}" in resumed.stdout
    got = runs.read_metrics(killed)
    assert without_timings(got) == without_timings(runs.read_metrics(reference))
    assert [row["step"] for row in got] == list(range(steps)) and "reward_CounterEnv" in got[0]
    *_, reference_params, _ = runs.restore_policy(reference)
    *_, resumed_params, step = runs.restore_policy(killed)
    assert step == steps
    chex.assert_trees_all_equal(resumed_params, reference_params)  # bitwise


@pytest.mark.parametrize(
    "given, replacement, message",
    [
        (
            'tools = ["agent:add"]',
            'tools = ["agent:nowhere"]',
            "task.tools: '.*agent.py:nowhere': agent has no 'nowhere'",
        ),
        ('tools = ["agent:add"]', 'tools = ["add"]', "a `tools` entry is code to import, `module:name`"),
        (
            'environment = "agent:CounterEnv"',
            'environment = "missing:Env"',
            "task.environment: cannot import 'missing:Env'",
        ),
    ],
)
def test_bad_tools_and_environments_are_named(project, capsys, given, replacement, message):
    config = project(1)
    with open(config) as file:
        text = file.read()
    with open(config, "w") as file:
        file.write(text.replace(given, replacement))
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", "--config", config, "--run-dir", "bad", "--progress", "off"])
    assert exited.value.code == 2
    assert re.search(message, capsys.readouterr().err)
