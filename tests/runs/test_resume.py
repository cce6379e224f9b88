"""A run killed with SIGKILL, resumed, interrupted with SIGINT and resumed again ends
exactly where the uninterrupted run does.

Each run is a real ``jaxrl-llm train`` process on the ``tiny`` config. The reference runs
to the end; the other is killed (SIGKILL: no handler, no cleanup) once it has saved a
checkpoint and logged a step after it, resumed with ``--resume``, stopped by SIGINT
(Ctrl-C: it saves a checkpoint and exits with status 130) and resumed again. Its final
parameters must be bitwise equal to the reference's and every line of ``metrics.jsonl``
equal, timings aside: the prompts, keys and counters all live in the checkpointed state.
"""

import dataclasses
import io
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
from jaxrl_llm.runs import policy, run
from jaxrl_llm.runs.config import absolute_paths
from jaxrl_llm.runs.directory import CHECKPOINTS, CONFIG_FILE, stored_config
from jaxrl_llm.runs.records import is_timing

STEPS = 12


def command(run_dir, *flags):
    return [
        sys.executable,
        "-m",
        "jaxrl_llm",
        "train",
        "--config",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--progress",
        "off",
        *flags,
    ]


def environment():
    """The suite's environment (its quick code generation and session compilation cache): the
    runs compared are all started with it, and the later ones load what the first compiled."""
    return dict(os.environ, JAX_PLATFORMS="cpu")


def without_timings(rows):
    return [{k: v for k, v in row.items() if not is_timing(k)} for row in rows]


def complete_checkpoints(run_dir):
    directory = run_dir / CHECKPOINTS
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def short_tiny(*, steps: int):
    """The ``tiny`` config for ``steps`` steps, saving every 2, with a 2-step warm start and no
    evaluations: a whole run in a few seconds."""
    tiny = runs.load("tiny")
    return dataclasses.replace(
        tiny,
        steps=steps,
        save_every=2,
        warm_start=dataclasses.replace(tiny.warm_start, steps=2),
        train=dataclasses.replace(tiny.train, eval_every=0),
    )


def stop_after_a_checkpoint(process, run_dir, sig, since=0):
    """Sends ``sig`` once a checkpoint after step ``since`` exists in ``run_dir`` and a step
    after it is logged; returns the exit status."""
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        saved = [s for s in complete_checkpoints(run_dir) if s > since]
        if saved and len(runs.read_metrics(run_dir)) > saved[-1]:
            break
        time.sleep(0.01)
    os.kill(process.pid, sig)
    return process.wait(timeout=600)


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_params_and_metrics(tmp_path):
    env = environment()
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(command(reference), env=env, check=True, capture_output=True, timeout=600)

    process = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert stop_after_a_checkpoint(process, killed, signal.SIGKILL) == -signal.SIGKILL
    saved = complete_checkpoints(killed)
    assert saved and saved[-1] < STEPS, (saved, process.stderr.read().decode()[-2000:])
    assert saved[-1] < len(runs.read_metrics(killed)) < STEPS  # logged a step it had not saved; not at the end

    process = subprocess.Popen(
        command(killed, "--resume"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert stop_after_a_checkpoint(process, killed, signal.SIGINT, since=saved[-1]) == 130
    out, err = process.communicate()
    assert f"from its checkpoint of step {saved[-1]}" in out
    interrupted = complete_checkpoints(killed)[-1]
    assert interrupted < STEPS and "interrupted" in err and f"checkpoint of step {interrupted}" in out, err[-2000:]
    assert [row["step"] for row in runs.read_metrics(killed)] == list(range(interrupted))  # saved what it logged

    resumed = subprocess.run(command(killed, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from its checkpoint of step {interrupted}" in resumed.stdout

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
    assert json.loads((killed / CONFIG_FILE).read_text()) == json.loads((reference / CONFIG_FILE).read_text())
    assert np.isfinite([row["reward"] for row in got]).all()


@pytest.mark.slow
def test_a_run_continues_on_another_mesh_where_the_single_device_run_goes(tmp_path):
    """Two steps FSDP over 4 devices, saved; two more on a 2 x 2 (data x fsdp) mesh, the
    checkpoint restored into that mesh's shards: the metrics of four steps on one device."""
    config = short_tiny(steps=4)
    expected = run.train_run(config, tmp_path / "one", progress=False, stream=None).history
    run.train_run(
        dataclasses.replace(config, steps=2, mesh=runs.MeshSpec(data=1, fsdp=4)),
        tmp_path / "moved",
        progress=False,
        stream=None,
    )
    continued = run.train_run(
        dataclasses.replace(config, mesh=runs.MeshSpec(data=2, fsdp=2)), tmp_path / "moved", progress=False, stream=None
    )
    q_proj = continued.state.params["layers"][0]["self_attn"]["q_proj"][...]
    assert tuple(q_proj.sharding.spec)[:1] == ("fsdp",) and len(q_proj.sharding.device_set) == 4
    rows = runs.read_metrics(tmp_path / "moved")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for got, want in zip(rows, runs.read_metrics(tmp_path / "one")):
        for name in ("reward", "loss", "kl_k3", "grad_norm"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=f"{got['step']} {name}")
    assert len(expected) == 4


def test_a_checkpoint_with_a_reference_the_run_no_longer_keeps_still_restores(tmp_path):
    """A method without a KL term keeps no reference now; its checkpoints saved with one
    (before, or with reference_metrics) restore, the reference dropped."""
    import jax

    from jaxrl_llm import algorithms, models, training

    model, params = models.init(
        models.ModelConfig(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4
        ),
        jax.random.key(0),
    )
    config = training.TrainConfig()
    state = training.init_state(model, params, algorithms.DAPO, config)._replace(step=jax.numpy.asarray(3, "int32"))
    with training.Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(3, policy.checkpointed(state, params))  # as a run that kept a reference saved it
        abstract = jax.eval_shape(lambda p: training.init_state(model, p, algorithms.DAPO, config), params)
        like = policy.checkpointed(abstract, None)
        with pytest.raises(ValueError, match="ref_params"):
            checkpointer.restore(like=like)
        state, reference = policy.restore_checkpoint(checkpointer, like)
    assert reference is None and int(state.step) == 3
    chex.assert_trees_all_equal(state.params, params)


@pytest.mark.slow
def test_a_run_stored_with_flat_train_settings_resumes(tmp_path):
    """A run directory with the flat layout stores ``train.temperature``,
    ``train.learning_rate``, ... in ``[train]`` itself: it loads to the same config and the
    same command continues it."""
    config = short_tiny(steps=2)
    run.train_run(config, tmp_path / "run", progress=False, stream=None)
    path = tmp_path / "run" / CONFIG_FILE
    stored = json.loads(path.read_text())
    train = stored["train"]
    stored["train"] = {
        **{k: v for k, v in train.items() if k not in ("sampling", "optimizer")},
        **train["sampling"],
        **train["optimizer"],
    }  # the layout before the groups
    assert "temperature" in stored["train"] and "learning_rate" in stored["train"]
    path.write_text(json.dumps(stored))
    assert stored_config(tmp_path / "run") == absolute_paths(config)
    continued = run.train_run(
        dataclasses.replace(config, steps=4), tmp_path / "run", resume=True, progress=False, stream=None
    )
    assert [row["step"] for row in runs.read_metrics(tmp_path / "run")] == [0, 1, 2, 3]
    assert len(continued.history) == 2 and int(continued.state.step) == 4


@pytest.mark.slow
def test_a_complete_run_killed_after_logging_unsaved_steps_sums_up_its_checkpoint(tmp_path):
    """A run SIGKILLed after logging steps it had not saved, continued with ``--steps`` no
    larger than its checkpoint: the summary counts the checkpoint's steps, not the lines the
    killed run left after them."""
    config = short_tiny(steps=2)
    run.train_run(config, tmp_path / "run", progress=False, stream=None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    last = json.loads(metrics.read_text().splitlines()[-1])
    with metrics.open("a") as file:  # steps 2 and 3, logged before the kill, in no checkpoint
        file.writelines(json.dumps({**last, "step": step}) + "\n" for step in (2, 3))
    printed = io.StringIO()
    done = run.train_run(config, tmp_path / "run", resume=True, progress=False, stream=printed)
    assert "is complete: its latest checkpoint holds 2 steps (--steps 2)" in printed.getvalue()
    assert "2 train steps recorded (steps 0 to 1)" in done.summary, done.summary
