"""Checkpoints: exact round trips, resumption, keep-last-K, corrupt and partial checkpoints,
verification (digests, finiteness), resharding."""

import functools
import json
import os
import pathlib
import shutil

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm import algorithms, models, training
from jaxrl_llm.training import checkpoint
from jaxrl_llm.training.checkpoint import Checkpointer
from tests.training.test_step import CONFIG, RUN, TASK

# A failed orbax restore leaves its other reads' asyncio tasks behind; they surface later, in any test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@functools.cache
def _trained(name: str, steps: int):
    """A state after ``steps`` real train steps (cached: each test gets a fresh copy)."""
    model, params = models.init(CONFIG, jax.random.key(0))
    state, _ = training.train(model, params, getattr(algorithms, name), RUN, steps=steps, task=TASK)
    return model, params, jax.device_get(state._replace(key=jax.random.key_data(state.key)))


def _state(name: str, steps: int = 1):
    model, params, host = _trained(name, steps)
    state = jax.tree.map(jax.numpy.asarray, host._replace(key=None))._replace(
        key=jax.random.wrap_key_data(jax.numpy.asarray(host.key))
    )
    return model, params, state


def _abstract(model, params, name):
    return jax.eval_shape(lambda p: training.init_state(model, p, getattr(algorithms, name), RUN), params)


def _assert_identical(a, b):
    assert a.key.dtype == b.key.dtype
    np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))
    a, b = a._replace(key=None), b._replace(key=None)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)  # bitwise (NaN-free states)


@pytest.mark.parametrize("name", ["GRPO", "PPO"])
def test_a_trained_state_round_trips_exactly(tmp_path, name):
    model, params, state = _state(name)
    assert (state.critic_params is None) == (name == "GRPO")
    with Checkpointer(tmp_path / "run") as checkpoints:
        checkpoints.save(1, state, metadata={"reward": 0.5})
        assert checkpoints.latest_step() == 1 and checkpoints.metadata() == {"reward": 0.5}
        restored = checkpoints.restore(like=_abstract(model, params, name))
        _assert_identical(restored, state)
        assert type(restored.opt_state) is training.optim.Float32State
        # A real state works as `like` too.
        _assert_identical(checkpoints.restore(1, like=state), state)


def test_a_run_continued_from_a_checkpoint_is_the_uninterrupted_run(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    restored = checkpoints.restore(like=_abstract(model, params, "GRPO"))
    straight, _ = training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK, state=state)
    resumed, _ = training.train(model, params, algorithms.GRPO, RUN, steps=1, task=TASK, state=restored)
    _assert_identical(resumed, straight)
    assert int(resumed.step) == 2


def test_keeps_the_last_k_and_refuses_to_overwrite(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, state._replace(step=jax.numpy.asarray(step, jax.numpy.int32)), wait=step != 3)
    checkpoints.wait()
    assert checkpoints.all_steps() == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    assert int(checkpoints.restore(2, like=state).step) == 2
    with pytest.raises(ValueError, match="already has a checkpoint of step 3"):
        checkpoints.save(3, state)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    checkpoints.save(2, state._replace(step=state.step + 1))
    os.remove(tmp_path / "2" / "state" / "manifest.ocdbt")  # its arrays can no longer be found
    like = _abstract(model, params, "GRPO")
    with pytest.warns(UserWarning, match="checkpoint 2: .*falling back to checkpoint 1"):
        restored = checkpoints.restore(like=like)
    _assert_identical(restored, state)
    with pytest.raises(RuntimeError, match="checkpoint 2: ValueError: NOT_FOUND"):  # a given step: no fallback
        checkpoints.restore(2, like=like)
    shutil.rmtree(tmp_path / "1" / "state")
    with (
        pytest.warns(UserWarning),
        pytest.raises(RuntimeError, match="no readable checkpoint.*checkpoint 2: .*checkpoint 1: "),
    ):
        checkpoints.restore(like=like)


def stored_arrays(step_dir) -> dict[str, np.ndarray]:
    """What orbax's plain restore (which verifies nothing) reads from checkpoint ``step_dir``, by path."""
    with ocp.StandardCheckpointer() as reader:
        tree = reader.restore(pathlib.Path(step_dir).absolute() / "state")
    return {"/".join(names): np.asarray(leaf) for names, leaf in zip(checkpoint._paths(tree), jax.tree.leaves(tree))}


def flip_bytes(step_dir) -> str:
    """Flips 16 bytes of the largest data file of checkpoint ``step_dir`` (zstd-compressed
    chunks, without checksums of their own) where that makes one stored array read back with
    other, finite values and no error; returns its path."""
    saved = stored_arrays(step_dir)
    data = max(
        (p for p in pathlib.Path(step_dir, "state").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    original = data.read_bytes()
    for offset in range(len(original) // 2, len(original) - 16, 997):
        flipped = bytearray(original)
        flipped[offset : offset + 16] = bytes(byte ^ 0xFF for byte in original[offset : offset + 16])
        data.write_bytes(flipped)
        try:
            read = stored_arrays(step_dir)
        except Exception:  # noqa: BLE001 (this flip breaks the decoding: an unreadable checkpoint; try another)
            continue
        changed = [path for path in saved if not np.array_equal(read[path], saved[path])]
        if len(changed) == 1 and np.isfinite(read[changed[0]]).all():
            return changed[0]
    data.write_bytes(original)
    pytest.fail(f"no flip of 16 bytes in {data} changed one array to finite values")


def strip_digests(step_dir) -> None:
    """Checkpoint ``step_dir`` as saved before checkpoints recorded digests."""
    path = pathlib.Path(step_dir, "_CHECKPOINT_METADATA")
    metadata = json.loads(path.read_text())
    metadata["custom_metadata"]["jaxrl_llm"].pop("digests", None)
    path.write_text(json.dumps(metadata))


def test_flipped_bytes_in_the_data_fail_the_checksum_and_the_previous_checkpoint_is_restored(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    checkpoints.save(2, state._replace(step=state.step + 1))
    leaf = flip_bytes(tmp_path / "2")  # read without verification, one array has other values
    like = _abstract(model, params, "GRPO")
    with pytest.warns(
        UserWarning, match=f"checkpoint 2: ValueError: checksum mismatch in {leaf}: .*falling back to checkpoint 1"
    ):
        restored = checkpoints.restore(like=like)
    _assert_identical(restored, state)
    assert list(checkpoints.skipped) == [2] and leaf in checkpoints.skipped[2]
    with pytest.raises(RuntimeError, match=f"checkpoint 2: ValueError: checksum mismatch in {leaf}"):
        checkpoints.restore(2, like=like)  # a given step: an error, not its data


def test_a_state_with_non_finite_values_is_not_saved_and_the_good_checkpoint_stays(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path, max_to_keep=1)
    checkpoints.save(1, state)
    leaves, tree = jax.tree.flatten(state.params)
    poisoned = state._replace(
        step=state.step + 1,
        params=jax.tree.unflatten(tree, [leaves[0].at[(0,) * leaves[0].ndim].set(jax.numpy.nan), *leaves[1:]]),
    )
    name = checkpoint._paths(state.params)[0]
    with pytest.raises(
        ValueError,
        match=rf"state of step 2 has non-finite values in params/{'/'.join(name)} "
        r"\(1 of \d+ entries\); not saved",
    ):
        checkpoints.save(2, poisoned, wait=False)
    assert checkpoints.all_steps() == [1] and os.listdir(tmp_path) == ["1"]  # nothing written, nothing rotated
    _assert_identical(checkpoints.restore(like=state), state)


def test_a_checkpoint_saved_without_digests_restores_and_is_checked_for_finite_values(tmp_path, monkeypatch):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    strip_digests(tmp_path / "1")
    like = _abstract(model, params, "GRPO")
    _assert_identical(Checkpointer(tmp_path).restore(like=like), state)
    # A NaN saved before saves were checked: its restore finds it.
    leaves, tree = jax.tree.flatten(state.params)
    poisoned = state._replace(
        step=state.step + 1,
        params=jax.tree.unflatten(tree, [leaves[0].at[(0,) * leaves[0].ndim].set(jax.numpy.nan), *leaves[1:]]),
    )
    with monkeypatch.context() as patch:
        patch.setattr(
            checkpoint, "_checks", lambda flat: {"/".join(names): ("", 0) for names in flat}, raising=False
        )  # the save as it was
        checkpoints.save(2, poisoned)
    strip_digests(tmp_path / "2")
    checkpoints = Checkpointer(tmp_path)
    name = "/".join(checkpoint._paths(state.params)[0])
    with pytest.warns(
        UserWarning,
        match=rf"checkpoint 2: ValueError: non-finite values in params/{name} "
        r"\(1 of \d+ entries\); falling back to checkpoint 1",
    ):
        _assert_identical(checkpoints.restore(like=like), state)
    with pytest.raises(RuntimeError, match=rf"checkpoint 2: ValueError: non-finite values in params/{name}"):
        checkpoints.restore(2, like=like)


def test_a_partially_written_checkpoint_is_not_the_latest(tmp_path):
    model, params, state = _state("GRPO")
    Checkpointer(tmp_path).save(1, state)
    # What a crash during the save of step 2 leaves: the checkpoint under its temporary name.
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-1700000000")
    checkpoints = Checkpointer(tmp_path)
    assert checkpoints.latest_step() == 1 and checkpoints.all_steps() == [1]
    assert int(checkpoints.restore(like=state).step) == int(state.step)


def test_missing_directory_and_mismatched_structure_are_clear_errors(tmp_path):
    model, params, state = _state("GRPO")
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        Checkpointer(tmp_path / "nowhere").restore(like=state)
    assert not (tmp_path / "nowhere").exists() and Checkpointer(tmp_path / "nowhere").latest_step() is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer(tmp_path).restore(like=state)
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 .*complete: \[1\]"):
        checkpoints.restore(5, like=state)
    # A PPO state (with a critic) is not what a GRPO checkpoint holds.
    with pytest.raises(ValueError, match=r"`checkpoint 1` does not fit `like`: it lacks \['critic_opt_state'\]"):
        checkpoints.restore(like=_abstract(model, params, "PPO"))
    wider = jax.eval_shape(lambda: state._replace(baseline=jax.tree.map(lambda x: x.astype("float16"), state.baseline)))
    with pytest.raises(
        ValueError,
        match=r"`checkpoint 1\['baseline'\]\['count'\]` is \[\] int32, but `like` "
        r"needs \[\] float16",
    ):
        checkpoints.restore(like=wider)


def test_restores_an_unsharded_checkpoint_onto_a_mesh(tmp_path):
    model, params, state = _state("GRPO")
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, state)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))

    def spec(x):
        return jax.sharding.PartitionSpec("fsdp") if x.ndim and x.shape[0] % 2 == 0 else jax.sharding.PartitionSpec()

    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec(x))),
        _abstract(model, params, "GRPO"),
    )
    restored = checkpoints.restore(like=like)
    _assert_identical(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
        assert got.sharding == want.sharding
    assert any(leaf.sharding.spec == jax.sharding.PartitionSpec("fsdp") for leaf in jax.tree.leaves(restored.params))
