"""The run directory: only a run's own files are ever replaced, one process trains in it at
a time, a start that completed no step is not a run yet, and a full or read-only disk is
reported in a few lines that say what is intact and how to go on."""

import errno
import json
import os
import subprocess
import sys

import pytest

from jaxrl_llm import cli, rewards, runs, training
from jaxrl_llm.runs import records, run
from jaxrl_llm.runs.config import to_dict
from jaxrl_llm.runs.directory import (
    CHECKPOINTS,
    CONFIG_FILE,
    LOCK_FILE,
    MARKER_FILE,
    RunDirectoryError,
    check_run_directory,
    clear,
    has_completed_step,
    locked,
    storage_failure,
)
from jaxrl_llm.runs.export import export_run


def _fake_run(directory, *, steps=True):
    """A run directory as a run leaves it (its files without their content), with a
    completed step or not."""
    directory.mkdir(parents=True)
    (directory / MARKER_FILE).write_text("")
    (directory / CONFIG_FILE).write_text(json.dumps(to_dict(runs.load("tiny"))))
    (directory / CHECKPOINTS).mkdir()
    if steps:
        (directory / records.METRICS_FILE).write_text('{"step": 0, "reward": 0.5}\n')
    return directory


def test_overwrite_never_deletes_what_is_not_a_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run.build, "model", lambda *a, **k: pytest.fail("compute started"))
    model = tmp_path / "hf_model"  # a Hugging Face directory also holds a config.json
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(b"weights")
    project = tmp_path / "thesis"
    project.mkdir()
    (project / "config.json").write_text('{"a": 1}')
    (project / "thesis.tex").write_text("chapter 1")
    (project / "src").mkdir()
    for directory in (model, project):
        before = sorted(os.listdir(directory))
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train", "--config", "tiny", "--run-dir", str(directory), "--steps", "1", "--overwrite"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "is not a run directory" in err and "nothing was deleted" in err
        assert sorted(os.listdir(directory)) == before  # not even a lock file left behind
    monkeypatch.chdir(project)
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "tiny", "--run-dir", ".", "--steps", "1", "--overwrite"])
    assert "nothing was deleted" in capsys.readouterr().err and (project / "thesis.tex").is_file()


def test_a_run_directory_holding_other_files_is_not_replaced_and_a_clean_one_is(tmp_path):
    config = runs.load("tiny")
    kept = _fake_run(tmp_path / "kept")
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(
        RunDirectoryError,
        match=r"holds files that are not the run's \(notes.txt\); nothing was "
        r"deleted",
    ):
        check_run_directory(config, kept, overwrite=True)
    clean = _fake_run(tmp_path / "clean")
    assert check_run_directory(config, clean, overwrite=True) is None


def test_a_start_that_completed_no_step_is_not_a_run_yet(tmp_path):
    other = runs.load("toy")
    started = _fake_run(tmp_path / "started", steps=False)
    assert not has_completed_step(started)
    assert check_run_directory(other, started) is None  # a new run takes its place
    with pytest.raises(RunDirectoryError, match="holds no completed step to resume from"):
        check_run_directory(other, started, resume=True)
    done = _fake_run(tmp_path / "done")
    assert has_completed_step(done)
    with pytest.raises(RunDirectoryError, match="holds a different run"):
        check_run_directory(other, done)


def test_one_process_at_a_time_and_a_killed_holder_does_not_block(tmp_path, capsys, monkeypatch):
    directory = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from jaxrl_llm.runs.directory import locked\n"
            f"with locked({str(directory)!r}):\n"
            "    print('locked', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setattr(run.build, "model", lambda *a, **k: pytest.fail("compute started"))
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train", "--config", "tiny", "--run-dir", str(directory), "--steps", "1"])
        assert exit_.value.code == 2
        assert f"is in use by another run (pid {holder.pid} on host " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with locked(directory):  # the kernel released the killed holder's lock; its file is still there
        assert (directory / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on host ")


@pytest.mark.parametrize(
    "error, reason",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
        (PermissionError(errno.EACCES, "Permission denied", "d"), f"permission denied ({os.path.abspath('d')})"),
        (
            ValueError(
                'RESOURCE_EXHAUSTED: Error writing "x": Failed to write 312 bytes: No space left on device '
                "[os_error_code='28']"
            ),
            "no space left on device",
        ),
        (RuntimeError("callback failed"), None),
    ],
)
def test_storage_failures_are_recognised_through_the_chain(error, reason):
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError("train stopped") from inner
    except RuntimeError as outer:
        assert storage_failure(outer) == reason


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_message_naming_the_intact_checkpoint(tmp_path, capsys, monkeypatch):
    save, saves = training.Checkpointer.save, []

    def fills_the_disk(self, step, *args, **kwargs):
        saves.append(step)
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, step, *args, **kwargs)

    def close_fails_too(self):
        raise OSError(errno.ENOSPC, "No space left on device")  # tensorboardX's close, say

    monkeypatch.setattr(training.Checkpointer, "save", fills_the_disk)
    monkeypatch.setattr(records.RunRecorder, "close", close_fails_too)
    directory = tmp_path / "run"
    assert cli.main(["train", "--config", "tiny", "--run-dir", str(directory), "--progress", "off"]) == 1
    lines = capsys.readouterr().err.strip().split("\n")
    assert lines[-2] == (
        "jaxrl-llm train: error: train stopped at step 4 (4 of 4 steps done): could not write the "
        "run's files: no space left on device."
    )
    assert lines[-1] == (
        f"The checkpoint of step 2 in {directory} is intact; free space (or make it writable) and "
        f"continue with: jaxrl-llm train --run-dir {directory} --resume"
    )
    assert [line.split(":")[0] for line in lines[:-2]] == [
        "Could not save a checkpoint of step 4",
        "Could not close the records",
    ]
    assert training.Checkpointer(directory / CHECKPOINTS).all_steps() == [2]


def test_a_users_error_reading_a_file_in_a_reward_function_is_not_a_disk_failure():
    try:
        try:
            open("/no/such/grader/answers.txt")
        except OSError as inner:
            raise rewards.RewardFunctionError("Reward function 'grade' raised FileNotFoundError") from inner
    except rewards.RewardFunctionError as error:
        denied = rewards.RewardFunctionError("Reward function 'grade' raised PermissionError: Permission denied")
        denied.__cause__ = PermissionError(errno.EACCES, "Permission denied", "/srv/answers.txt")
        assert storage_failure(error) is None and storage_failure(denied) is None


def test_a_directory_with_a_run_config_but_not_a_runs_checkpoints_is_not_replaced(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / CONFIG_FILE).write_text(json.dumps(to_dict(runs.load("tiny"))))  # a run's config, copied
    (project / CHECKPOINTS / "checkpoint-500").mkdir(parents=True)  # a Hugging Face Trainer's
    with pytest.raises(RunDirectoryError, match="is not a run directory"):
        check_run_directory(runs.load("tiny"), project, overwrite=True)
    assert (project / CHECKPOINTS / "checkpoint-500").is_dir()
    legacy = _fake_run(tmp_path / "legacy")  # a run from before markers is still replaced
    (legacy / MARKER_FILE).unlink()
    (legacy / CHECKPOINTS / "4").mkdir()
    assert check_run_directory(runs.load("tiny"), legacy, overwrite=True) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda d: (d / CONFIG_FILE).write_text("{}"),  # not what a run writes
        lambda d: (d / "eval" / "results.json").write_text("precious"),  # a run writes step-<n>.json there
        lambda d: (d / "wandb" / "run-1").mkdir(parents=True),  # the config logs to no wandb project
    ],
    ids=["empty config", "eval results", "wandb without a project"],
)
def test_a_directory_without_a_marker_is_replaced_only_if_it_holds_exactly_a_runs_files(tmp_path, make):
    directory = _fake_run(tmp_path / "d")
    (directory / MARKER_FILE).unlink()
    (directory / "eval").mkdir()
    (directory / "eval" / "step-3.json").write_text("{}")
    assert check_run_directory(runs.load("tiny"), directory, overwrite=True) is None
    make(directory)
    before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    with pytest.raises(RunDirectoryError, match="is not a run directory.*nothing was deleted"):
        check_run_directory(runs.load("tiny"), directory, overwrite=True)
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


def test_clearing_a_run_removes_links_without_following_them(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    directory = _fake_run(tmp_path / "run")
    (directory / "eval").symlink_to(target, target_is_directory=True)
    clear(directory)
    assert sorted(os.listdir(directory)) == [] and (target / "keep.txt").read_text() == "mine"


def test_an_export_under_a_file_is_refused_before_reading_anything(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirectoryError, match=r"lies under .*notes.txt', which is a file"):
        export_run(tmp_path / "no-run", tmp_path / "notes.txt" / "policy")


def test_a_killed_writers_temporaries_are_removed_when_the_run_opens_again(tmp_path):
    directory = _fake_run(tmp_path / "run")
    (directory / f".{records.PLOT_FILE}.4242.tmp").write_bytes(b"half a png")
    (directory / f".{CONFIG_FILE}.abc123").write_text("{")
    (directory / "notes.txt").write_text("mine")
    run._open_run_directory(runs.load("tiny"), directory, new=False, main=True)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [MARKER_FILE, CONFIG_FILE, CHECKPOINTS, records.METRICS_FILE, "notes.txt"]
    )
