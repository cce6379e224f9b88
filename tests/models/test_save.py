"""Saving checkpoints: what a save over a directory keeps, recovery after saves killed at any
point, permissions, and paths (".", "..", symlinks).

Killed saves run in forked children: real processes that die mid-save (``os._exit`` at a
chosen point, or SIGKILL at a random moment) and whose pid is then dead. The children save
numpy parameters, so they touch files only, never the JAX runtime that makes fork unsafe.
"""

import contextlib
import itertools
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import stat
import time
import traceback
import warnings

import chex
import jax
import numpy as np
import pytest
import safetensors.numpy

from jaxrl_llm import models
from jaxrl_llm.models import hf as hf_io
from jaxrl_llm.models import staging as staging_io

CONFIG = models.ModelConfig(
    vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8
)
THREE_SHARDS = 10_000  # max_shard_bytes that splits CONFIG's 25 kB of weights over three files
CRASHED = 3  # a child's exit code at its crash point


@pytest.fixture(scope="module")
def tiny():
    """The model and three parameter sets (numpy leaves) that differ in every tensor."""
    model, params = models.init(CONFIG, jax.random.key(0))
    return model, [jax.tree.map(lambda x, i=i: np.asarray(x) + i, params) for i in range(3)]


def assert_saved(path, params):
    _, loaded = models.from_pretrained(path)
    chex.assert_trees_all_equal(loaded, params)


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def hidden(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def fork():
    """``fork(child)`` runs ``child()`` in a forked process and returns its pid (exit code 0 when
    it returns). Children still running when the test ends are killed."""
    pids = []

    def start(child) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # JAX and Python warn that fork and threads mix badly
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
        return pid

    yield start
    for pid in pids:
        with contextlib.suppress(ChildProcessError):  # reaped by the test
            if os.waitpid(pid, os.WNOHANG) == (0, 0):  # unreaped, so the pid is still this child's
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def wait(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def die_at(point: str) -> None:
    """Makes this (child) process exit on the spot, without cleaning up, at ``point`` of its next save."""
    if point == "writing":
        hf_io.save_file = lambda *args, **kwargs: os._exit(CRASHED)
    elif point == "between_renames":  # target -> aside done, staging -> target not yet
        replace, calls = os.replace, []

        def dying(*args):
            calls.append(args)
            if len(calls) == 2:
                os._exit(CRASHED)
            replace(*args)

        os.replace = dying
    else:  # after both renames, before the old directory is removed
        assert point == "after_renames"
        shutil.rmtree = lambda *args, **kwargs: os._exit(CRASHED)


# --- What a save over a directory keeps ----------------------------------------------------------


def test_a_save_replaces_only_the_previous_checkpoints_files(tiny, tmp_path):
    model, (v0, v1, v2) = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, v0)
    critic = {"value_head": np.arange(6, dtype=np.float32).reshape(2, 3)}
    safetensors.numpy.save_file(critic, target / "critic.safetensors")
    (target / "tokenizer.json").write_text('{"model": "chars"}')
    assert_saved(target, v0)  # the loader reads model.safetensors, not the critic beside it

    models.save_pretrained(target, model, v1)  # one file over one file
    assert {p.name for p in target.iterdir()} == {
        "config.json",
        "model.safetensors",
        "critic.safetensors",
        "tokenizer.json",
    }
    models.save_pretrained(target, model, v1, max_shard_bytes=THREE_SHARDS)  # one file -> shards
    shards = set(json.loads((target / hf_io.INDEX_FILE).read_text())["weight_map"].values())
    assert len(shards) == 3
    assert {p.name for p in target.iterdir()} == {
        "config.json",
        hf_io.INDEX_FILE,
        "critic.safetensors",
        "tokenizer.json",
    } | shards
    assert_saved(target, v1)

    models.save_pretrained(target, model, v2)  # shards -> one file: the old index and its shards go
    assert {p.name for p in target.iterdir()} == {
        "config.json",
        "model.safetensors",
        "critic.safetensors",
        "tokenizer.json",
    }
    np.testing.assert_array_equal(
        safetensors.numpy.load_file(target / "critic.safetensors")["value_head"], critic["value_head"]
    )
    assert (target / "tokenizer.json").read_text() == '{"model": "chars"}'
    assert_saved(target, v2)
    assert hidden(tmp_path) == []


# --- Interrupted saves ---------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["writing", "between_renames", "after_renames"])
def test_a_save_killed_at_any_point_is_recovered_by_the_next_load_and_save(tiny, fork, tmp_path, point):
    model, (v0, v1, v2) = tiny
    first, second = tmp_path / "first", tmp_path / "second"
    target = first / "ckpt"
    models.save_pretrained(target, model, v0)
    (target / "tokenizer.json").write_text("{}")

    def child():
        die_at(point)
        models.save_pretrained(target, model, v1)

    assert wait(fork(child)) == CRASHED
    assert hidden(first)  # leftovers of the dead save
    assert target.exists() == (point != "between_renames")
    shutil.copytree(first, second, symlinks=True)  # the same wreck twice: one for each recovery

    # The next load: the last complete checkpoint, and nothing left over.
    assert_saved(target, v1 if point == "after_renames" else v0)
    assert (target / "tokenizer.json").exists() and hidden(first) == []

    # The next save: over the last complete checkpoint, so its other files are kept.
    models.save_pretrained(second / "ckpt", model, v2)
    assert_saved(second / "ckpt", v2)
    assert (second / "ckpt" / "tokenizer.json").exists() and hidden(second) == []


@pytest.mark.parametrize("after_first", [False, True])
def test_a_save_that_fails_between_its_renames_puts_the_previous_checkpoint_back(
    tiny, tmp_path, monkeypatch, after_first
):
    # Interrupted as the swap starts (staging -> target fails) or just after the old
    # directory went aside (the first rename done, then Ctrl-C).
    model, (v0, v1, _) = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, v0)
    replace, calls = os.replace, []

    def failing(*args):
        calls.append(args)
        if after_first and len(calls) == 1:  # target -> aside, then an interrupt
            replace(*args)
            raise KeyboardInterrupt
        if len(calls) == 2 and not after_first:  # staging -> target
            raise KeyboardInterrupt
        replace(*args)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(KeyboardInterrupt):
        models.save_pretrained(target, model, v1)
    monkeypatch.undo()
    assert len(calls) == (2 if after_first else 3)  # target aside, (the failed swap,) target back
    assert hidden(tmp_path) == []
    assert_saved(target, v0)


@pytest.mark.parametrize("point", ["writing", "between_renames"])
def test_leftovers_of_a_running_save_are_left_alone(tiny, fork, tmp_path, point):
    model, (v0, v1, v2) = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, v0)
    paused_r, paused_w = os.pipe()
    resume_r, resume_w = os.pipe()

    def child():
        os.close(paused_r)
        os.close(resume_w)  # so that the child sees the end of the pipe if the test dies

        def pause():
            os.write(paused_w, b"p")
            os.read(resume_r, 1)

        if point == "writing":
            save_file = hf_io.save_file
            hf_io.save_file = lambda *args, **kwargs: (pause(), save_file(*args, **kwargs))
        else:
            replace, calls = os.replace, []

            def pausing(*args):
                calls.append(args)
                if len(calls) == 2:
                    pause()
                replace(*args)

            os.replace = pausing
        models.save_pretrained(target, model, v1)

    pid = fork(child)
    os.close(paused_w)
    os.close(resume_r)
    assert os.read(paused_r, 1) == b"p"  # the child is mid-save
    leftovers = hidden(tmp_path)
    assert leftovers
    if point == "writing":
        assert_saved(target, v0)
        models.save_pretrained(target, model, v2)  # a concurrent save
        assert_saved(target, v2)
    else:  # the running save holds the checkpoint aside: a load finds nothing and restores nothing
        with pytest.raises(FileNotFoundError, match="does not exist"):
            models.from_pretrained(target)
    assert hidden(tmp_path) == leftovers
    os.write(resume_w, b"r")
    os.close(resume_w)
    os.close(paused_r)
    assert wait(pid) == 0
    assert_saved(target, v1)
    assert hidden(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times come from Linux /proc")
def test_leftovers_are_told_apart_by_host_and_process(tiny, fork, tmp_path):
    model, (v0, v1, _) = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, v0)

    def child():
        die_at("writing")
        models.save_pretrained(target, model, v1)

    assert wait(fork(child)) == CRASHED
    [staging] = hidden(tmp_path)
    prefix = f".ckpt.saving.{socket.gethostname()}."
    assert staging.startswith(prefix)
    namespace, pid, start, suffix = staging.removeprefix(prefix).split(".")
    host = socket.gethostname()
    kept = [
        f".ckpt.saving.elsewhere.{namespace}.{pid}.{start}.{suffix}",  # another host
        f".ckpt.saving.{host}.1{namespace}.{pid}.{start}.{suffix}",  # another pid namespace
        f".ckpt.saving.{host}.{namespace}.{os.getpid()}.{staging_io.start_time(os.getpid())}.{suffix}",  # running
    ]
    reused = f".ckpt.saving.{host}.{namespace}.{os.getpid()}.1.{suffix}"  # an earlier process with this pid
    for name in [*kept, reused]:
        shutil.copytree(tmp_path / staging, tmp_path / name)
    assert_saved(target, v0)
    assert hidden(tmp_path) == sorted(kept)


def test_saves_killed_at_random_moments_leave_a_complete_checkpoint(tiny, fork, tmp_path):
    model, variants = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, variants[0])
    log = tmp_path / "saves.log"
    rng = random.Random(0)

    def child():
        for i in itertools.count(1):
            models.save_pretrained(target, model, variants[i % len(variants)])
            with open(log, "a") as f:
                f.write(".")

    for kills in itertools.count(1):
        pid = fork(child)
        time.sleep(rng.uniform(0.005, 0.05))
        os.kill(pid, signal.SIGKILL)
        assert wait(pid) == -signal.SIGKILL
        _, loaded = models.from_pretrained(target)
        assert any(same(loaded, v) for v in variants)
        if (kills >= 8 and log.exists()) or kills == 30:
            break
    assert log.exists()  # some children completed saves: the kills came at any point of the loop
    models.save_pretrained(target, model, variants[0])
    assert hidden(tmp_path) == []
    assert_saved(target, variants[0])


# --- Permissions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_permissions_follow_the_umask(tiny, tmp_path, umask):
    model, (v0, v1, _) = tiny
    target = tmp_path / "ckpt"
    previous = os.umask(umask)
    try:
        models.save_pretrained(target, model, v0)
        models.save_pretrained(target, model, v1, max_shard_bytes=THREE_SHARDS)  # over it, sharded
        assert os.umask(umask) == umask  # reading it left it as it was
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert len(modes) == 5 and modes == dict.fromkeys(modes, 0o666 & ~umask)


# --- Paths ---------------------------------------------------------------------------------------


def test_saving_into_the_working_directory_keeps_it_usable(tiny, tmp_path, monkeypatch):
    model, (v0, v1, v2) = tiny
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    models.save_pretrained(".", model, v0)
    models.save_pretrained(".", model, v1)  # over a checkpoint: the directory is swapped
    assert pathlib.Path.cwd().samefile(work) and pathlib.Path("notes.txt").read_text() == "keep"
    assert_saved(".", v1)
    os.chdir("sub")
    models.save_pretrained("..", model, v2)  # from a directory inside it
    assert pathlib.Path.cwd().samefile(work / "sub")
    pathlib.Path("here.txt").write_text("x")  # the working directory is the live one
    assert (work / "sub" / "here.txt").exists()
    assert_saved(work, v2)
    assert hidden(tmp_path) == []


def test_dot_dot_and_symlinked_directories_are_resolved(tiny, tmp_path, monkeypatch):
    model, (v0, v1, _) = tiny
    monkeypatch.chdir(tmp_path)
    models.save_pretrained("x/y/..", model, v0)
    assert_saved(tmp_path / "x", v0)
    assert not (tmp_path / "x" / "y").exists()

    (tmp_path / "real").mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to("real", target_is_directory=True)
    models.save_pretrained(link, model, v0)
    models.save_pretrained(link, model, v1)
    assert link.is_symlink() and os.readlink(link) == "real"
    assert_saved(tmp_path / "real", v1)
    assert_saved(link, v1)
    assert hidden(tmp_path) == []

    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        models.save_pretrained(tmp_path / "file", model, v0)


def test_symlinks_inside_the_directory_are_carried_as_symlinks(tiny, tmp_path):
    model, (v0, v1, _) = tiny
    target = tmp_path / "ckpt"
    models.save_pretrained(target, model, v0)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data.bin").write_bytes(b"data")
    (tmp_path / "vocab.txt").write_text("a b c")
    links = {
        "shared": "../shared",
        "vocab.txt": "../vocab.txt",
        "dangling": "../nowhere",
        "sub/vocab.txt": "../../vocab.txt",
    }
    (target / "sub").mkdir()
    for name, destination in links.items():
        (target / name).symlink_to(destination)
    models.save_pretrained(target, model, v1)
    assert {name: os.readlink(target / name) for name in links} == links
    assert (target / "shared" / "data.bin").read_bytes() == b"data"
    assert_saved(target, v1)
