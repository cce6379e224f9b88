"""Multi-process helpers: plain conversions in this one process, and a real run of two
processes (``tests/distributed_worker.py``, 4 CPU devices each, gloo between them) that
trains like this process does on its 8 devices."""

import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxrl_llm import distributed, sharding
from jaxrl_llm.sampling import SamplingConfig
from tests import distributed_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- One process: every helper is a plain conversion ---------------------------------------


def test_a_multi_process_run_without_a_mesh_over_every_device_or_with_its_own_backend_is_refused(monkeypatch):
    from jaxrl_llm import training

    config = training.TrainConfig(num_prompts=4, group_size=2, eval_every=2, sampling=SamplingConfig(max_new_tokens=2))
    training.loop.check_processes(config, None)  # one process: anything goes
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"spans 2 processes: pass a mesh over all their 8 devices"):
        training.loop.check_processes(config, None)
    with pytest.raises(ValueError, match=r"spans 2 processes: pass a mesh over all their 8 devices"):
        training.loop.check_processes(config, sharding.make_mesh(data=1, fsdp=4))
    training.loop.check_processes(config, sharding.make_mesh(data=2, fsdp=4))  # evaluations decode over it
    with pytest.raises(ValueError, match=r"cannot take its own `rollout` backend"):
        training.loop.check_processes(config, sharding.make_mesh(data=2, fsdp=4), custom_rollout=True)


def test_one_process_holds_every_row_and_the_helpers_convert_plainly():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert distributed.rows_sharding(mesh).spec == PartitionSpec(("data", "fsdp"))
    assert distributed.rows_sharding(sharding.make_mesh(4)).spec == PartitionSpec(("data",))
    assert distributed.local_rows(mesh, 8).tolist() == list(range(8))
    assert distributed.local_rows(mesh, 4, spec=PartitionSpec("data")).tolist() == list(range(4))
    assert distributed.is_main_process()

    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    tree = {"rows": x, "count": np.int32(5), "none": None}
    placed = distributed.global_array(
        tree, mesh, {"rows": PartitionSpec(("data", "fsdp")), "count": PartitionSpec(), "none": None}
    )
    assert placed["none"] is None and placed["count"].sharding.is_fully_replicated
    assert placed["rows"].sharding.spec == PartitionSpec(("data", "fsdp"))
    assert [s.data.shape for s in placed["rows"].addressable_shards] == [(2, 3)] * 8
    local = distributed.to_local(placed)
    np.testing.assert_array_equal(local["rows"], x)
    assert local["count"] == 5
    np.testing.assert_array_equal(distributed.gather(placed["rows"]), x)
    assert distributed.global_array(x, mesh).sharding == distributed.rows_sharding(mesh)

    total = jax.jit(jnp.sum)(placed["rows"])
    assert distributed.replicated_to_host({"total": total})["total"] == x.sum()
    with pytest.raises(ValueError, match="not whole on this process; use distributed.to_local"):
        distributed.replicated_to_host(placed["rows"])
    assert distributed.process_sum({"a": 2.0})["a"] == 2.0
    assert distributed.process_mean([np.ones(2)])[0].tolist() == [1, 1]
    with pytest.raises(ValueError, match="6 rows cannot be split evenly over 4 devices"):
        distributed.local_rows(mesh, 6)


def test_initialize_after_jax_started_says_so():
    jax.devices()  # this process's backends are running
    with pytest.raises(RuntimeError, match="must be called before any JAX calls"):
        distributed.initialize(coordinator_address="localhost:1", num_processes=2, process_id=0)


# --- Two processes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_workers(tmp_path, count: int = 2):
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    out.mkdir()
    checkpoints.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    port = _free_port()
    workers = []
    for i in range(count):
        log = open(tmp_path / f"process_{i}.log", "w+")
        command = [
            sys.executable,
            "-m",
            "tests.distributed_worker",
            "--process-id",
            str(i),
            "--num-processes",
            str(count),
            "--port",
            str(port),
            "--devices",
            "4",
            "--out",
            str(out),
            "--checkpoints",
            str(checkpoints),
        ]
        workers.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return workers, out


def _wait(workers, timeout_s: float) -> None:
    """Waits for every worker; fails with their logs (JAX's, not gloo's) when one fails or
    the time runs out, and stops the others (which would wait for it)."""
    deadline = time.monotonic() + timeout_s
    timed_out = True
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p, _ in workers]
            if None not in codes or any(code not in (None, 0) for code in codes):
                timed_out = False
                break
            time.sleep(0.2)
    finally:
        for p, _ in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
    try:
        if any(p.returncode != 0 for p, _ in workers):
            logs = []
            for i, (p, log) in enumerate(workers):
                log.seek(0)
                lines = [line for line in log.read().splitlines() if not line.startswith("[Gloo]")]
                logs.append(f"--- process {i} (exit {p.returncode}):\n" + "\n".join(lines[-60:]))
            why = f"did not finish in {timeout_s:.0f} s" if timed_out else "failed"
            pytest.fail(f"The two-process run {why}:\n" + "\n".join(logs))
    finally:
        for _, log in workers:
            log.close()


@pytest.mark.slow
def test_two_processes_train_like_one_process_on_as_many_devices(tmp_path):
    """Two processes of 4 CPU devices each, connected by ``distributed.initialize``, run
    two GRPO steps on an 8-device 2 x 2 x 2 mesh (data x FSDP x tensor; the CLI test
    below runs 2 x 4 x 1), each process feeding
    only its half of the batch: the same params, metrics, advantages and log-probs as
    this process's run of the same steps on its 8 devices; a checkpoint saved by both
    and restored by both is the state."""
    workers, out = _start_workers(tmp_path)
    try:  # this process's run meanwhile
        expected = {name: worker.run_steps(mesh_shape, rules) for name, (mesh_shape, rules) in worker.MESHES.items()}
    finally:
        _wait(workers, timeout_s=240)

    from jaxrl_llm import models

    initial = worker.flat_params(models.init(worker.model_config(), jax.random.key(0))[1])
    processes = [np.load(out / f"process_{i}.npz") for i in range(2)]
    for name, (state, _, local, history) in expected.items():
        got = np.load(out / f"params_{name}.npz")
        want = worker.flat_params(state.params)
        assert sorted(got.files) == sorted(want)
        moved = 0
        for path, value in want.items():
            np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=f"{name} {path}")
            moved += not np.allclose(value, initial[path])
        assert moved == len(want), f"{name}: {len(want) - moved} params did not change"
        for i, saved in enumerate(processes):
            rows = saved[f"{name}/rows"]
            # Process i's devices are the mesh's data slice i: the batch's i-th half.
            np.testing.assert_array_equal(rows, np.arange(i * worker.B // 2, (i + 1) * worker.B // 2))
            for field in ("advantages", "old_logp"):
                np.testing.assert_allclose(
                    saved[f"{name}/{field}"],
                    local[field][rows],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"{name} {field} of process {i}",
                )
            for step, metrics in enumerate(history):
                for key, value in metrics.items():
                    np.testing.assert_allclose(
                        saved[f"{name}/metric/{step}/{key}"],
                        value,
                        rtol=1e-5,
                        atol=1e-6,
                        err_msg=f"{name} step {step} {key} of process {i}",
                    )
            assert saved[f"{name}/restored"]


@pytest.mark.slow
def test_the_cli_trains_over_two_processes_like_one_and_only_process_0_writes(tmp_path):
    """``jaxrl-llm train`` in two processes of 4 CPU devices (``--coordinator-address
    --num-processes --process-id``, a ``--mesh.fsdp 4`` mesh over both), evaluating after
    step 2: the records and checkpoints of the same run in this process on its 8 devices,
    written once."""
    import json

    from jaxrl_llm import cli
    from jaxrl_llm.runs import run as runs

    flags = [
        "--config",
        "tiny",
        "--steps",
        "2",
        "--save-every",
        "1",
        "--mesh.fsdp",
        "4",
        "--train.num-prompts",
        "4",
        "--train.eval-every",
        "2",
        "--tensorboard",
        "False",
        "--progress",
        "off",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": ROOT}
    port = _free_port()
    workers = []
    for i in range(2):
        log = open(tmp_path / f"cli_{i}.log", "w+")
        command = [
            sys.executable,
            "-m",
            "jaxrl_llm",
            "train",
            *flags,
            "--run-dir",
            str(tmp_path / "two"),
            "--coordinator-address",
            f"localhost:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        ]
        workers.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        args, config = cli.parse_train([*flags, "--run-dir", str(tmp_path / "one")])
        runs.train_run(config, args.run_dir, progress=False, stream=None)
    finally:
        _wait(workers, timeout_s=240)

    def records(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    two, one = records(tmp_path / "two"), records(tmp_path / "one")
    assert [row["step"] for row in two] == [0, 1]  # one line per step: process 1 wrote none
    for got, want in zip(two, one):
        for name in ("reward", "loss", "kl_k3", "grad_norm", "completion_length"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    evaluated = [name for name in two[1] if name.startswith("eval_") and name != "eval_seconds"]
    assert {"eval_greedy_accuracy", "eval_reward", "eval_pass@2"} <= set(evaluated) and "eval_reward" not in two[0]
    for name in evaluated:
        np.testing.assert_allclose(two[1][name], one[1][name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    logs = [(tmp_path / f"cli_{i}.log").read_text() for i in range(2)]
    assert "train steps recorded" in logs[0] and "train steps recorded" not in logs[1]
