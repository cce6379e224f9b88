"""The README's examples run as they are written."""

import pathlib
import runpy

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _example(name: str) -> str:
    """The Python block that follows ``<!-- readme-example: name -->`` in the README."""
    text = README.read_text()
    marker = f"<!-- readme-example: {name} -->\n```python\n"
    assert text.count(marker) == 1, f"README has no single example {name!r}"
    return text.split(marker)[1].split("\n```")[0]


def test_the_own_data_example_trains_evaluates_and_reports_its_metrics(tmp_path, monkeypatch, capsys):
    script = tmp_path / "example.py"
    script.write_text(_example("own-data"))
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(script))
    history, evaluation = namespace["history"], capsys.readouterr().out
    assert len(history) == 4 and all(np.isfinite(v) for h in history for v in h.values())
    assert {"reward_accuracy", "reward_format_reward", "eval_greedy_accuracy"} <= history[-1].keys()
    assert "eval_greedy_accuracy" in history[1] and "eval_greedy_accuracy" not in history[0]  # eval_every=2
    assert "'pass@4':" in evaluation and namespace["path"].exists()
