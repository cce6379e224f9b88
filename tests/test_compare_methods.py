"""experiments/compare_methods.py: its flags, its table and the files it writes.

That every preset learns in this experiment is tests/training/test_learning.py's job.
"""

import json
import re

import numpy as np
import pytest

from experiments import compare_methods
from jaxrl_llm import algorithms, training

SMALL = ["--sft-steps", "3", "--rl-steps", "2"]


def _message(stderr: str) -> str:
    """tyro's error box as one line of text: its frame and line breaks removed."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", stderr).split())


def test_the_flags_parse_to_the_config(tmp_path):
    assert compare_methods.parse([]) == compare_methods.CompareConfig()
    assert compare_methods.parse([]).algorithms == tuple(algorithms.PRESETS)
    config = compare_methods.parse(["--algorithms", "grpo,ppo", "--no-plot", "--out-dir", "None", "--rl-steps", "3"])
    assert config.algorithms == ("grpo", "ppo") and not config.plot and config.out_dir is None
    assert config.rl_steps == 3 and [m.name for m in config.methods()] == ["grpo", "ppo"]
    out_dir = tmp_path / "results"  # need not exist yet
    config = compare_methods.parse(["--algorithms", "grpo", "rloo,ppo", "--plot", "--out-dir", str(out_dir)])
    assert config.algorithms == ("grpo", "rloo", "ppo") and config.plot and config.out_dir == out_dir


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rl-steps", "0"], "`rl_steps` must be an integer >= 1; got 0"),
        (["--rl-steps", "two"], "--rl-steps"),
        (["--learning-rate", "inf"], "`learning_rate` must be a finite number; got inf"),
        (["--group-size", "1", "--algorithms", "grpo"], "Algorithm 'grpo' compares each completion"),
        (["--algorithms", "grpo2"], "Unknown algorithm 'grpo2'"),
        (["--algorithms", ","], "`algorithms`: No method named"),
        (["--sft-accuracy", "1.5"], r"`sft_accuracy` must be in \[0.0, 1.0\]; got 1.5"),
        (["--out-dir", __file__], "`out_dir` must be a directory"),
    ],
)
def test_bad_settings_exit_with_status_2_before_any_compute(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(compare_methods, "warm_started_model", lambda *a: pytest.fail("the warm start ran"))
    with pytest.raises(SystemExit) as exit_:
        compare_methods.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, _message(capsys.readouterr().err))


def test_the_main_job_prints_its_table_and_writes_its_results(tmp_path, capsys):
    results = compare_methods.main([*SMALL, "--algorithms", "grpo,rloo", "--out-dir", str(tmp_path)])
    assert [r["algorithm"] for r in results] == ["grpo", "rloo"]
    out = capsys.readouterr().out
    assert "SFT warm start: 3 steps" in out and "greedy acc" in out
    table = out.split("\n\n")[1].strip()
    assert table.splitlines()[0].startswith("| method ") and len(table.splitlines()) == 2 + 2
    assert table in (tmp_path / "results.md").read_text()  # the printed table, as Markdown
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["config"]["algorithms"] == ["grpo", "rloo"] and written["interrupted"] is None
    assert written["warm_start"]["steps"] == 3
    for row, result in zip(written["methods"], results, strict=True):
        assert row["algorithm"] == result["algorithm"] and len(row["rewards"]) == 2
        assert row["rewards"] == [h["reward"] for h in result["history"]]
        assert row["expected_reward_end"] == result["expected_reward_end"]
    assert (tmp_path / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_main_job_interrupted_writes_the_methods_done_and_exits_130(tmp_path, monkeypatch, capsys):
    real_run = compare_methods.run

    def interrupted_at_grpo(config, method, *args):
        if method.name == "grpo":
            raise training.RunInterrupted("stopped", None, [{}])
        return real_run(config, method, *args)

    monkeypatch.setattr(compare_methods, "run", interrupted_at_grpo)
    with pytest.raises(SystemExit) as exit_:
        compare_methods.main([*SMALL, "--algorithms", "pg,grpo,ppo", "--out-dir", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert exit_.value.code == 130
    assert (
        "Interrupted: grpo after 1 of 2 steps." in out and "\n| pg " in out and "ppo" not in out.split("Interrupted")[1]
    )
    written = json.loads((tmp_path / "results.json").read_text())
    assert [row["algorithm"] for row in written["methods"]] == ["pg"]
    assert written["interrupted"] == "Interrupted: grpo after 1 of 2 steps."
    assert not (tmp_path / "rewards.png").exists()


def test_the_plot_has_one_smoothed_curve_per_method(tmp_path):
    rows = [
        {"algorithm": name, "rewards": list(np.linspace(0.2, 1.2, 12) + 0.01 * i)}
        for i, name in enumerate(algorithms.PRESETS)
    ]
    figure = compare_methods.plot_rewards(rows, tmp_path / "rewards.png", title="test")
    (ax,) = figure.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == list(algorithms.PRESETS)
    assert len({tuple(line.get_color()) for line in lines}) == len(rows)  # every method its own colour
    np.testing.assert_allclose(lines[0].get_ydata(), compare_methods.moving_average(rows[0]["rewards"], 5))
    assert "moving average" in ax.get_ylabel()
    assert (tmp_path / "rewards.png").stat().st_size > 0


def test_moving_average_is_the_trailing_mean():
    x = np.array([1.0, 3.0, 2.0, 8.0, 0.0, 5.0])
    expected = [np.mean(x[max(0, i - 2) : i + 1]) for i in range(len(x))]
    np.testing.assert_allclose(compare_methods.moving_average(x, 3), expected)
    np.testing.assert_allclose(compare_methods.moving_average(x, 1), x)
