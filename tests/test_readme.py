"""The README's first run, and the own-data example of docs/data-and-rewards.md, run as they are written.

(Every other example of README.md and docs/ is run or checked by tests/test_docs.py.)
"""

import json
import os
import pathlib
import runpy
import subprocess
import sys

import numpy as np
import pytest

from tests.test_docs import example


def test_the_own_data_example_trains_evaluates_and_reports_its_metrics(tmp_path, monkeypatch, capsys):
    script = tmp_path / "example.py"
    script.write_text(example("docs/data-and-rewards.md", "own-data"))
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(script))
    history, evaluation = namespace["history"], capsys.readouterr().out
    assert len(history) == 4 and all(np.isfinite(v) for h in history for v in h.values())
    assert {"reward_accuracy", "reward_format_reward", "eval_greedy_accuracy"} <= history[-1].keys()
    assert "eval_greedy_accuracy" in history[1] and "eval_greedy_accuracy" not in history[0]  # eval_every=2
    assert "'pass@4':" in evaluation and namespace["path"].exists()


@pytest.mark.slow
def test_the_own_data_command_line_example_runs_as_written_in_a_users_directory(tmp_path):
    project = tmp_path / "my-project"  # outside the repository, as a user's
    (project / "data").mkdir(parents=True)
    (project / "my_rewards.py").write_text(example("README.md", "own-data-cli/my_rewards.py"))
    (project / "run.toml").write_text(example("README.md", "own-data-cli/run.toml", "toml"))
    rng = np.random.default_rng(0)
    with open(project / "data" / "train.jsonl", "w") as file:
        for a, b in rng.integers(0, 10, size=(60, 2)):
            file.write(
                json.dumps(
                    {
                        "question": f"Tom has {a} apples and buys {b} more. How many apples?",
                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                    }
                )
                + "\n"
            )
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    for command in example("README.md", "own-data-cli/commands", "bash").splitlines():
        done = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    metrics = [json.loads(line) for line in (project / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 20 and "reward_correctness" in metrics[-1]
    assert json.loads((project / "runs/mine/warm_start.json").read_text())["steps"] == 0  # no hidden stage
    assert (project / "exported" / "config.json").is_file()
