"""A multi-turn run through ``jaxrl-llm train`` as someone coming from TRL writes it: TRL's
tools and environment in a module beside the config, named in ``[task]``; it records its
episodes, evaluates them, and a run stopped and continued ends where the straight one does."""

import json
import re
import signal
import subprocess
import sys
import textwrap

import chex
import pytest

from jaxrl_llm import cli, runs
from jaxrl_llm.runs import run
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
    stored = run.stored_config(tmp_path / "straight")
    assert stored.task.tools == (f"{tmp_path / 'agent.py'}:add",)  # found beside the config: stored by path
    assert stored.task.environment == f"{tmp_path / 'agent.py'}:CounterEnv"
    samples = [json.loads(line) for line in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 and all("<|assistant|>" in s["completion"] or s["length"] for s in samples)

    # Stopped after 2 steps and continued to 4: the environments are built anew, and the run
    # ends where the straight one does (an episode's state lives in the episode).
    assert cli.main(["train", "--config", project(2), "--run-dir", "stopped", "--progress", "off"]) == 0
    assert cli.main(["train", "--run-dir", "stopped", "--steps", "4", "--resume", "--progress", "off"]) == 0
    without = [{k: v for k, v in row.items() if not run.is_timing(k)} for row in metrics]
    continued = [
        {k: v for k, v in row.items() if not run.is_timing(k)} for row in runs.read_metrics(tmp_path / "stopped")
    ]
    assert continued == without
    *_, straight_params, _ = runs.restore_policy(tmp_path / "straight")
    *_, continued_params, step = runs.restore_policy(tmp_path / "stopped")
    assert step == 4
    chex.assert_trees_all_equal(continued_params, straight_params)  # bitwise


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
