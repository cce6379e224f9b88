"""The built-in multi-turn experiment: a tiny model learns by RL on episodes when to call a
tool, and its held-out success rises. ``experiments/calculator_tools.py`` runs as a user runs
it, in a process of its own with XLA's default code generation (one CPU device; the tests'
eight virtual devices and quick code generation round floats differently, and the warm start
the RL starts from would not be the documented one), with two thirds of its RL steps, evaluated on
half of its held-out split with two samples a prompt."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import default_codegen_environ

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_rl_on_episodes_learns_when_to_call_the_tool(tmp_path):
    command = [sys.executable, "experiments/calculator_tools.py", "--steps", "200", "--eval-every", "200"]
    command += ["--eval-examples", "100", "--eval-samples", "2"]  # half the split, 2 samples: 0.56 -> 0.93 sampled
    command += ["--plot", "None", "--history", str(tmp_path / "history.json")]
    done = subprocess.run(command, cwd=ROOT, env=default_codegen_environ(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = json.loads((tmp_path / "history.json").read_text())
    assert after["step"] == 200
    assert after["sampled_success_all"] >= before["sampled_success_all"] + 0.2, (before, after)
    assert after["greedy_success_all"] >= before["greedy_success_all"] + 0.2
    # When: the calls rise on the sums the model cannot do and fall on those it can.
    assert after["sampled_calls_hard"] > before["sampled_calls_hard"] + 0.3
    assert after["sampled_calls_easy"] < before["sampled_calls_easy"] - 0.1
