"""A run killed with SIGKILL and resumed ends exactly where the uninterrupted run does.

Each run is a real ``jaxrl-llm train`` process on the ``tiny`` config. The reference runs
to the end; the other is killed (SIGKILL: no handler, no cleanup) once it has saved a
checkpoint and before its last step, then resumed with ``--resume``. Its final
parameters must be bitwise equal to the reference's and every line of ``metrics.jsonl``
equal, timings aside: the prompts, keys and counters all live in the checkpointed state.
"""

import json
import os
import signal
import subprocess
import sys
import time

import chex
import numpy as np
import pytest

from jaxrl_llm import runs
from jaxrl_llm.runs import run

STEPS = 8


def command(run_dir, *flags):
    return [sys.executable, "-m", "jaxrl_llm", "train", "--config", "tiny", "--run-dir", str(run_dir),
            "--steps", str(STEPS), "--progress", "off", *flags]


def environment(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXRL_LLM_COMPILATION_CACHE=str(tmp_path / "xla-cache"))
    env.pop("XLA_FLAGS", None)
    return env


def without_timings(rows):
    return [{k: v for k, v in row.items() if not run.is_timing(k)} for row in rows]


def complete_checkpoints(run_dir):
    directory = run_dir / run.CHECKPOINTS
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_params_and_metrics(tmp_path):
    env = environment(tmp_path)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(command(reference), env=env, check=True, capture_output=True, timeout=600)

    process = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while not complete_checkpoints(killed) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    saved = complete_checkpoints(killed)
    assert saved and saved[-1] < STEPS, (saved, process.stderr.read().decode()[-2000:])
    logged = runs.read_metrics(killed)
    assert len(logged) < STEPS  # it was stopped before the end

    resumed = subprocess.run(command(killed, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from its checkpoint of step {saved[-1]}" in resumed.stdout

    expected, got = runs.read_metrics(reference), runs.read_metrics(killed)
    assert [row["step"] for row in got] == list(range(STEPS))
    assert without_timings(got) == without_timings(expected)
    assert any("eval_greedy_accuracy" in row for row in got)
    *_, reference_params, reference_step = runs.restore_policy(reference)
    *_, resumed_params, resumed_step = runs.restore_policy(killed)
    assert reference_step == resumed_step == STEPS
    chex.assert_trees_all_equal(resumed_params, reference_params)  # bitwise
    samples = [row["step"] for row in runs.read_samples(killed)]
    assert samples == sorted(samples) and len(samples) == len(set(samples)) * 2 * 2  # 2 prompts x 2 completions
    assert json.loads((killed / run.CONFIG_FILE).read_text()) == json.loads((reference / run.CONFIG_FILE).read_text())
    assert np.isfinite([row["reward"] for row in got]).all()
