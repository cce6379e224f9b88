"""A run whose latest checkpoint holds flipped bytes continues from the one before.

A flipped byte in a checkpoint's compressed data decodes, without an error, to other
values (NaN, in the fault probe that found it). The run must not continue from them: the
checkpoint fails its digest, is moved aside as ``unreadable-<step>`` with the reason
printed, and the run continues from the previous checkpoint, re-running the steps after it
exactly as they ran the first time, and saving them again.
"""

import dataclasses
import io

import pytest

from jaxrl_llm import cli, runs
from jaxrl_llm.runs import run
from jaxrl_llm.runs.directory import CHECKPOINTS
from tests.training.test_checkpoint import flip_bytes

METRICS = ("reward", "loss", "grad_norm", "kl_k3")

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning", "ignore:Checkpointer.restore:UserWarning"
)


@pytest.mark.slow
def test_a_run_continues_from_the_checkpoint_before_a_corrupt_latest_one(tmp_path, capsys):
    tiny = runs.load("tiny")
    config = dataclasses.replace(
        tiny,
        steps=3,
        save_every=1,
        keep_checkpoints=3,
        samples_every=100,
        plot_every=100,
        warm_start=dataclasses.replace(tiny.warm_start, steps=2),
        train=dataclasses.replace(tiny.train, eval_every=0),
    )
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / CHECKPOINTS
    run.train_run(config, run_dir, progress=False, stream=None)
    first = runs.read_metrics(run_dir)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2", "3"]
    leaf = flip_bytes(checkpoints / "3")

    out = io.StringIO()
    result = run.train_run(dataclasses.replace(config, steps=5), run_dir, resume=True, progress=False, stream=out)
    out = out.getvalue()
    assert (
        f"Checkpoint 3 cannot be used (ValueError: checksum mismatch in {leaf}: the stored data is not what was "
        f"saved); moved to {checkpoints / 'unreadable-3'}, continuing from step 2."
    ) in out
    assert "from its checkpoint of step 2 (of 5)" in out
    # Step 3 saved again, and the three kept are three good ones.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["3", "4", "5", "unreadable-3"]
    assert int(result.state.step) == 5
    rows = runs.read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    for again, before in zip(rows[:3], first, strict=True):  # step 2 again, from the good state
        assert {k: again[k] for k in METRICS} == {k: before[k] for k in METRICS}

    # The same step corrupted again: set aside beside the first, and the run goes on.
    flip_bytes(checkpoints / "5")
    result = run.train_run(config, run_dir, resume=True, progress=False, stream=None)  # steps=3: ends at once
    assert sorted(p.name for p in checkpoints.iterdir()) == ["3", "4", "unreadable-3", "unreadable-5"]
    flip_bytes(checkpoints / "4")
    (checkpoints / "unreadable-4").mkdir()
    out = io.StringIO()
    run.train_run(dataclasses.replace(config, steps=5), run_dir, resume=True, progress=False, stream=out)
    assert f"moved to {checkpoints / 'unreadable-4.2'}, continuing from step 3." in out.getvalue()
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "3", "4", "5", "unreadable-3", "unreadable-4", "unreadable-4.2", "unreadable-5"
    ]  # fmt: skip

    # None readable: one message, and the command that starts again.
    for step in ("3", "4", "5"):
        flip_bytes(checkpoints / step)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--run-dir", str(run_dir), "--resume", "--progress", "off"])
    err = capsys.readouterr().err.strip().split("\n")
    assert exit_.value.code == 2 and len(err) == 1, err
    assert f"cannot resume {str(run_dir)!r}: none of its checkpoints can be read (checkpoint 5: ValueError: " in err[0]
    assert err[0].endswith("Start again in another --run-dir, or in this one with --overwrite (which deletes them).")
